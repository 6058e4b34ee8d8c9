"""8-bit blockwise codecs: each block of `block_size` elements is scaled by its absolute maximum.

INT8_BLOCKWISE_LINEAR (see docs/codecs.md) maps x to round(127 * x / absmax)
with plain torch ops, so it runs wherever the tensor lives (CPU or CUDA) and only the int8 payload and the
float32 scales cross to the host. INT8_BLOCKWISE_DYNAMIC stores indices into bitsandbytes' dynamic 8-bit code.
"""

from __future__ import annotations

import abc
import functools
import math

import torch

from swarm._proto import swarm_pb2 as pb
from swarm.codec.base import Codec, CodecId, bytes_to_tensor, expect_length, register, tensor_to_bytes
from swarm.errors import MalformedTensorError

BLOCK_SIZES = frozenset({64, 128, 256, 512, 1024, 2048, 4096})


class _BlockwiseCodec(Codec):
    """Shared wire layout: payload = one byte per element, scales = one float32 absmax per block."""

    block_sizes = BLOCK_SIZES

    def _encode_into(self, tensor: torch.Tensor, block_size: int, msg: pb.Tensor) -> None:
        flat = tensor.reshape(-1)
        if flat.dtype != torch.float32:
            flat = flat.float()
        codes, absmax = self._quantize(flat, block_size)
        if not bool(torch.isfinite(absmax).all()):
            raise MalformedTensorError("tensor holds NaN or Inf values, which 8-bit blockwise codecs cannot encode")
        msg.payload = tensor_to_bytes(codes)
        msg.scales = tensor_to_bytes(absmax)

    def _decode(
        self, msg: pb.Tensor, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device
    ) -> torch.Tensor:
        numel = math.prod(shape)
        num_blocks = -(-numel // msg.block_size)
        payload, scales = msg.payload, msg.scales  # each field access copies the bytes out of the message
        expect_length("payload", len(payload), numel, msg)
        expect_length("scales", len(scales), num_blocks * 4, msg)
        absmax = bytes_to_tensor(scales, torch.float32, device)
        if num_blocks and not bool((torch.isfinite(absmax) & (absmax >= 0)).all()):
            raise MalformedTensorError("scales hold negative, NaN or Inf values")
        codes = bytes_to_tensor(payload, self._code_dtype, device)
        return self._dequantize(codes, absmax, msg.block_size).view(shape).to(dtype)

    _code_dtype: torch.dtype

    @abc.abstractmethod
    def _quantize(self, flat: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 [n] -> (codes [n], absmax [ceil(n / block_size)])."""

    @abc.abstractmethod
    def _dequantize(self, codes: torch.Tensor, absmax: torch.Tensor, block_size: int) -> torch.Tensor:
        """(codes [n], absmax [blocks]) -> float32 [n]."""


def _split_blocks(flat: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the full blocks [full, block_size] and of the ragged tail [< block_size], without copying."""
    full = flat.numel() // block_size
    return flat[: full * block_size].view(full, block_size), flat[full * block_size :]


@register
class Int8BlockwiseLinear(_BlockwiseCodec):
    """int8 = round(127 * x / absmax(block)): uniform steps of absmax / 127 within a block."""

    codec_id = CodecId.INT8_BLOCKWISE_LINEAR
    default_block_size = 64
    _code_dtype = torch.int8

    def max_error(self, dtype: torch.dtype) -> float:
        # Each element is off by at most absmax / 254, and absmax <= the block's L2 norm.
        return math.sqrt(self.default_block_size) / 254

    def _quantize(self, flat: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        codes = torch.empty(flat.shape, dtype=torch.int8, device=flat.device)
        blocks, tail = _split_blocks(flat, block_size)
        code_blocks, code_tail = _split_blocks(codes, block_size)
        absmax = absmax_rows(blocks)
        _scale_round_into(blocks, absmax, code_blocks)
        if tail.numel():
            tail_absmax = absmax_rows(tail.unsqueeze(0))
            _scale_round_into(tail.unsqueeze(0), tail_absmax, code_tail.unsqueeze(0))
            absmax = torch.cat([absmax, tail_absmax])
        return codes, absmax

    def _dequantize(self, codes: torch.Tensor, absmax: torch.Tensor, block_size: int) -> torch.Tensor:
        out = codes.to(torch.float32)
        steps = absmax / 127
        out_blocks, out_tail = _split_blocks(out, block_size)
        out_blocks.mul_(steps[: out_blocks.shape[0]].unsqueeze(1))
        if out_tail.numel():
            out_tail.mul_(steps[-1])
        return out


def absmax_rows(blocks: torch.Tensor) -> torch.Tensor:
    """max |x| per row. amax and amin are vectorised reductions, several times faster than abs().amax() on CPU;
    both propagate NaN, so the finiteness check on the result covers every element."""
    return torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_())


def _scale_round_into(blocks: torch.Tensor, absmax: torch.Tensor, codes: torch.Tensor) -> None:
    """codes <- round(blocks * 127 / absmax), row by row; an all-zero block (absmax 0) encodes as zeros.

    On CPU the work goes in slices whose float32 scratch stays in cache: measured 3-4x faster on 64 MB than
    materialising the scaled tensor (docs/codecs.md)."""
    inverse = torch.where(absmax > 0, 127.0 / absmax, torch.zeros_like(absmax)).unsqueeze(1)
    rows_per_slice = blocks.shape[0] if blocks.device.type != "cpu" else max(1, CPU_SLICE_ELEMENTS // blocks.shape[1])
    scratch = torch.empty((min(rows_per_slice, blocks.shape[0]), blocks.shape[1]), device=blocks.device)
    for first in range(0, blocks.shape[0], rows_per_slice):
        last = min(first + rows_per_slice, blocks.shape[0])
        scaled = scratch[: last - first]
        torch.mul(blocks[first:last], inverse[first:last], out=scaled)
        codes[first:last].copy_(scaled.round_())


CPU_SLICE_ELEMENTS = 1 << 18  # 1 MiB of float32 scratch: fits L2 on the machines we measured


@register
class Int8BlockwiseDynamic(_BlockwiseCodec):
    """bitsandbytes' dynamic 8-bit code: finer steps near zero, coarser near the block's absmax."""

    codec_id = CodecId.INT8_BLOCKWISE_DYNAMIC
    default_block_size = 4096
    _code_dtype = torch.uint8

    def max_error(self, dtype: torch.dtype) -> float:
        # bitsandbytes' CPU path does not always round to nearest: allow a whole gap of the code per element.
        code = _dynamic_code(torch.device("cpu"))
        return math.sqrt(self.default_block_size) * float((code[1:] - code[:-1]).max())

    def _quantize(self, flat: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        from bitsandbytes.functional import quantize_blockwise

        if not bool(torch.isfinite(flat).all()):  # bitsandbytes' absmax skips NaN, so check the values themselves
            raise MalformedTensorError("tensor holds NaN or Inf values, which 8-bit blockwise codecs cannot encode")
        codes, state = quantize_blockwise(flat, code=_dynamic_code(flat.device), blocksize=block_size)
        return codes, state.absmax

    def _dequantize(self, codes: torch.Tensor, absmax: torch.Tensor, block_size: int) -> torch.Tensor:
        from bitsandbytes.functional import dequantize_blockwise

        code = _dynamic_code(codes.device)
        return dequantize_blockwise(codes, absmax=absmax, code=code, blocksize=block_size).float()


@functools.cache
def _dynamic_code(device: torch.device) -> torch.Tensor:
    from bitsandbytes.functional import create_dynamic_map

    return create_dynamic_map(signed=True).to(device)
