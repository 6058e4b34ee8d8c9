"""RaySwarm: train and serve transformer language models on a swarm of heterogeneous, preemptible GPUs.

Public API only. Subpackages: codec (wire codecs), partition (build block spans from checkpoints), cli.
"""

from __future__ import annotations

from swarm.codec import CodecId, decode, encode
from swarm.errors import (
    CheckpointError,
    DeadlineExceeded,
    InvalidRequest,
    MalformedTensorError,
    Overloaded,
    PeerUnavailable,
    SessionLost,
    SwarmError,
    UnknownCodecError,
    UnsupportedArchitectureError,
)

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CodecId",
    "DeadlineExceeded",
    "InvalidRequest",
    "MalformedTensorError",
    "Overloaded",
    "PeerUnavailable",
    "SessionLost",
    "SwarmError",
    "UnknownCodecError",
    "UnsupportedArchitectureError",
    "__version__",
    "decode",
    "encode",
]
