"""The peer daemon: hosts a span of blocks in a Ray actor, serves it over gRPC, announces it in the DHT.

config.py: PeerConfig; daemon.py: PeerDaemon (DHT membership, drain); actor.py: StagePeer (the Ray actor);
server.py: PeerServer (gRPC server + health); service.py: the Peer servicer; handlers.py: its registration, with
lenient request parsing; limits.py: per-client admission (sessions, request rate, tokens, bytes); scheduler.py:
what runs next; backend.py: the blocks on tensors; kv_cache.py: the session cache pool; metrics.py: Prometheus;
placement.py: which blocks to take and whether to move; memory.py: how many blocks fit; rebalance.py: the periodic
move check; launch.py: Ray; local_swarm.py: the embedded default (`swarm up`).
"""

from __future__ import annotations

from peers.config import PeerConfig
from peers.daemon import PeerDaemon
from peers.local_swarm import LocalSwarm
from peers.server import PeerServer, ServerConfig

__all__ = ["LocalSwarm", "PeerConfig", "PeerDaemon", "PeerServer", "ServerConfig"]
