"""A peer as the swarm sees it: chooses its span, announces JOINING, starts the stage actor, keeps the record
fresh with what the actor measures, and on drain announces OFFLINE before the actor finishes its work.

Runs in the process that owns the actor (`swarm peer join`, `swarm up`), next to its DHT node.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from peers.config import PeerConfig
from peers.placement import choose_span
from swarm.partition import open_checkpoint
from swarm.registry import Announcer, Registry
from swarm.types import PeerInfo, PeerState, Span

logger = logging.getLogger(__name__)

ACTOR_INFO_TIMEOUT_S = 5.0


class PeerDaemon:
    def __init__(
        self, config: PeerConfig, registry: Registry, on_restart: Callable[[dict], None] | None = None
    ) -> None:
        self.config, self.registry, self.on_restart = config, registry, on_restart
        self.peer_id = uuid.uuid4().hex[:16]  # kept across actor restarts, so the record is updated in place
        self.total_blocks = open_checkpoint(config.model_path)[2].num_layers
        self.span = self._choose_span()
        self.state = PeerState.JOINING
        self.actor: Any = None
        self.last_info: dict | None = None
        self.announcer = Announcer(registry, self.describe, config.announce_period_s, config.ttl_s)

    def launch(self) -> None:
        """Announce JOINING and start the actor (it loads its blocks in the background)."""
        from peers.launch import spawn_peer

        self.announcer.announce_now()
        self.actor = spawn_peer(self.config, self.peer_id, self.span)

    def wait_serving(self, timeout_s: float = 600) -> dict:
        """Wait until the actor serves, then announce ONLINE and keep the record fresh; returns its info."""
        from peers.launch import wait_ready

        self.last_info = wait_ready(self.actor, timeout_s)
        self.state = PeerState.ONLINE
        self.announcer.start()
        return self.last_info

    def describe(self) -> PeerInfo:
        """The record to announce. While the actor cannot answer (Ray is restarting it) the peer shows as JOINING:
        announced, not serving."""
        if self.actor is None or self.state is not PeerState.ONLINE:
            return self._record(self.state)
        try:
            live = _actor_info(self.actor)
        except Exception as error:  # unavailable, restarting, or dead for good
            logger.warning("peer=%s actor not answering: %s", self.peer_id, error)
            return self._record(PeerState.JOINING)
        if self.last_info is not None and live["pid"] != self.last_info["pid"]:
            logger.warning("peer=%s stage actor restarted by Ray: pid %s", self.peer_id, live["pid"])
            if self.on_restart is not None:
                self.on_restart(live)
        self.last_info = live
        return dataclasses.replace(
            self._record(PeerState.ONLINE),
            address=live["address"],
            forward_tokens_per_s=live["forward_tokens_per_s"],
            inference_steps_per_s=live["inference_steps_per_s"],
            queue_length=live["queue_length"],
            cache_tokens_free=live["cache_tokens_free"],
            metrics_address=live["metrics_address"],
        )

    def _record(self, state: PeerState) -> PeerInfo:
        return PeerInfo(self.peer_id, "", self.span, state, model=self.config.name, total_blocks=self.total_blocks)

    def alive(self) -> bool:
        """False once Ray has given up on the actor (it restarts it on its own before that)."""
        import ray

        try:
            _actor_info(self.actor)
        except ray.exceptions.RayActorError as error:
            return not isinstance(error, ray.exceptions.ActorDiedError)
        except Exception:  # busy or restarting
            return True
        return True

    def drain_started(self) -> Any:
        """Announce OFFLINE at once (routers stop sending), then ask the actor to drain; returns its ObjectRef."""
        self.state = PeerState.OFFLINE
        self.announcer.stop(PeerState.OFFLINE)
        return self.actor.drain.remote()

    def _choose_span(self) -> Span:
        if self.config.blocks is not None:
            return Span(*self.config.blocks)
        length = self.config.num_blocks or self.total_blocks
        return choose_span(self.registry.peers(self.config.name), self.total_blocks, length)


def _actor_info(actor: Any) -> dict:
    import ray

    return ray.get(actor.info.remote(), timeout=ACTOR_INFO_TIMEOUT_S)


def drain(daemons: list[PeerDaemon], timeout_s: float) -> bool:
    """Drain every peer concurrently, then kill the actors; True if all finished their in-flight work."""
    import ray

    pending = [(daemon, daemon.drain_started()) for daemon in daemons]
    deadline = time.monotonic() + timeout_s
    finished = True
    for daemon, ref in pending:
        try:
            finished &= bool(ray.get(ref, timeout=max(deadline - time.monotonic(), 0.1)))
        except (ray.exceptions.RayError, TimeoutError) as error:  # dead, restarting or too slow
            logger.warning("peer=%s drain did not complete: %s", daemon.peer_id, error)
            finished = False
    for daemon, _ in pending:
        ray.kill(daemon.actor, no_restart=True)
    return finished
