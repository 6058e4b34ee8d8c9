"""How many blocks fit a peer's memory: weights plus the KV-cache pool when serving, weights plus gradients and
optimizer state when training. Called by the peer daemon when it is not told its span, and by the simulator.
"""

from __future__ import annotations

from pathlib import Path

from peers.config import PeerConfig
from swarm.errors import InvalidRequest
from swarm.partition.llama import BlockConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GIB = 1 << 30
DETECTED_MEMORY_SHARE = 0.9  # of what the device reports free: allocator slack, activations, the CUDA context
FP32_BYTES = 4
ADAM_STATE_BYTES = 8  # two fp32 moments per parameter


def block_parameters(cfg: BlockConfig) -> int:
    """Parameters of one Llama-family block: attention, MLP and the two norms (biases where the config has them)."""
    hidden, heads, kv_heads, head_dim = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q and o, k and v
    if cfg.qkv_bias:
        attention += (heads + 2 * kv_heads) * head_dim
    mlp = 3 * hidden * cfg.intermediate_size + (2 * cfg.intermediate_size + hidden if cfg.mlp_bias else 0)
    return attention + mlp + 2 * hidden


def kv_cache_bytes_per_token(cfg: BlockConfig, dtype: str) -> int:
    """Bytes one token occupies in one block's KV cache (a key and a value per KV head)."""
    return 2 * cfg.num_kv_heads * cfg.head_dim * DTYPE_BYTES[dtype]


def block_bytes(cfg: BlockConfig, dtype: str, cache_tokens: int, training: bool = False) -> int:
    """Memory one block costs a peer.

    Serving: its weights in `dtype` plus `cache_tokens` tokens of KV cache (the pool a peer reserves per block).
    Training: weights, fp32 gradients, Adam's two fp32 moments, and an fp32 master copy when `dtype` is 16-bit;
    no KV cache. Activations are left to the memory share held back from what the device reports.
    """
    parameters = block_parameters(cfg)
    weights = parameters * DTYPE_BYTES[dtype]
    if training:
        master = 0 if dtype == "float32" else parameters * FP32_BYTES
        return weights + master + parameters * (FP32_BYTES + ADAM_STATE_BYTES)
    return weights + cache_tokens * kv_cache_bytes_per_token(cfg, dtype)


def blocks_that_fit(memory_bytes: int, cfg: BlockConfig, dtype: str, cache_tokens: int, training: bool = False) -> int:
    """How many blocks `memory_bytes` holds, at most the whole model; 0 if not even one."""
    return min(memory_bytes // block_bytes(cfg, dtype, cache_tokens, training), cfg.num_layers)


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
    length = blocks_that_fit(budget, cfg, config.dtype, cache_tokens)
    if length < 1:
        one = block_bytes(cfg, config.dtype, cache_tokens) / GIB
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
