"""The peer daemon: hosts a span of blocks in a Ray actor, serves it over gRPC, announces it in the DHT.

config.py: PeerConfig; daemon.py: PeerDaemon (DHT membership, drain); actor.py: StagePeer (the Ray actor);
server.py: PeerServer (gRPC server + health); service.py: the Peer servicer; handlers.py: its registration, with
lenient request parsing; limits.py: per-client admission (sessions, request rate, tokens, bytes); scheduler.py:
what runs next; backend.py: the blocks on tensors; kv_cache.py: the session cache pool; metrics.py: Prometheus;
placement.py: which blocks to take and whether to move; memory.py: how many blocks fit; rebalance.py: the periodic
move check; launch.py: Ray; local_swarm.py: the embedded default (`swarm up`); training/: SWARM training stages.

The names below are imported on first use: a training stage (peers.training) starts without the inference server's
modules, and a restarted stage replica is serving seconds sooner.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "PeerConfig": "peers.config",
    "PeerDaemon": "peers.daemon",
    "LocalSwarm": "peers.local_swarm",
    "PeerServer": "peers.server",
    "ServerConfig": "peers.config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'peers' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
