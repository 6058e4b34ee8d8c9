"""The Codec interface, codec ids mirroring the proto enum, dtype tables, and checks shared by every codec.

Codec modules register their class here; `swarm.codec.encode`/`decode` look codecs up in `CODECS`.
"""

from __future__ import annotations

import abc
import enum
import math
from typing import ClassVar

import torch
from google.protobuf.message import DecodeError

from swarm._proto import swarm_pb2 as pb
from swarm.errors import MalformedTensorError, UnknownCodecError

MAX_ELEMENTS = 1 << 34  # refuse shapes this large before allocating anything: no hidden state comes close
# A GPU codes a tensor with dozens of small kernels and a sync; below this size one copy to the host and the CPU's
# code are faster (a decode step's hidden state is a few thousand elements), so only larger tensors code on device.
DEVICE_CODING_MIN_ELEMENTS = 1 << 20


class CodecId(enum.IntEnum):
    """Mirrors `rayswarm.v1.Codec`; tests/unit/swarm/codec/test_registry.py keeps the two in step."""

    NONE = pb.CODEC_NONE
    FLOAT16 = pb.CODEC_FLOAT16
    BFLOAT16 = pb.CODEC_BFLOAT16
    INT8_BLOCKWISE_LINEAR = pb.CODEC_INT8_BLOCKWISE_LINEAR
    INT8_BLOCKWISE_DYNAMIC = pb.CODEC_INT8_BLOCKWISE_DYNAMIC
    INT8_HADAMARD = pb.CODEC_INT8_HADAMARD


TORCH_TO_WIRE_DTYPE: dict[torch.dtype, int] = {
    torch.float32: pb.DTYPE_FLOAT32,
    torch.float16: pb.DTYPE_FLOAT16,
    torch.bfloat16: pb.DTYPE_BFLOAT16,
    torch.int64: pb.DTYPE_INT64,
    torch.int32: pb.DTYPE_INT32,
    torch.bool: pb.DTYPE_BOOL,
}
WIRE_TO_TORCH_DTYPE: dict[int, torch.dtype] = {v: k for k, v in TORCH_TO_WIRE_DTYPE.items()}
FLOATING_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})


