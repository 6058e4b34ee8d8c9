"""A span of consecutive transformer blocks [start, end) built from a checkpoint, and a contiguous KV cache for
one session run locally (the demo, reference runs in tests; peers keep theirs in pages, peers/kv_cache.py).

Peers (peers/task_runner.py, peers/model_runner.py) run spans; clients chain them. Loading reads only the span's
tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from swarm.errors import CheckpointError, InvalidRequest, InvalidSpan
from swarm.partition.architecture import BlockConfig, architecture_of
from swarm.partition.config import open_checkpoint
from swarm.partition.layers import KVLayer, RotaryEmbedding, ScoreRule, causal_attention
from swarm.partition.quantize import Quant, check_quant, module_bytes, quantize_linears
from swarm.progress import progress_bar

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from swarm.partition.config import PortableConfig


class SpanCache:
    """KV cache of one session on one span, preallocated for `max_length` tokens per sequence.

    `length` is the number of positions held. A step at a position below `length` overwrites from there on,
    which is how rollback and prefix replay work.
    """

    def __init__(
        self, cfg: BlockConfig, num_blocks: int, batch_size: int, max_length: int, dtype: torch.dtype, device: str
    ) -> None:
        if batch_size < 1 or max_length < 1:
            raise InvalidRequest(f"cache needs batch_size >= 1 and max_length >= 1, got {batch_size}, {max_length}")
        kv_heads, head_dim = architecture_of(cfg.model_type).kv_shape(cfg)
        shape = (num_blocks, batch_size, kv_heads, max_length, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # [blocks, batch, kv_heads, max_length, head_dim]
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.batch_size = batch_size
        self.max_length = max_length
        self.length = 0

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def layer(self, block_offset: int, position: int) -> KVLayer:
        """The cache of one block, for new tokens that start at `position`."""
        return _ContiguousLayer(self.keys[block_offset], self.values[block_offset], position)


@dataclass(frozen=True, slots=True)
class _ContiguousLayer:
    keys: torch.Tensor  # [batch, kv_heads, max_length, head_dim]
    values: torch.Tensor  # [batch, kv_heads, max_length, head_dim]
    position: int  # of the first new token

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rule: ScoreRule | None = None) -> torch.Tensor:
        end = self.position + k.shape[2]
        self.keys[:, :, self.position : end] = k
        self.values[:, :, self.position : end] = v
        return causal_attention(q, self.keys[:, :, :end], self.values[:, :, :end], q.shape[1] != k.shape[1], rule)


class BlockSpan(nn.Module):
    """Blocks [start, end) of a model, of the family `cfg.model_type` names (architecture.py); forward maps hidden
    states [batch, seq, hidden] to the same shape."""

    def __init__(self, cfg: BlockConfig, rotary: RotaryEmbedding, start: int, end: int) -> None:
        super().__init__()
        if not 0 <= start < end <= cfg.num_layers:
            raise InvalidSpan(f"span [{start}, {end}) is empty or outside the model's {cfg.num_layers} blocks")
        self.cfg, self.start, self.end = cfg, start, end
        self.rotary = rotary
        self.architecture = architecture_of(cfg.model_type)
        self.blocks = nn.ModuleList(self.architecture.block(cfg) for _ in range(end - start))

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the blocks compute in: their floating-point weights' (quantised layers hold integer ones)."""
        return next(p.dtype for p in self.blocks[0].parameters() if p.is_floating_point())

    @property
    def device(self) -> torch.device:
        return next(self.blocks[0].parameters()).device

    @property
    def kv_shape(self) -> tuple[int, int]:
        """(kv_heads, head_dim) of one token's key or value in one block (Architecture.kv_shape)."""
        return self.architecture.kv_shape(self.cfg)

    def check_context(self, tokens: int) -> None:
        """InvalidRequest unless a sequence may hold `tokens` positions in these blocks (Architecture.check_context:
        a sliding window this repository does not compute, for one)."""
        self.architecture.check_context(self.cfg, tokens)

    def parameter_bytes(self) -> int:
        """Bytes of the blocks' weights as held (quantised layers' scales included)."""
        return sum(module_bytes(block) for block in self.blocks)

    def new_cache(self, batch_size: int, max_length: int, blocks: range | None = None) -> SpanCache:
        """A KV cache for all blocks of the span, or for the sub-range `blocks` (absolute indices)."""
        num_blocks = len(self.sub_range(blocks))
        self.check_context(max_length)
        return SpanCache(self.cfg, num_blocks, batch_size, max_length, self.dtype, str(self.device))

    def sub_range(self, blocks: range | None) -> range:
        """Absolute block indices to run; InvalidSpan unless they are a non-empty part of [start, end)."""
        if blocks is None:
            return range(self.start, self.end)
        if not (self.start <= blocks.start < blocks.stop <= self.end and blocks.step == 1):
            raise InvalidSpan(
                f"blocks [{blocks.start}, {blocks.stop}) are not within this span [{self.start}, {self.end})"
            )
        return blocks

    def forward(
        self,
        hidden: torch.Tensor,
        position: int = 0,
        cache: SpanCache | None = None,
        blocks: range | None = None,
        prompts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the span (or its sub-range `blocks`) on hidden [batch, seq, hidden] whose first token sits at
        absolute `position`; `prompts` [blocks, batch or 1, pre_seq_len, hidden] are deep prompts (see `run`).

        With a cache, the new tokens attend to the cached positions [0, position) and are stored there;
        without one, they attend only to each other (causally), as in training.

        Raises:
            InvalidRequest: wrong shape, or a position/length the cache cannot hold.
            InvalidSpan: `blocks` is not within the span.
        """
        self._check_input(hidden, position, cache)
        hidden = hidden.to(device=self.device, dtype=self.dtype)
        cos, sin = self.rotary(position, hidden.shape[1], hidden.dtype)
        layers = (lambda offset: cache.layer(offset, position)) if cache is not None else None
        hidden = self.run(hidden, cos, sin, layers, blocks, prompts)
        if cache is not None:
            cache.length = position + hidden.shape[1]
        return hidden

    def run(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: Callable[[int], KVLayer] | None,
        blocks: range | None = None,
        prompts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The blocks on hidden [batch, seq, hidden] already on the span's device and dtype, with rotary tables
        cos, sin [seq, head_dim] and `kv(offset)`, the KV layer of the offset-th block run (None: no cache).

        Deep prompt tuning (Petals' deep_ptune): `prompts` [blocks, batch or 1, pre_seq_len, hidden] holds, for
        the offset-th block run, what is added to the first pre_seq_len positions of the hidden states entering
        it (out of place, so that autograd sees it)."""
        blocks = self.sub_range(blocks)
        for offset, index in enumerate(blocks):
            if prompts is not None:
                pre = prompts.shape[2]
                hidden = torch.cat([hidden[:, :pre] + prompts[offset].to(hidden.dtype), hidden[:, pre:]], dim=1)
            hidden = self.blocks[index - self.start](hidden, cos, sin, kv(offset) if kv is not None else None)
            if hidden.dtype == torch.float16:
                hidden = clamp_to_float16(hidden)
        return hidden

    def _check_input(self, hidden: torch.Tensor, position: int, cache: SpanCache | None) -> None:
        if hidden.dim() != 3 or hidden.shape[2] != self.cfg.hidden_size or hidden.shape[1] == 0:
            raise InvalidRequest(
                f"hidden_states must be [batch, seq>0, {self.cfg.hidden_size}], got {list(hidden.shape)}"
            )
        if position < 0:
            raise InvalidRequest(f"position must be >= 0, got {position}")
        self.check_context(position + hidden.shape[1])
        if cache is None:
            return
        if hidden.shape[0] != cache.batch_size:
            raise InvalidRequest(f"batch size {hidden.shape[0]} does not match the cache's {cache.batch_size}")
        if position > cache.length:
            raise InvalidRequest(f"position {position} skips past the cache's {cache.length} tokens")
        if position + hidden.shape[1] > cache.max_length:
            raise InvalidRequest(
                f"{hidden.shape[1]} tokens at position {position} exceed the session's max_length {cache.max_length}"
            )


FLOAT16_LIMIT = torch.finfo(torch.float16).max - 1000.0  # headroom for the next residual add's rounding


def clamp_to_float16(hidden: torch.Tensor) -> torch.Tensor:
    """A float16 block's output clamped into float16's range: the residual stream of some models grows past 65,504
    in a few channels, and an Inf there would poison every later block and the next peer (whose output checks
    refuse it). The same guard as transformers' T5 in float16; bfloat16 and float32 need none."""
    return hidden.clamp(-FLOAT16_LIMIT, FLOAT16_LIMIT)


def load_span(
    path: str | Path,
    start: int,
    end: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    progress: bool = False,
    quant: Quant = "none",
    hf_config: PretrainedConfig | PortableConfig | None = None,
) -> BlockSpan:
    """Build blocks [start, end) of the checkpoint at `path`, reading only their tensors, one block at a time: each
    block is read, converted (to `dtype`, its linear layers to `quant`: swarm/partition/quantize.py) and moved to
    `device` before the next is read, so the span is never staged whole in host memory. With `progress`, a bar of
    the blocks loaded is drawn on a terminal. `hf_config`: the checkpoint's config, already read (open_checkpoint).

    Raises:
        CheckpointError, UnsupportedArchitectureError: see open_checkpoint; also tensors missing for a block.
        InvalidSpan: the range is empty or outside the model.
        InvalidRequest: an unknown `quant`.
    """
    quant = check_quant(quant)
    checkpoint, hf_config, cfg = open_checkpoint(path, hf_config)
    architecture = architecture_of(cfg.model_type)
    rotary = architecture.rotary(hf_config, cfg)  # built outside the meta context: its table is real
    with torch.device("meta"):
        span = BlockSpan(cfg, rotary, start, end)
    description = f"loading blocks [{start}, {end})" + (f" as {quant}" if quant != "none" else "")
    with progress_bar(end - start, description, unit="block", enabled=progress) as bar:
        for index, block in zip(range(start, end), span.blocks, strict=True):
            names = architecture.block_tensors(cfg, index)  # checkpoint name -> name within the block
            tensors = checkpoint.read(names, dtype=dtype)
            try:
                block.load_state_dict({names[n]: t for n, t in tensors.items()}, strict=False, assign=True)
            except RuntimeError as error:
                raise CheckpointError(f"checkpoint {checkpoint.path} does not fit block {index}: {error}") from error
            quantize_linears(block, quant, device, dtype)
            block.to(device)
            bar.update(1)
    _check_all_loaded(span, checkpoint.path, start, end)
    span.rotary.to(device)
    return span.eval()


def _check_all_loaded(span: BlockSpan, path: Path, start: int, end: int) -> None:
    missing = [name for name, p in span.named_parameters() if p.is_meta]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks weights for blocks [{start}, {end}): {missing[:5]}")
