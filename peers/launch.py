"""Start or attach to Ray and run stage actors on it. Used by `swarm peer join` and `swarm up`."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from typing import Any

from peers.actor import StagePeer
from peers.config import PeerConfig
from swarm.errors import PeerUnavailable
from swarm.types import Span

logger = logging.getLogger(__name__)

KV_NAMESPACE = "rayswarm"
INITIAL_PEERS_KEY = b"initial_peers"


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
    if config.ray_resources:
        options["resources"] = dict(config.ray_resources)
    return ray.remote(StagePeer).options(**options).remote(config, peer_id, span)


def publish_initial_peers(addresses: Sequence[str]) -> None:
    """Store the DHT bootstrap's multiaddresses in the Ray cluster's key-value store, where `swarm peer join
    --ray-address` without --initial-peers finds them (cluster/ starts peers this way on every worker)."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(INITIAL_PEERS_KEY, json.dumps(list(addresses)).encode(), namespace=KV_NAMESPACE)


def published_initial_peers(timeout_s: float) -> tuple[str, ...]:
    """The multiaddresses publish_initial_peers stored, waiting up to `timeout_s` for them (workers may start before
    the head's bootstrap node).

    Raises:
        PeerUnavailable: nothing was published within `timeout_s`.
    """
    from ray.experimental import internal_kv

    deadline = time.monotonic() + timeout_s
    while True:
        value = internal_kv._internal_kv_get(INITIAL_PEERS_KEY, namespace=KV_NAMESPACE)
        if value:
            return tuple(json.loads(value))
        if time.monotonic() >= deadline:
            raise PeerUnavailable(
                f"no DHT address was published in this Ray cluster within {timeout_s} s: start "
                "`swarm up --peers 0 --ray-address ADDR` on the head node, or pass --initial-peers"
            )
        time.sleep(1.0)