class Codec(abc.ABC):
    """Turns a tensor into a `pb.Tensor` and back. One instance per codec id, stateless and thread-safe."""

    codec_id: ClassVar[CodecId]
    default_block_size: ClassVar[int] = 0  # 0: the codec has no blocks
    block_sizes: ClassVar[frozenset[int]] = frozenset({0})
    floating_only: ClassVar[bool] = True

    def encode(self, tensor: torch.Tensor, block_size: int = 0) -> pb.Tensor:
        """Encode `tensor` (any device): a large one on its device (only the encoded bytes cross to host memory),
        a small one copied to the host first (DEVICE_CODING_MIN_ELEMENTS).

        Raises:
            MalformedTensorError: the dtype is not supported by this codec, or the values are not finite
                (8-bit codecs only: their per-block scale would be meaningless).
            UnknownCodecError: `block_size` is not one this codec supports.
        """
        block_size = block_size or self.default_block_size
        self._check_block_size(block_size)
        if tensor.dtype not in TORCH_TO_WIRE_DTYPE:
            raise MalformedTensorError(f"dtype {tensor.dtype} cannot be sent; supported: {list(TORCH_TO_WIRE_DTYPE)}")
        if self.floating_only and tensor.dtype not in FLOATING_DTYPES:
            raise MalformedTensorError(f"codec {self.codec_id.name} needs a floating tensor, got {tensor.dtype}")
        msg = pb.Tensor(dtype=TORCH_TO_WIRE_DTYPE[tensor.dtype], shape=tensor.shape, codec=self.codec_id)
        msg.block_size = block_size
        if tensor.device.type != "cpu" and tensor.numel() < DEVICE_CODING_MIN_ELEMENTS:
            tensor = tensor.cpu()
        self._encode_into(tensor.detach(), block_size, msg)
        return msg

    def decode(self, msg: pb.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
        """Decode one whole (un-chunked) message onto `device` (default: CPU), in the sender's dtype.

        Raises:
            MalformedTensorError: the message is truncated, garbled, or its payload does not match its shape.
            UnknownCodecError: the block size is not one this codec supports.
        """
        dtype, shape = validate_header(msg)
        self._check_block_size(msg.block_size)
        if self.floating_only and dtype not in FLOATING_DTYPES:
            raise MalformedTensorError(f"codec {self.codec_id.name} cannot carry dtype {dtype}")
        target = torch.device(device or "cpu")
        if target.type == "cpu" or math.prod(shape) >= DEVICE_CODING_MIN_ELEMENTS:
            return self._decode(msg, dtype, shape, target)
        return self._decode(msg, dtype, shape, torch.device("cpu")).to(target)  # one host-to-device copy

    @abc.abstractmethod
    def max_error(self, dtype: torch.dtype) -> float:
        """Worst-case relative L2 error ||decode(encode(x)) - x|| / ||x|| over a whole tensor, at the default
        block size. Tests and peers use it to tell codec error from a wrong result."""

    @abc.abstractmethod
    def _encode_into(self, tensor: torch.Tensor, block_size: int, msg: pb.Tensor) -> None:
        """Fill msg.payload (and msg.scales) from `tensor`; the header is already set."""

    @abc.abstractmethod
    def _decode(
        self, msg: pb.Tensor, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device
    ) -> torch.Tensor:
        """Rebuild the tensor from a message whose header has been validated."""

    def _check_block_size(self, block_size: int) -> None:
        if block_size not in self.block_sizes:
            raise UnknownCodecError(
                f"codec {self.codec_id.name} does not support block_size={block_size}; "
                f"supported: {sorted(self.block_sizes)}"
            )


def validate_header(msg: pb.Tensor) -> tuple[torch.dtype, tuple[int, ...]]:
    """Check the fields every codec relies on and return (dtype, shape)."""
    if msg.dtype not in WIRE_TO_TORCH_DTYPE:
        raise MalformedTensorError(f"unknown or missing dtype {msg.dtype} in Tensor message")
    shape = tuple(msg.shape)
    if any(dim < 0 for dim in shape):
        raise MalformedTensorError(f"negative dimension in shape {list(shape)}")
    if math.prod(shape) > MAX_ELEMENTS:
        raise MalformedTensorError(f"shape {list(shape)} has more than {MAX_ELEMENTS} elements")
    if msg.num_chunks > 1:
        raise MalformedTensorError(
            f"message is chunk {msg.chunk_index} of {msg.num_chunks}; join the chunks before decoding"
        )
    return WIRE_TO_TORCH_DTYPE[msg.dtype], shape


def parse_tensor(data: bytes) -> pb.Tensor:
    """Parse a serialized `Tensor` (e.g. read from disk or a raw stream); garbage raises MalformedTensorError."""
    try:
        return pb.Tensor.FromString(data)
    except DecodeError as error:
        raise MalformedTensorError(f"bytes are not a valid Tensor message ({len(data)} bytes): {error}") from error


def expect_length(field: str, actual: int, expected: int, msg: pb.Tensor) -> None:
    """Raise a MalformedTensorError naming the field when a byte length does not match the header."""
    if actual != expected:
        raise MalformedTensorError(
            f"{field} has {actual} bytes but shape {list(msg.shape)} with codec {CodecId(msg.codec).name} "
            f"and block_size {msg.block_size} needs {expected}"
        )


def tensor_to_bytes(tensor: torch.Tensor) -> bytes:
    """Host bytes of a tensor (bfloat16 goes through int16, which numpy can hold)."""
    tensor = tensor.contiguous().cpu()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.numpy().tobytes()


def bytes_to_tensor(data: bytes, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A fresh, writable 1-D tensor over a copy of `data` (messages are immutable), moved to `device`."""
    if not data:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.frombuffer(bytearray(data), dtype=dtype).to(device)


CODECS: dict[CodecId, Codec] = {}


def register(codec_cls: type[Codec]) -> type[Codec]:
    """Class decorator: one instance of each codec, keyed by its id."""
    CODECS[codec_cls.codec_id] = codec_cls()
    return codec_cls


def get_codec(codec_id: int) -> Codec:
    """The codec for a wire or enum id. Raises UnknownCodecError; there is never a fallback."""
    try:
        return CODECS[CodecId(codec_id)]
    except (ValueError, KeyError):
        known = ", ".join(f"{c.name}={c.value}" for c in CODECS)
        raise UnknownCodecError(f"unknown codec id {codec_id}; this peer knows {known}") from None
