"""Uncompressed and cast codecs: NONE (raw bytes in the tensor's dtype), FLOAT16 and BFLOAT16."""

from __future__ import annotations

import math

import torch

from swarm._proto import swarm_pb2 as pb
from swarm.codec.base import Codec, CodecId, bytes_to_tensor, expect_length, register, tensor_to_bytes


@register
class RawCodec(Codec):
    """The tensor's own bytes: exact, any dtype."""

    codec_id = CodecId.NONE
    floating_only = False

    def max_error(self, dtype: torch.dtype) -> float:
        return 0.0

    def _encode_into(self, tensor: torch.Tensor, block_size: int, msg: pb.Tensor) -> None:
        msg.payload = tensor_to_bytes(tensor)

    def _decode(
        self, msg: pb.Tensor, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device
    ) -> torch.Tensor:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        payload = msg.payload  # each field access copies the bytes out of the message
        expect_length("payload", len(payload), math.prod(shape) * itemsize, msg)
        wire_dtype = torch.int16 if dtype == torch.bfloat16 else dtype
        return bytes_to_tensor(payload, wire_dtype, device).view(dtype).view(shape)


class _CastCodec(Codec):
    """Floating tensors cast to a 16-bit type on the wire and back to their dtype on decode."""

    wire_dtype: torch.dtype
    relative_error: float  # half a unit in the last place of the wire type

    def max_error(self, dtype: torch.dtype) -> float:
        return self.relative_error

    def _encode_into(self, tensor: torch.Tensor, block_size: int, msg: pb.Tensor) -> None:
        msg.payload = tensor_to_bytes(tensor.to(self.wire_dtype))

    def _decode(
        self, msg: pb.Tensor, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device
    ) -> torch.Tensor:
        payload = msg.payload  # each field access copies the bytes out of the message
        expect_length("payload", len(payload), math.prod(shape) * 2, msg)
        raw = bytes_to_tensor(payload, torch.int16, device).view(self.wire_dtype)
        return raw.to(dtype).view(shape)


@register
class Float16Codec(_CastCodec):
    codec_id = CodecId.FLOAT16
    wire_dtype = torch.float16
    relative_error = 2.0**-11


@register
class BFloat16Codec(_CastCodec):
    codec_id = CodecId.BFLOAT16
    wire_dtype = torch.bfloat16
    relative_error = 2.0**-8
