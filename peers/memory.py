"""How many blocks fit a peer's memory: weights plus the KV-cache pool when serving, weights plus gradients and
optimizer state when training. Called by the peer daemon when it is not told its span, and by the simulator. And
how many KV pages a peer's pool gets (`kv_pool_pages`), called by the server inside the process that owns the device.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from peers.kv_cache import PoolShape
from swarm.errors import InvalidRequest
from swarm.partition.architecture import BlockConfig, architecture_of
from swarm.partition.quantize import Quant, planned_bytes

if TYPE_CHECKING:
    from peers.config import PeerConfig
    from swarm.partition import BlockSpan

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GIB = 1 << 30
DETECTED_MEMORY_SHARE = 0.9  # of what the device reports free: allocator slack, activations, the CUDA context
FP32_BYTES = 4
ADAM_STATE_BYTES = 8  # two fp32 moments per parameter
DEFAULT_CACHE_TOKENS = 65536  # placement's assumption per block when the pool is sized from free memory
WORKSPACE_BYTES = 256 << 20  # kernels' workspaces and allocator slack, beside one iteration's activations
HOST_POOL_SHARE = 0.5  # of a host's free memory, when a CPU peer sizes its pool: the OS and clients share it


def block_parameters(cfg: BlockConfig) -> int:
    """Parameters of one block of cfg's family (every expert of a sparse MoE block counts), from the config alone."""
    return architecture_of(cfg.model_type).block_parameters(cfg)


def kv_cache_bytes_per_token(cfg: BlockConfig, dtype: str) -> int:
    """Bytes one token occupies in one block's KV cache (a key and a value per KV head)."""
    kv_heads, head_dim = architecture_of(cfg.model_type).kv_shape(cfg)
    return 2 * kv_heads * head_dim * DTYPE_BYTES[dtype]


@functools.lru_cache(maxsize=64)
def block_weight_bytes(cfg: BlockConfig, dtype: str, quant: Quant = "none") -> int:
    """Bytes of one block's weights as a peer loads them (linear layers at their `quant` size, the rest in
    `dtype`), from a block built on the meta device: the config alone, no weights."""
    with torch.device("meta"):
        block = architecture_of(cfg.model_type).block(cfg)
    return planned_bytes(block, quant, DTYPE_BYTES[dtype])


def block_bytes(cfg: BlockConfig, dtype: str, cache_tokens: int, training: bool = False, quant: Quant = "none") -> int:
    """Memory one block costs a peer.

    Serving: its weights (`quant`, else `dtype`) plus `cache_tokens` tokens of KV cache in `dtype` (the pool a
    peer reserves per block).
    Training: weights, fp32 gradients, Adam's two fp32 moments, and an fp32 master copy when `dtype` is 16-bit;
    no KV cache. Activations are left to the memory share held back from what the device reports.
    """
    if training:
        parameters = block_parameters(cfg)
        master = 0 if dtype == "float32" else parameters * FP32_BYTES
        return parameters * (DTYPE_BYTES[dtype] + FP32_BYTES + ADAM_STATE_BYTES) + master
    return block_weight_bytes(cfg, dtype, quant) + cache_tokens * kv_cache_bytes_per_token(cfg, dtype)


