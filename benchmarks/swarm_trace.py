"""What happens to a simulated swarm, decided before it runs: which peers join when, on what kind of GPU, and when
each is preempted. Runs with and without rebalancing replay the same trace (benchmarks/swarm_sim.py), and the
optimum is computed from it alone (benchmarks/swarm_optimum.py).

Preemptions: exponential lifetimes. Joins: the first `peers` over `ramp_s`, then Poisson arrivals at the rate that
replaces preemptions.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from peers.config import PlacementConfig
from peers.memory import DETECTED_MEMORY_SHARE, GIB, blocks_that_fit
from swarm.partition import BlockConfig

PEER_DEFAULTS = PlacementConfig()  # the simulated peers rebalance as `swarm peer join` does by default

# Llama-2-70B's blocks: 80 of them, 0.86 B parameters each (1.7 GB in bf16), grouped-query attention (8 KV heads).
LLAMA_70B = BlockConfig(
    hidden_size=8192,
    intermediate_size=28672,
    num_heads=64,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    qkv_bias=False,
    mlp_bias=False,
    num_layers=80,
)


@dataclass(frozen=True, slots=True)
class GpuKind:
    name: str
    memory_gib: float
    block_tokens_per_s: float  # tokens/s through ONE block; a peer with L blocks pushes this / L through its span
    share: float  # of the peers that join


# Speeds in proportion to memory bandwidth (T4 320 GB/s, A100 1.6-2.0 TB/s, H100 3.4 TB/s): a serving swarm's
# forward passes are bandwidth-bound. Absolute numbers only scale every throughput alike. A100-80GB and H100-80GB
# hold the same number of blocks at different speeds, so a joining peer cannot tell from its memory how fast it is.
GPU_MIX = (
    GpuKind("T4", 16.0, 400.0, 0.4),
    GpuKind("A100-40GB", 40.0, 2000.0, 0.2),
    GpuKind("A100-80GB", 80.0, 2500.0, 0.2),
    GpuKind("H100-80GB", 80.0, 4200.0, 0.2),
)


@dataclass(frozen=True, slots=True)
class SimConfig:
    peers: int = 1000  # live peers on average: the first ones join over `ramp_s`, then arrivals replace preemptions
    hours: float = 24.0  # measured, after the warm-up
    warmup_hours: float = 1.0
    mean_lifetime_h: float = 2.0  # exponential: spot instances preempted at random
    ramp_s: float = 600.0
    rebalance: bool = True
    rebalance_period_s: float = PEER_DEFAULTS.rebalance_period_s  # each wait drawn from [0.5, 1.5] x this
    rebalance_margin: float = PEER_DEFAULTS.rebalance_margin
    drain_s: float = 30.0  # a moving peer's sessions finish (or are handed over) before it reloads
    load_base_s: float = 20.0  # process start, CUDA context, before weights
    load_s_per_block: float = 2.0  # reading 1.7 GB of weights per block
    throughput_error: float = 0.1  # announced throughput = true x U(1 - e, 1 + e), drawn at each (re)load
    route_every_s: float = 1800.0  # how often a client routes an inference session through the swarm
    dtype: str = "bfloat16"
    cache_tokens: int = 16384  # KV-cache pool per peer, in tokens
    model: BlockConfig = LLAMA_70B
    gpus: tuple[GpuKind, ...] = GPU_MIX
    cold_start: bool = False  # the first `peers` all read the registry before any of them is in it (started at once)
    seed: int = 0


def span_length(gpu: GpuKind, config: SimConfig) -> int:
    """Blocks a peer of this kind takes: as PeerDaemon, with the memory share it would detect as free."""
    memory = int(gpu.memory_gib * GIB * DETECTED_MEMORY_SHARE)
    return blocks_that_fit(memory, config.model, config.dtype, config.cache_tokens)


def load_s(length: int, config: SimConfig) -> float:
    return config.load_base_s + config.load_s_per_block * length


@dataclass(frozen=True, slots=True)
class Arrival:
    time_s: float
    gpu: GpuKind
    lifetime_s: float


def make_trace(config: SimConfig) -> list[Arrival]:
    """Joins and lifetimes from `config.seed` alone, so that runs with and without rebalancing see the same peers."""
    rng = random.Random(config.seed)
    end = (config.warmup_hours + config.hours) * 3600
    mean_life = config.mean_lifetime_h * 3600
    weights = [gpu.share for gpu in config.gpus]

    def arrival(time_s: float) -> Arrival:
        return Arrival(time_s, rng.choices(config.gpus, weights)[0], rng.expovariate(1 / mean_life))

    trace = [arrival(rng.uniform(0, config.ramp_s)) for _ in range(config.peers)]
    time_s = 0.0
    while (time_s := time_s + rng.expovariate(config.peers / mean_life)) < end:
        trace.append(arrival(time_s))
    return sorted(trace, key=lambda a: a.time_s)
