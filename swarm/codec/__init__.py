"""Tensor <-> protobuf `Tensor` codecs.

base.py: Codec ABC, CodecId, dtype tables, registry; float_cast.py: NONE, FLOAT16, BFLOAT16;
int8_blockwise.py: INT8_BLOCKWISE_LINEAR and INT8_BLOCKWISE_DYNAMIC (bitsandbytes); int8_hadamard.py:
INT8_HADAMARD, the default for hidden states (exact outliers + rotated int8);
chunking.py: split and join messages larger than the gRPC limit.
"""

from __future__ import annotations

import torch

from swarm._proto import swarm_pb2 as pb
from swarm.codec import float_cast, int8_blockwise, int8_hadamard  # noqa: F401  (importing registers the codecs)
from swarm.codec.base import CODECS, Codec, CodecId, get_codec, parse_tensor
from swarm.codec.chunking import join, split

DEFAULT_CODEC = CodecId.INT8_HADAMARD
DEFAULT_BLOCK_SIZE = int8_hadamard.Int8Hadamard.default_block_size
# Below this many bytes (in the tensor's own dtype) hidden states travel uncompressed by default: a decode step's
# few KB save well under a millisecond even at 100 Mbit/s, while the 8-bit codec costs ~3 ms of CPU per hop and a
# rounding; from ~64 KB up (a prefill, a batch of a big model) it saves more link time than it costs
# (docs/codecs.md).
DEFAULT_COMPRESS_MIN_BYTES = 65536


def encode(tensor: torch.Tensor, codec: CodecId, block_size: int = 0, compress_min_bytes: int = 0) -> pb.Tensor:
    """Encode `tensor` with `codec` (block_size 0: the codec's default), or uncompressed when it holds fewer than
    `compress_min_bytes` bytes. See Codec.encode for errors."""
    if tensor.numel() * tensor.element_size() < compress_min_bytes:
        codec, block_size = CodecId.NONE, 0
    return get_codec(codec).encode(tensor, block_size)


def decode(msg: pb.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """Decode a whole message onto `device` (default CPU). See Codec.decode for errors."""
    return get_codec(msg.codec).decode(msg, device)


__all__ = [
    "CODECS",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_CODEC",
    "DEFAULT_COMPRESS_MIN_BYTES",
    "Codec",
    "CodecId",
    "decode",
    "encode",
    "get_codec",
    "join",
    "parse_tensor",
    "split",
]
