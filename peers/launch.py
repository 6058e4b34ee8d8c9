"""Start or attach to Ray and run stage actors on it. Used by `swarm peer join` and `swarm up`."""

from __future__ import annotations

import logging
import os
from typing import Any

from peers.actor import StagePeer
from peers.config import PeerConfig
from swarm.types import Span

logger = logging.getLogger(__name__)


def connect_ray(address: str | None) -> None:
    """Attach to the Ray cluster at `address`, or start a local one that listens on 127.0.0.1 only."""
    if address is None:
        # Read by Ray at import: without it a local Ray binds the machine's external address (DESIGN.md).
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        # A plain local Ray would otherwise write ~/.ray/auth_token and break later Ray Client use.
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    if ray.is_initialized():
        return
    common = {"logging_level": logging.WARNING, "log_to_driver": False}
    if address is None:
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, **common)
    else:
        ray.init(address=address, **common)


def spawn_peer(config: PeerConfig, peer_id: str, span: Span) -> Any:
    """Create a stage actor; Ray restarts it (re-running __init__) up to config.max_restarts times.

    It asks Ray for a GPU when the peer computes on CUDA and for no CPU otherwise: a peer is a long-lived
    server whose compute threads are set by PeerConfig.threads, not a task to pack onto cores.
    """
    import ray

    options = {
        "num_cpus": 0,
        "num_gpus": 1 if config.device == "cuda" else 0,
        "max_restarts": config.max_restarts,
        "max_concurrency": 4,  # info and drain must run while a slow call is in progress
    }
    return ray.remote(StagePeer).options(**options).remote(config, peer_id, span)


def wait_ready(actor: Any, timeout_s: float) -> dict:
    """Block until the actor has loaded its blocks and serves; returns its info()."""
    import ray

    return ray.get(actor.info.remote(), timeout=timeout_s)
