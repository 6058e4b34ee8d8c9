"""RaySwarm: train and serve transformer language models on a swarm of heterogeneous, preemptible GPUs.

Public API only. Subpackages: client (DistributedModelForCausalLM, sessions), codec (wire codecs), partition (block
spans from checkpoints), registry (the DHT), router (route policies), cli.
"""

from __future__ import annotations

from swarm.client import DistributedModelForCausalLM
from swarm.codec import CodecId, decode, encode
from swarm.config import ClientConfig
from swarm.errors import (
    CheckpointError,
    DeadlineExceeded,
    InvalidRequest,
    MalformedTensorError,
    MissingBlocks,
    Overloaded,
    PeerUnavailable,
    SessionLost,
    SwarmError,
    UnknownCodecError,
    UnsupportedArchitectureError,
    WrongSpan,
)
from swarm.types import Hop, PeerInfo, PeerState, Route, Span

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ClientConfig",
    "CodecId",
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
    "SwarmError",
    "UnknownCodecError",
    "UnsupportedArchitectureError",
    "WrongSpan",
    "__version__",
    "decode",
    "encode",
]
