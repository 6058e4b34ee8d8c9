"""Truncated, garbled and inconsistent Tensor messages each raise an error that names the problem."""

from __future__ import annotations

import pytest
import torch

from swarm._proto import swarm_pb2 as pb
from swarm.codec import CodecId, decode, encode, parse_tensor
from swarm.errors import InvalidRequest, MalformedTensorError


@pytest.mark.parametrize("codec_id", list(CodecId))
def test_truncated_serialized_message_is_refused(codec_id: CodecId) -> None:
    data = encode(torch.randn(2, 64, 64), codec_id).SerializeToString()
    for cut in (1, 7, len(data) // 2, len(data) - 3):
        # Depending on where the cut falls: unparseable, a field gone (codec, dtype), or a short payload.
        with pytest.raises(InvalidRequest, match=r"not a valid Tensor|unknown|bytes but shape|dtype|scales"):
            decode(parse_tensor(data[:cut]))


def test_garbled_bytes_are_refused() -> None:
    rng = torch.Generator().manual_seed(0)
    for _ in range(200):
        data = bytes(torch.randint(0, 256, (int(torch.randint(1, 300, (1,), generator=rng)),), generator=rng).tolist())
        with pytest.raises(InvalidRequest):
            decode(parse_tensor(data))


@pytest.mark.parametrize("codec_id", list(CodecId))
def test_shape_that_does_not_match_the_payload_is_refused(codec_id: CodecId) -> None:
    msg = encode(torch.randn(4, 64), codec_id)
    msg.shape[0] = 5
    with pytest.raises(MalformedTensorError, match=r"payload has .* bytes but shape \[5, 64\]"):
        decode(msg)


def test_negative_and_huge_shapes_are_refused_before_allocating() -> None:
    msg = encode(torch.randn(4), CodecId.NONE)
    msg.shape[0] = -4
    with pytest.raises(MalformedTensorError, match="negative dimension"):
        decode(msg)
    msg.shape[:] = [1 << 20, 1 << 20, 1 << 10]
    with pytest.raises(MalformedTensorError, match="more than"):
        decode(msg)


def test_missing_dtype_is_refused() -> None:
    msg = encode(torch.randn(4), CodecId.NONE)
    msg.dtype = pb.DTYPE_UNSPECIFIED
    with pytest.raises(MalformedTensorError, match="dtype"):
        decode(msg)


def test_an_8bit_codec_cannot_claim_an_integer_dtype() -> None:
    msg = encode(torch.randn(64), CodecId.INT8_BLOCKWISE_LINEAR)
    msg.dtype = pb.DTYPE_INT64
    with pytest.raises(MalformedTensorError, match="cannot carry dtype"):
        decode(msg)
