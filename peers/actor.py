"""The stage actor: one peer's lifecycle inside a Ray actor. Announce JOINING, load the blocks, serve them over
gRPC, announce ONLINE and keep the record fresh; on drain announce OFFLINE, finish in-flight work, stop.

When Ray restarts a crashed actor it runs __init__ again, which joins and announces anew.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import uuid

import torch

from peers.config import PeerConfig
from peers.placement import choose_span
from peers.scheduler import TaskKind
from peers.server import PeerServer
from swarm.partition import load_span, open_checkpoint
from swarm.registry import Announcer, Registry
from swarm.types import PeerInfo, PeerState, Span

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class StagePeer:
    """Plain class; peers/launch.py wraps it with ray.remote. Tests may also run it in-process."""

    def __init__(self, config: PeerConfig) -> None:
        self.config = config
        self.peer_id = uuid.uuid4().hex[:16]
        torch.set_num_threads(config.threads or os.cpu_count() or 1)
        self.total_blocks = open_checkpoint(config.model_path)[2].num_layers
        self.registry = Registry(config.initial_peers, host=config.host)
        self.span = self._choose_span()
        self.state = PeerState.JOINING
        self.server: PeerServer | None = None
        self.metrics_address = ""
        self.registry.announce(self.describe(), config.ttl_s)
        blocks = load_span(
            config.model_path, self.span.start, self.span.end, TORCH_DTYPES[config.dtype], config.device
        )
        self.server = PeerServer(blocks, config.server, peer_id=self.peer_id, model=config.name)
        self.server.measure_throughput()
        self.server.start()
        metrics_port = self.server.metrics.serve(config.host, config.metrics_port)
        self.metrics_address = f"{config.host}:{metrics_port}"
        self.state = PeerState.ONLINE
        self.announcer = Announcer(self.registry, self.describe, config.announce_period_s, config.ttl_s)
        self.announcer.start()
        logger.info("peer=%s span=%s address=%s online", self.peer_id, self.span, self.server.address)

    def _choose_span(self) -> Span:
        if self.config.blocks is not None:
            return Span(*self.config.blocks)
        length = self.config.num_blocks or self.total_blocks
        return choose_span(self.registry.peers(self.config.name), self.total_blocks, length)

    def describe(self) -> PeerInfo:
        """The record this peer announces; before the server exists (JOINING) it has no address yet."""
        identity = PeerInfo(
            self.peer_id, "", self.span, self.state, model=self.config.name, total_blocks=self.total_blocks
        )
        server = self.server
        if server is None:
            return identity
        meters = server.scheduler.meters
        return dataclasses.replace(
            identity,
            address=server.address,
            forward_tokens_per_s=meters[TaskKind.FORWARD].rate,
            inference_steps_per_s=meters[TaskKind.INFERENCE].rate,
            queue_length=server.scheduler.queue_length,
            cache_tokens_free=server.pool.tokens_free,
            metrics_address=self.metrics_address,
        )

    def info(self) -> dict:
        info = self.describe()
        return {
            "peer_id": info.peer_id,
            "address": info.address,
            "span": [info.span.start, info.span.end],
            "state": info.state.value,
            "metrics_address": info.metrics_address,
            "pid": os.getpid(),
        }

    def drain(self) -> bool:
        """Announce OFFLINE, refuse new sessions, let in-flight work finish within the grace period, stop."""
        self.state = PeerState.OFFLINE
        self.announcer.stop(PeerState.OFFLINE)
        finished = self.server.drain(self.config.drain_grace_s) if self.server else True
        self.registry.shutdown()
        logger.info("peer=%s drained finished=%s", self.peer_id, finished)
        return finished