def blocks_that_fit(
    memory_bytes: int, cfg: BlockConfig, dtype: str, cache_tokens: int, training: bool = False, quant: Quant = "none"
) -> int:
    """How many blocks `memory_bytes` holds, at most the whole model; 0 if not even one."""
    return min(memory_bytes // block_bytes(cfg, dtype, cache_tokens, training, quant), cfg.num_layers)


def blocks_for_peer(config: PeerConfig, cfg: BlockConfig) -> int:
    """A peer's span length when placement chooses its blocks: --num-blocks, or as many blocks as its memory budget
    holds with its KV-cache pool.

    Raises:
        InvalidRequest: not even one block fits the budget.
    """
    if config.num_blocks is not None:
        return min(config.num_blocks, cfg.num_layers)
    memory_gib = config.placement.memory_gib
    budget = int(memory_gib * GIB) if memory_gib is not None else available_memory_bytes(config.device)
    cache_tokens = config.server.cache_tokens
    if config.server.cache_gib is not None:  # a pool of a fixed size, whatever the span: the rest is for weights
        budget, cache_tokens = budget - int(config.server.cache_gib * GIB), 0
    elif cache_tokens is None:
        cache_tokens = DEFAULT_CACHE_TOKENS
    length = blocks_that_fit(budget, cfg, config.planned_dtype, cache_tokens, quant=config.quant)
    if length < 1:
        one = block_bytes(cfg, config.planned_dtype, cache_tokens, quant=config.quant) / GIB
        raise InvalidRequest(
            f"not even one block fits in {budget / GIB:.2f} GiB (one block with {cache_tokens} cache tokens "
            f"needs {one:.3f} GiB): give more --memory-gib, fewer --cache-tokens, or --num-blocks"
        )
    return length


def available_memory_bytes(device: str) -> int:
    """Memory a peer may use on `device`: a share of what CUDA reports free, or of the host's MemAvailable."""
    if device == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info()
        return int(free * DETECTED_MEMORY_SHARE)
    return int(_host_memory_available() * DETECTED_MEMORY_SHARE)


def _host_memory_available(meminfo: Path = Path("/proc/meminfo")) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # the kernel reports kB
    raise OSError(f"{meminfo} has no MemAvailable line")


def kv_pool_pages(
    span: BlockSpan, page_size: int, cache_tokens: int | None, cache_gib: float | None, max_batch_tokens: int
) -> int:
    """Pages of the span's KV pool: `cache_gib` GiB or `cache_tokens` tokens when given; else the memory the
    span's device has free now (its weights loaded), less one iteration's activations and a workspace.

    Raises:
        InvalidRequest: not even one page fits.
    """
    per_page = PoolShape.for_span(span, 1, page_size).bytes_per_page(span.dtype)
    if cache_gib is not None:
        pages, source = int(cache_gib * GIB) // per_page, f"{cache_gib} GiB"
    elif cache_tokens is not None:
        pages, source = math.ceil(cache_tokens / page_size), f"{cache_tokens} tokens"
    else:
        free = available_memory_bytes(span.device.type) * (HOST_POOL_SHARE if span.device.type == "cpu" else 1.0)
        free = int(free) - activation_bytes(span.cfg, max_batch_tokens, span.dtype.itemsize)
        pages, source = free // per_page, f"{free / GIB:.2f} GiB free after weights and activations"
    if pages < 1:
        raise InvalidRequest(f"no KV page fits in {source} (a page of {page_size} tokens is {per_page} bytes)")
    return pages


def activation_bytes(cfg: BlockConfig, tokens: int, element: int) -> int:
    """A generous bound on one forward's live activations for `tokens` tokens (hidden states, q/k/v, the MLP's
    three intermediate products, once per expert a token is routed to in a sparse MoE block), plus WORKSPACE_BYTES."""
    mlp = 4 * cfg.intermediate_size * max(cfg.experts_per_token, 1)
    return tokens * element * (8 * cfg.hidden_size + mlp) + WORKSPACE_BYTES


def memory_plan(config: PeerConfig, cfg: BlockConfig) -> str:
    """What `swarm peer join --dry-run` prints: one block's weights and KV cache, the budget, and how many blocks
    fit and why, from the config alone (no weights are read)."""
    quant, dtype = config.quant, config.planned_dtype
    weights = block_weight_bytes(cfg, dtype, quant)
    full = block_weight_bytes(cfg, dtype)
    cache_tokens = config.server.cache_tokens if config.server.cache_tokens is not None else DEFAULT_CACHE_TOKENS
    cache = cache_tokens * kv_cache_bytes_per_token(cfg, dtype)
    lines = [
        f"model: {cfg.model_type}, {cfg.num_layers} blocks, hidden {cfg.hidden_size}; {config.device}, {dtype}",
        f"one block: weights {weights / GIB:.3f} GiB as {quant} ({weights / full:.0%} of {full / GIB:.3f} GiB in "
        f"{dtype}) + KV cache for {cache_tokens} tokens {cache / GIB:.3f} GiB = {(weights + cache) / GIB:.3f} GiB",
    ]
    if config.blocks is not None:
        count = config.blocks[1] - config.blocks[0]
        return "\n".join([*lines, f"--blocks {config.blocks[0]}:{config.blocks[1]}: {count} blocks, "
                          f"{count * (weights + cache) / GIB:.2f} GiB"])  # fmt: skip
    memory_gib = config.placement.memory_gib
    budget = int(memory_gib * GIB) if memory_gib is not None else available_memory_bytes(config.device)
    source = "--memory-gib" if memory_gib is not None else f"{DETECTED_MEMORY_SHARE:.0%} of the free memory"
    lines.append(f"budget: {budget / GIB:.2f} GiB ({source})")
    try:
        count = blocks_for_peer(config, cfg)
    except InvalidRequest as error:
        return "\n".join([*lines, f"fits: 0 blocks: {error}"])
    reason = "the whole model" if count == cfg.num_layers else "what the budget holds"
    reason = "--num-blocks" if config.num_blocks is not None else reason
    used = count * (weights + cache)
    return "\n".join([*lines, f"fits: {count} blocks ({reason}), {used / GIB:.2f} GiB"])
