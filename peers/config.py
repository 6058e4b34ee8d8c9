"""PeerConfig: everything a peer daemon is told, typed and in one place (built from CLI flags), with its parts:
ServerConfig (the gRPC server and its engine), LimitsConfig (what one client may take) and PlacementConfig.

Plain records that import nothing of the peer's own machinery (server, engine, memory), so that those can name
them and the CLI can read their defaults."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarm.partition.quantize import QUANT_MODES
from swarm.registry.hosts import LOOPBACK, HostConfig
from swarm.security import SwarmCredentials

DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: bfloat16 on CUDA (float16 without bf16), float32 on CPU


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    """What one client may take of a peer. Defaults leave room for a busy honest client (a generation step is one
    request; a replay of 1,024 tokens is one more) and stop one that would starve the others."""

    # inference sessions one client may hold open on this peer at once, or more: a fair share of max_sessions
    sessions_per_client: int = 16
    requests_per_s: float = 500.0  # sustained per client: RPCs plus inference steps (token-bucket refill rate)
    request_burst: int = 1000  # per client: requests allowed at once above the sustained rate (bucket size)
    session_tokens: int = 1 << 20  # batch x new tokens one session may run, replays and rollbacks included
    stream_bytes: int = 0  # bytes of one chunked tensor, MESSAGE_OVERHEAD_BYTES (limits.py) per chunk in; 0: derived
    # LoRA tensors uploaded to the peer (LoadAdapter: fine-tuning copies and published served adapters; not the
    # operator's --adapters), per client and in all. peers/adapter_budget.py charges them.
    adapter_bytes_per_client: int = 256 << 20
    adapter_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        positive = ("sessions_per_client", "requests_per_s", "request_burst", "session_tokens")
        for name in (*positive, "adapter_bytes_per_client", "adapter_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.stream_bytes < 0:
            raise ValueError(f"stream_bytes must be >= 0 (0: derived), got {self.stream_bytes}")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = LOOPBACK  # address the gRPC server binds (0.0.0.0: every interface)
    announce_host: str = ""  # address others dial; "": host, or for 0.0.0.0 the routed one (swarm/registry/hosts.py)
    port: int = 0  # 0: any free port
    max_message_bytes: int = 4 << 20  # gRPC's own default; bigger tensors are chunked on the stream RPCs
    max_request_tokens: int = 8192  # batch x seq of one request
    max_batch_tokens: int = 2048  # tokens one engine iteration (or one merged forward) computes at most
    # The KV-cache pool, allocated at start as pages of page_size tokens: cache_gib GiB, or cache_tokens tokens, or
    # (both None) what the device has free once the weights are loaded (peers/memory.py's kv_pool_pages)
    cache_tokens: int | None = None
    cache_gib: float | None = None
    page_size: int = 16  # tokens per KV page
    # Keep the KV pages of finished prompts for the same client's next sessions (peers/prefix_cache.py); only where
    # page_size is a multiple of its KEY_TOKENS (16)
    prefix_cache: bool = True
    max_session_length: int = 8192
    session_idle_s: float = 300.0  # a session with no step for this long is closed and its pages returned
    max_sessions: int = 1024  # open inference sessions; each is a coroutine on the serving loop, not a thread
    rpc_threads: int = 32  # threads for the plain RPCs (Forward, Backward, Info, Health) running at once
    limits: LimitsConfig = field(default_factory=LimitsConfig)  # per-client admission (peers/limits.py)
    output_noise_std: float = 0.0  # FAULT INJECTION for tests only: see ServiceConfig.output_noise_std
    open_timeout_s: float = 10.0  # an Inference stream that sends no `open` within this is ended
    adapters: str = ""  # a directory of peft LoRA adapters to serve by name, one per subdirectory; "" for none
    # SwarmCredentials.load(DIR) for a private swarm, SwarmCredentials.open() for an open one; None refuses to serve
    credentials: SwarmCredentials | None = None

    def __post_init__(self) -> None:
        HostConfig(self.host, self.announce_host)  # raises InvalidArgument naming the flag
        positive = ("max_request_tokens", "max_batch_tokens", "cache_tokens", "page_size", "max_session_length")
        for name in (*positive, "max_sessions", "rpc_threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.cache_gib is not None and self.cache_gib <= 0:
            raise ValueError(f"cache_gib must be positive, got {self.cache_gib}")
        if self.session_idle_s <= 0:
            raise ValueError(f"session_idle_s must be positive, got {self.session_idle_s}")


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    """How a peer picks its blocks and when it moves (peers/placement.py decides, peers/rebalance.py acts)."""

    memory_gib: float | None = None  # budget for weights + KV cache when not told the span; None: the device's free
    rebalance: bool | None = None  # move to where the swarm needs blocks; None: only if placement chose the span
    rebalance_period_s: float = 120.0  # mean time between checks; each wait is drawn from [0.5, 1.5] x this
    rebalance_margin: float = 0.3  # hysteresis: see peers/placement.py plan_move

    def __post_init__(self) -> None:
        if self.memory_gib is not None and self.memory_gib <= 0:
            raise ValueError(f"memory_gib must be positive, got {self.memory_gib}")
        if self.rebalance_period_s <= 0:
            raise ValueError(f"rebalance_period_s must be positive, got {self.rebalance_period_s}")
        if self.rebalance_margin < 0:
            raise ValueError(f"rebalance_margin must be >= 0, got {self.rebalance_margin}")


LIMIT_FLAGS = (  # LimitsConfig's fields, each with a flag of its name (swarm/cli/_peer_flags.py)
    "sessions_per_client",
    "requests_per_s",
    "request_burst",
    "session_tokens",
    "stream_bytes",
    "adapter_bytes_per_client",
    "adapter_bytes",
)


@dataclass(frozen=True, slots=True)
class PeerConfig:
    model_path: str
    initial_peers: tuple[str, ...] = ()
    model_name: str = ""  # registry key; "" means the checkpoint directory's name
    blocks: tuple[int, int] | None = None  # explicit span [start, end); None lets placement choose
    num_blocks: int | None = None  # how many blocks placement should take; None: as many as fit the memory
    device: str = "cpu"
    dtype: str = "auto"  # the blocks' dtype; peers/actor.py resolves auto where the device is (planned_dtype here)
    quant: str = "none"
    host: str = "127.0.0.1"  # address the gRPC server and the DHT node bind (0.0.0.0: every interface)
    announce_host: str = ""  # address they announce; "": host, or for 0.0.0.0 the routed one (registry/hosts.py)
    dht_port: int = 0  # the DHT node's port; 0: any free port
    metrics_port: int = 0  # Prometheus /metrics port; 0: any free port
    ttl_s: float = 30.0  # a record not refreshed within this disappears from the registry
    announce_period_s: float = 10.0
    drain_grace_s: float = 30.0  # in-flight work gets this long after SIGTERM
    threads: int = 0  # torch threads for compute; 0: one per core
    max_restarts: int = 10  # times Ray restarts a crashed stage actor (-1: forever)
    ray_resources: tuple[tuple[str, float], ...] = ()  # custom Ray resources the stage actor needs (pins it to nodes)
    in_process: bool = False  # the stage in the daemon's own process, no Ray (`--no-ray`; peers/stage_handle.py)
    # NAT (swarm/registry/tunnel.py): "offer": keep relay slots for peers behind NAT (`--relay`); "use": when
    # nobody can dial this peer, serve through a relay on an initial peer (`--via-relay`); "": neither.
    relay: str = ""
    relay_max_circuits: int | None = None  # with "offer": circuits relayed at once for one peer (None: Registry's)
    server: ServerConfig = field(default_factory=ServerConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)

    @property
    def name(self) -> str:
        return self.model_name or Path(self.model_path).name

    @property
    def planned_dtype(self) -> str:
        """The dtype memory is planned in: auto is 16-bit on CUDA (bfloat16 and float16 take the same bytes)."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device == "cuda" else "float32"

    @property
    def rebalances(self) -> bool:
        """Told to, or by default when placement chose the span (a peer given --blocks stays where it was put)."""
        rebalance = self.placement.rebalance
        return rebalance if rebalance is not None else self.blocks is None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quant not in QUANT_MODES:
            raise ValueError(f"quant must be one of {QUANT_MODES}, got {self.quant!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.blocks is not None and self.num_blocks is not None:
            raise ValueError("give --blocks or --num-blocks, not both")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.in_process and self.ray_resources:
            raise ValueError("ray_resources pin a Ray actor: an in-process stage has none")

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> PeerConfig:
        """Raises CredentialsError unless --credentials DIR or --open was given."""
        limits = LimitsConfig(**given(ns, *LIMIT_FLAGS))
        server = ServerConfig(
            host=ns.host,
            announce_host=ns.announce_host,
            port=ns.port,
            cache_tokens=ns.cache_tokens,
            cache_gib=ns.cache_gib,
            **given(
                ns,
                "page_size",
                "prefix_cache",
                "max_batch_tokens",
                "session_idle_s",
                "max_sessions",
                "max_message_bytes",
            ),
            limits=limits,
            credentials=SwarmCredentials.choose(ns.credentials, ns.open),
            adapters=str(getattr(ns, "adapters", None) or ""),
        )
        placement = PlacementConfig(
            memory_gib=ns.memory_gib,
            rebalance=ns.rebalance,
            **given(ns, rebalance_period_s="rebalance_period", rebalance_margin="rebalance_margin"),
        )
        return cls(
            model_path=str(ns.model),
            initial_peers=tuple(ns.initial_peers or ()),
            model_name=ns.model_name or "",
            blocks=tuple(ns.blocks) if ns.blocks else None,
            num_blocks=ns.num_blocks,
            device=ns.device,
            dtype=ns.dtype,
            quant=ns.quant,
            host=ns.host,
            announce_host=ns.announce_host,
            dht_port=ns.dht_port,
            metrics_port=ns.metrics_port,
            ttl_s=ns.ttl,
            announce_period_s=ns.announce_period or ns.ttl / 3,
            drain_grace_s=ns.drain_grace,
            threads=getattr(ns, "threads", 0),
            ray_resources=parse_resources(getattr(ns, "ray_resources", None)),
            in_process=getattr(ns, "no_ray", False),
            relay="use" if getattr(ns, "via_relay", False) else "offer" if getattr(ns, "relay", False) else "",
            **given(ns, relay_max_circuits="relay_max_circuits"),
            server=server,
            placement=placement,
        )


def given(ns: argparse.Namespace, *names: str, **renamed: str) -> dict[str, Any]:
    """The config fields whose flags were given (`name`, or `field="flag"` where the names differ). A flag left
    out is None (swarm/cli/_peer_flags.py) and its field keeps the dataclass's default: defaults are written once."""
    flags = {name: name for name in names} | renamed
    return {field: getattr(ns, flag) for field, flag in flags.items() if getattr(ns, flag, None) is not None}


def parse_resources(text: str | None) -> tuple[tuple[str, float], ...]:
    """'{"node1": 1}' -> (("node1", 1.0),): the JSON object `ray start --resources` takes, as sorted pairs."""
    if not text:
        return ()
    try:
        resources = json.loads(text)
        if not isinstance(resources, dict):
            raise ValueError("not an object")
        return tuple(sorted((str(name), float(amount)) for name, amount in resources.items()))
    except (ValueError, TypeError) as error:
        raise ValueError(f'--ray-resources must be a JSON object like {{"node1": 1}}, got {text!r}: {error}') from None
