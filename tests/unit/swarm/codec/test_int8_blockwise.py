from __future__ import annotations

import math

import pytest
import torch

from swarm.codec import CodecId, decode, encode, get_codec
from swarm.errors import MalformedTensorError, UnknownCodecError

BLOCKWISE = [CodecId.INT8_BLOCKWISE_LINEAR, CodecId.INT8_BLOCKWISE_DYNAMIC]


@pytest.mark.parametrize("codec_id", BLOCKWISE)
@pytest.mark.parametrize("block_size", [64, 256, 4096])
def test_wire_layout_is_one_byte_per_element_plus_a_scale_per_block(codec_id: CodecId, block_size: int) -> None:
    tensor = torch.randn(5, 1000)
    msg = encode(tensor, codec_id, block_size)
    assert msg.block_size == block_size
    assert len(msg.payload) == tensor.numel()
    assert len(msg.scales) == 4 * math.ceil(tensor.numel() / block_size)


def test_linear_error_is_at_most_half_a_step_per_element() -> None:
    tensor = torch.randn(10, 640) * 3
    decoded = decode(encode(tensor, CodecId.INT8_BLOCKWISE_LINEAR, 64))
    absmax = tensor.view(-1, 64).abs().amax(1, keepdim=True)
    assert ((decoded - tensor).view(-1, 64).abs() <= absmax / 254 * (1 + 1e-5)).all()


@pytest.mark.parametrize("numel", [1, 63, 65, 64 * 3 + 1])
def test_linear_handles_a_ragged_tail(numel: int) -> None:
    tensor = torch.randn(numel)
    decoded = decode(encode(tensor, CodecId.INT8_BLOCKWISE_LINEAR, 64))
    assert decoded.shape == tensor.shape
    assert (decoded - tensor).abs().max() <= tensor.abs().max() / 254 * (1 + 1e-5)


@pytest.mark.parametrize("codec_id", BLOCKWISE)
def test_all_zero_blocks_decode_to_zero(codec_id: CodecId) -> None:
    tensor = torch.zeros(3, 128)
    tensor[2, 5] = 1.5
    decoded = decode(encode(tensor, codec_id, 64))
    assert torch.count_nonzero(decoded[:2]) == 0
    assert decoded[2, 5] == pytest.approx(1.5, rel=0.01)


@pytest.mark.parametrize("codec_id", [*BLOCKWISE, CodecId.INT8_HADAMARD])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_values_are_refused(codec_id: CodecId, bad: float) -> None:
    tensor = torch.randn(4, 64)
    tensor[1, 3] = bad
    with pytest.raises(MalformedTensorError, match="NaN or Inf"):
        encode(tensor, codec_id)


@pytest.mark.parametrize("codec_id", [*BLOCKWISE, CodecId.INT8_HADAMARD])
def test_unsupported_block_size_is_refused_on_both_sides(codec_id: CodecId) -> None:
    with pytest.raises(UnknownCodecError, match="block_size=100"):
        encode(torch.randn(200), codec_id, 100)
    msg = encode(torch.randn(200), codec_id, 64)
    msg.block_size = 100
    with pytest.raises(UnknownCodecError, match="block_size=100"):
        decode(msg)


@pytest.mark.parametrize("codec_id", BLOCKWISE)
def test_negative_or_nan_scales_are_refused(codec_id: CodecId) -> None:
    msg = encode(torch.randn(128), codec_id, 64)
    msg.scales = torch.tensor([1.0, -1.0]).numpy().tobytes()
    with pytest.raises(MalformedTensorError, match="scales"):
        decode(msg)


def test_dynamic_codec_is_more_accurate_near_zero_than_linear() -> None:
    # The dynamic code spends its levels near zero: small values next to a large one survive better.
    tensor = torch.full((64,), 0.01)
    tensor[0] = 10.0
    linear = decode(encode(tensor, CodecId.INT8_BLOCKWISE_LINEAR, 64))
    dynamic = decode(encode(tensor, CodecId.INT8_BLOCKWISE_DYNAMIC, 64))
    assert (dynamic[1:] - tensor[1:]).abs().max() < (linear[1:] - tensor[1:]).abs().max()


def test_max_error_bounds_are_positive_and_ordered() -> None:
    linear = get_codec(CodecId.INT8_BLOCKWISE_LINEAR).max_error(torch.float32)
    assert 0 < get_codec(CodecId.FLOAT16).max_error(torch.float32) < linear
