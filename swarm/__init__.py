"""RaySwarm: train and serve transformer language models on a swarm of heterogeneous, preemptible GPUs.

Public API only. Subpackages: client (DistributedModelForCausalLM, sessions), codec (wire codecs), partition (block
spans from checkpoints), registry (the DHT), router (route policies), security (private swarms' credentials), api
(the OpenAI-compatible API), training (the trainer side of SWARM training), finetune (`swarm finetune`),
monitoring (the live map, Prometheus targets), cli; _proto: generated from proto/, never edited.
Modules: errors.py (SwarmError and the gRPC status table), types.py (frozen records every layer shares), config.py
(ClientConfig), prefix_keys.py (the keys of a prompt's prefixes, for the peers' prefix caches), channels.py (one
gRPC channel per peer address), ray_cluster.py (start or attach to Ray), ray_reaper.py (a local Ray dies with its
starter), progress.py (progress bars), _exit.py (a prompt exit), _grpc_fork.py (gRPC's fork handlers off, so a
forked DHT node cannot abort), _openmp_spin.py (a short OpenMP spin-wait, so processes sharing cores do not spin on
each other's), __main__.py (`python -m swarm`).
"""

from __future__ import annotations

import swarm._exit  # (a prompt exit: see the module)
import swarm._grpc_fork  # (before anything imports gRPC: see the module)
import swarm._openmp_spin  # noqa: F401  (before anything imports torch: see the module)
from swarm.codec import CodecId, decode, encode
from swarm.config import ClientConfig
from swarm.errors import (
    CheckpointError,
    CredentialsError,
    DeadlineExceeded,
    InvalidRequest,
    MalformedTensorError,
    MissingBlocks,
    Overloaded,
    PeerUnavailable,
    SessionLost,
    SwarmError,
    Unauthenticated,
    UnknownCodecError,
    UnsupportedArchitectureError,
    WrongSpan,
)
from swarm.security import SwarmCredentials
from swarm.types import Hop, PeerInfo, PeerState, Route, Span

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """DistributedModelForCausalLM is imported on first use: it pulls in transformers (seconds, and about 100 MB),
    which a peer's processes, importing `swarm.errors` or `swarm.types`, never need."""
    if name == "DistributedModelForCausalLM":
        from swarm.client import DistributedModelForCausalLM

        return DistributedModelForCausalLM
    raise AttributeError(f"module 'swarm' has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "ClientConfig",
    "CodecId",
    "CredentialsError",
    "DeadlineExceeded",
    "DistributedModelForCausalLM",
    "Hop",
    "InvalidRequest",
    "MalformedTensorError",
    "MissingBlocks",
    "Overloaded",
    "PeerInfo",
    "PeerState",
    "PeerUnavailable",
    "Route",
    "SessionLost",
    "Span",
    "SwarmCredentials",
    "SwarmError",
    "Unauthenticated",
    "UnknownCodecError",
    "UnsupportedArchitectureError",
    "WrongSpan",
    "__version__",
    "decode",
    "encode",
]
