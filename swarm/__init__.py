"""RaySwarm: train and serve transformer language models on a swarm of heterogeneous, preemptible GPUs.

Public API only. Subpackages: client (DistributedModelForCausalLM, sessions), codec (wire codecs), partition (block
spans from checkpoints), registry (the DHT), router (route policies), security (private swarms' credentials), cli.
"""

from __future__ import annotations

import swarm._exit  # noqa: F401  (a prompt exit: see the module)
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
