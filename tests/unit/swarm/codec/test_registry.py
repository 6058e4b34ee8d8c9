from __future__ import annotations

import pytest
import torch

from swarm._proto import swarm_pb2 as pb
from swarm.codec import CODECS, CodecId, decode, encode, get_codec
from swarm.errors import UnknownCodecError


def test_every_proto_codec_has_a_registered_codec() -> None:
    wire_ids = {value.number for value in pb.Codec.DESCRIPTOR.values if value.number != pb.CODEC_UNSPECIFIED}
    assert wire_ids == {int(codec_id) for codec_id in CodecId}
    assert set(CODECS) == set(CodecId)
    for codec_id, codec in CODECS.items():
        assert codec.codec_id == codec_id
        assert CodecId[codec_id.name] == pb.Codec.Value(f"CODEC_{codec_id.name}")


@pytest.mark.parametrize("codec_id", list(CodecId))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_codec_round_trips_floating_tensors(codec_id: CodecId, dtype: torch.dtype) -> None:
    tensor = torch.randn(3, 7, 96, generator=torch.Generator().manual_seed(1)).to(dtype)
    decoded = decode(encode(tensor, codec_id))
    assert decoded.dtype == dtype and decoded.shape == tensor.shape
    error = (decoded.float() - tensor.float()).norm() / tensor.float().norm()
    dtype_rounding = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[dtype]
    assert error <= get_codec(codec_id).max_error(dtype) + dtype_rounding


@pytest.mark.parametrize("codec_id", [0, 99, -1])
def test_unknown_codec_ids_are_refused(codec_id: int) -> None:
    with pytest.raises(UnknownCodecError, match=f"unknown codec id {codec_id}"):
        get_codec(codec_id)


def test_a_message_without_codec_is_refused() -> None:
    msg = encode(torch.ones(4), CodecId.NONE)
    msg.codec = pb.CODEC_UNSPECIFIED
    with pytest.raises(UnknownCodecError, match="unknown codec id 0"):
        decode(msg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensors_below_compress_min_bytes_travel_uncompressed_and_exact(dtype: torch.dtype) -> None:
    decode_step = torch.randn(1, 1, 576).to(dtype)  # 2.3 KB in float32
    prefill = torch.randn(1, 64, 576).to(dtype)  # 147 KB in float32, 74 KB in bfloat16
    small = encode(decode_step, CodecId.INT8_HADAMARD, compress_min_bytes=65536)
    assert small.codec == pb.CODEC_NONE and torch.equal(decode(small), decode_step)
    assert encode(prefill, CodecId.INT8_HADAMARD, compress_min_bytes=65536).codec == pb.CODEC_INT8_HADAMARD
    assert encode(decode_step, CodecId.INT8_HADAMARD).codec == pb.CODEC_INT8_HADAMARD  # 0: always the codec
