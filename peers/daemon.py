"""A peer as the swarm sees it: chooses its span, announces JOINING, starts the stage (a Ray actor, or with
`--no-ray` a part of this process: peers/stage_handle.py), keeps the record fresh with what the stage measures,
moves to other blocks when its rebalancer says so, and on drain announces OFFLINE before the stage finishes its
work.

Runs in the process that owns the stage (`swarm peer join`, `swarm up`), next to its DHT node.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable

from peers.config import PeerConfig
from peers.memory import blocks_for_peer
from peers.placement import UNMEASURED_TOKENS_PER_S, BlockLoad, choose_joining_span
from peers.push_targets import next_hops
from peers.rebalance import Rebalancer
from peers.stage_handle import INFO_TIMEOUT_S, DrainOutcome, StageHandle, start_stage
from swarm.partition import open_checkpoint
from swarm.registry import Announcer, Registry
from swarm.types import PeerInfo, PeerState, Span

logger = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 600.0


class PeerDaemon:
    def __init__(
        self,
        config: PeerConfig,
        registry: Registry,
        on_restart: Callable[[dict], None] | None = None,
        on_move: Callable[[dict], None] | None = None,
    ) -> None:
        self.config, self.registry, self.on_restart, self.on_move = config, registry, on_restart, on_move
        self.peer_id = uuid.uuid4().hex[:16]  # kept across actor restarts and moves: the record is updated in place
        self.block_config = open_checkpoint(config.model_path)[2]
        self.total_blocks = self.block_config.num_layers
        self.expected_throughput = UNMEASURED_TOKENS_PER_S  # announced while JOINING, so placement counts the claim
        self.span = self._choose_span()
        self.state = PeerState.JOINING
        self.stage: StageHandle | None = None
        self.last_info: dict | None = None
        self.tunnel_address = ""  # announced instead of the stage's own address when nobody can dial it
        self._tunnel_target = ""  # the stage's address the tunnel's streams are spliced to
        self._lock = threading.Lock()  # span, state and stage change together (moves) and are read together
        self._move_lock = threading.Lock()  # held for a whole move; draining waits for it
        self.announcer = Announcer(registry, self.describe, config.announce_period_s, config.ttl_s)
        self.rebalancer = (
            Rebalancer(registry, config.name, self.total_blocks, self.describe, self.move_to, config.placement)
            if config.rebalances
            else None
        )

    def launch(self) -> None:
        """Announce JOINING and start the stage (it loads its blocks in the background)."""
        self.announcer.announce_now()
        self.stage = start_stage(self.config, self.peer_id, self.span)

    def wait_serving(self, timeout_s: float = 600) -> dict:
        """Wait until the stage serves, then announce ONLINE and keep the record fresh; returns its info."""
        assert self.stage is not None, "launch() first"
        self.last_info = self.stage.info(timeout_s)
        self._allow_pushes(self.stage, self.span)  # before ONLINE: no client routes here yet
        self.state = PeerState.ONLINE
        self.announcer.start()
        if self.rebalancer is not None:
            self.rebalancer.start()
        return self.last_info

    def describe(self) -> PeerInfo:
        """The record to announce. While the stage cannot answer (Ray is restarting it) the peer shows as JOINING:
        announced, not serving."""
        with self._lock:
            state, span, stage = self.state, self.span, self.stage
        if stage is None or state is not PeerState.ONLINE:
            return self._record(state, span)
        try:
            live = stage.info(INFO_TIMEOUT_S)
        except Exception as error:  # unavailable, restarting, or dead for good
            logger.warning("peer=%s stage not answering: %s", self.peer_id, error)
            return self._record(PeerState.JOINING, span)
        if self.last_info is not None and live["pid"] != self.last_info["pid"]:
            logger.warning("peer=%s stage actor restarted by Ray: pid %s", self.peer_id, live["pid"])
            if self.on_restart is not None:
                self.on_restart(live)
        self.last_info = live
        if not live.get("serving", True):  # its engine died: no work may be sent here
            return self._record(PeerState.OFFLINE, span)
        self._allow_pushes(stage, span)
        return dataclasses.replace(
            self._record(PeerState.ONLINE, span),
            address=self._reached_at(live["address"]),
            forward_tokens_per_s=live["forward_tokens_per_s"],
            inference_steps_per_s=live["inference_steps_per_s"],
            queue_length=live["queue_length"],
            cache_tokens_free=live["cache_tokens_free"],
            batch_size=live["batch_size"],
            iteration_ms=live["iteration_ms"],
            metrics_address=live["metrics_address"],
            adapters=tuple(live.get("adapters", ())),
        )

    def serve_through(self, tunnel_address: str) -> None:
        """Announce `tunnel_address` (a relay slot of this peer's DHT node, swarm/registry/tunnel.py) from now on,
        its streams spliced to the stage's gRPC server."""
        self.tunnel_address = tunnel_address
        if self.last_info is not None:
            self._reached_at(self.last_info["address"])
        self.announcer.announce_now()

    def _reached_at(self, stage_address: str) -> str:
        """The address to announce for a stage serving at `stage_address` (again where it restarted elsewhere);
        through a relay, the slot the DHT node holds now: when its relay is gone it moves to another one it holds
        (an initial peer started with --relay; a private swarm's member relay), and clients fail over to that within
        an announce period."""
        if not self.tunnel_address:
            return stage_address
        if stage_address != self._tunnel_target:
            self.registry.serve_tunnels(stage_address)
            self._tunnel_target = stage_address
        try:
            held = self.registry.held_tunnel_addresses()
        except Exception as error:  # the DHT process is busy or stopping: keep the last one
            logger.warning("peer=%s relay slots not read: %s", self.peer_id, error)
            held = [self.tunnel_address]
        if held and self.tunnel_address not in held:
            logger.warning("peer=%s relay slot %s gone: now %s", self.peer_id, self.tunnel_address, held[0])
            self.tunnel_address = held[0]
        return self.tunnel_address

    def _allow_pushes(self, stage: StageHandle, span: Span) -> None:
        """Hand the stage the next peers it may push to, read from the registry on the announce period: off the
        token path, and a new next peer is allowed within one period (until then the client sends it the step)."""
        try:
            stage.allow_push_to(next_hops(self.registry.peers(self.config.name), span))
        except Exception as error:  # a DHT hiccup or a restarting stage: the next period tries again
            logger.warning("peer=%s push targets not refreshed: %s", self.peer_id, error)

    def _record(self, state: PeerState, span: Span) -> PeerInfo:
        return PeerInfo(
            self.peer_id,
            "",
            span,
            state,
            forward_tokens_per_s=self.expected_throughput,
            model=self.config.name,
            total_blocks=self.total_blocks,
        )

    def alive(self) -> bool:
        """False once the stage is gone for good (Ray restarts a crashed actor on its own before that)."""
        with self._lock:
            stage = self.stage
        if stage is None or not stage.dead_for_good():
            return True
        with self._lock:
            return stage is not self.stage  # killed on purpose by a move, which started another

    def move_to(self, span: Span) -> None:
        """Serve `span` instead: announce it as JOINING at once (routers stop sending new work here, other peers
        see the claim), drain the stage (open sessions finish within the grace period or are cut, and clients
        replay them elsewhere), then load `span` in a new stage and announce it ONLINE. Keeps the peer id."""
        with self._move_lock:
            if self.state is not PeerState.ONLINE:
                return
            if self.last_info is not None and self.last_info["forward_tokens_per_s"] > 0:
                self.expected_throughput = self.last_info["forward_tokens_per_s"]  # same length, same hardware
            with self._lock:
                old_span, old_stage = self.span, self.stage
                self.span, self.state = span, PeerState.JOINING
            assert old_stage is not None
            logger.info("peer=%s moving from blocks %s to %s", self.peer_id, old_span, span)
            self.announcer.announce_now()
            old_stage.drain()(self.config.drain_grace_s + 30)
            with self._lock:
                old_stage.kill()
                self.stage = start_stage(self.config, self.peer_id, span)
            self.last_info = self.stage.info(LOAD_TIMEOUT_S)
            with self._lock:
                self.state = PeerState.ONLINE
            self.announcer.announce_now()
            if self.on_move is not None:
                self.on_move(self.last_info)

    def drain_started(self) -> DrainOutcome | None:
        """Stop moving, announce OFFLINE at once (routers stop sending), then ask the stage to drain; returns the
        wait for its outcome, or None if it never served (a start cut short: nothing to finish, and a drain would wait
        for the blocks to load). A move in progress finishes first."""
        if self.rebalancer is not None:
            self.rebalancer.stop()
        with self._move_lock, self._lock:
            self.state = PeerState.OFFLINE
            served = self.stage is not None and self.last_info is not None
        self.announcer.stop(PeerState.OFFLINE)
        return self.stage.drain() if served and self.stage is not None else None

    def _choose_span(self) -> Span:
        if self.config.blocks is not None:
            return Span(*self.config.blocks)
        length = blocks_for_peer(self.config, self.block_config)
        load = BlockLoad.from_peers(self.registry.peers(self.config.name), self.total_blocks)
        span, self.expected_throughput = choose_joining_span(load, length)
        return span


def drain(daemons: list[PeerDaemon], timeout_s: float) -> bool:
    """Drain every peer concurrently, then kill the stages; True if all finished their in-flight work."""
    pending = [(daemon, daemon.drain_started()) for daemon in daemons]
    deadline = time.monotonic() + timeout_s
    finished = True
    for _, outcome in pending:
        if outcome is not None:
            finished &= outcome(max(deadline - time.monotonic(), 0.1))
    for daemon, _ in pending:
        if daemon.stage is not None:
            daemon.stage.kill()
    return finished
