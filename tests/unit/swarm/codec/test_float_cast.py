from __future__ import annotations

import pytest
import torch

from swarm.codec import CodecId, decode, encode
from swarm.errors import MalformedTensorError


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(2, 5, 3),
        torch.randn(4, 4).to(torch.bfloat16),
        torch.randn(8).half(),
        torch.arange(-5, 5, dtype=torch.int64).view(2, 5),
        torch.arange(7, dtype=torch.int32),
        torch.tensor([True, False, True]),
        torch.tensor(3.5),
        torch.empty(0, 576),
    ],
)
def test_none_codec_is_exact_for_every_dtype(tensor: torch.Tensor) -> None:
    decoded = decode(encode(tensor, CodecId.NONE))
    assert decoded.dtype == tensor.dtype
    assert torch.equal(decoded, tensor)
    decoded.fill_(0)  # the result is writable and owns its memory


def test_none_codec_is_exact_on_non_contiguous_input() -> None:
    tensor = torch.randn(6, 8).t()[::2]
    assert torch.equal(decode(encode(tensor, CodecId.NONE)), tensor)


@pytest.mark.parametrize(("codec_id", "bound"), [(CodecId.FLOAT16, 2.0**-11), (CodecId.BFLOAT16, 2.0**-8)])
def test_cast_codecs_stay_within_half_an_ulp(codec_id: CodecId, bound: float) -> None:
    tensor = torch.randn(64, 64) * 10
    decoded = decode(encode(tensor, codec_id))
    assert decoded.dtype == torch.float32
    assert ((decoded - tensor).abs() <= tensor.abs() * bound).all()
    assert len(encode(tensor, codec_id).payload) == tensor.numel() * 2


def test_cast_codecs_refuse_integer_tensors() -> None:
    with pytest.raises(MalformedTensorError, match="needs a floating tensor"):
        encode(torch.arange(4), CodecId.FLOAT16)


def test_unsupported_dtype_is_refused() -> None:
    with pytest.raises(MalformedTensorError, match="cannot be sent"):
        encode(torch.zeros(3, dtype=torch.complex64), CodecId.NONE)
