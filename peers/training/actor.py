"""TrainingStagePeer: one replica of a training stage (in a job, inside a StageActor Ray actor: stage_actor.py).

It joins the run's DHT, builds its stage from the checkpoint, takes the stage's state from a live replica (or,
when none is alive, from the newest checkpoint), then serves TrainingStage over gRPC and announces itself
ONLINE. When Ray restarts it after a crash, __init__ runs again and it rejoins the same way.

Unlike inference peers, the DHT lives in this process: hivemind's averagers need the gradients. Its forked
helpers are made to die with the actor (swarm/registry/fork_guard.py) so Ray still sees a crash.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from peers.metrics import PeerMetrics
from peers.training.callers import SiblingGate
from peers.training.gradient_exchange import GradientExchange
from peers.training.metrics import StageCollector
from peers.training.optimizer import build_optimizer
from peers.training.replica import StageReplica
from peers.training.service import StageIdentity, TrainingStageService
from peers.training.siblings import SiblingReplicas
from peers.training.stage_model import load_stage_model
from swarm._proto import swarm_pb2_grpc as pb_grpc
from swarm.errors import InvalidRequest
from swarm.registry import Announcer, Registry
from swarm.registry.fork_guard import die_with_parent_on_fork
from swarm.registry.hosts import join_host_port, multiaddr_host
from swarm.training.checkpoints import latest_stage_checkpoint, read_stage_checkpoint, write_stage_checkpoint
from swarm.training.config import TrainConfig
from swarm.training.stage_calls import StageCalls
from swarm.types import PeerInfo, PeerState, Span

if TYPE_CHECKING:
    from swarm.partition.config import PortableConfig

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 << 20  # micro-batches travel whole (no chunking on the training RPCs)
ANNOUNCE_PERIOD_S, ANNOUNCE_TTL_S = 1.0, 4.0
CATCH_UP_PERIOD_S = 1.0


class TrainingStagePeer:
    """Plain class; swarm/training/job.py wraps it with ray.remote. Keep the peer_id across restarts."""

    def __init__(
        self,
        config: TrainConfig,
        start: int,
        end: int,
        initial_peers: list[str],
        peer_id: str = "",
        model_config: PortableConfig | None = None,  # the model's config as the job read it (open_checkpoint)
        on_built: Callable[[], None] | None = None,  # called once built, before it takes the stage's state
    ) -> None:
        die_with_parent_on_fork()
        torch.set_num_threads(config.threads)
        self.config, self.span = config, Span(start, end)
        self.peer_id = peer_id or uuid.uuid4().hex[:16]
        self.registry = stage_registry(config, initial_peers)
        self.announced_host = config.hosts.announced(multiaddr_host(initial_peers[0]) if initial_peers else None)
        self.stage = f"{start}-{end}"
        self.replica = stage_replica(config, self.span, self.registry, model_config)
        self.total_blocks = self.replica.model.span.cfg.num_layers
        optimizer = self.replica.optimizer
        self.exchange = optimizer.exchange = gradient_exchange(config, self.peer_id, optimizer)
        self.metrics = PeerMetrics(self.peer_id)
        self.metrics.registry.register(StageCollector(self.replica, config.run_id, self.stage))
        self.server, self.address = self._serve()
        self.metrics_address = ""
        if config.metrics_port is not None:
            metrics_port = self.metrics.serve(config.host, config.metrics_port)
            self.metrics_address = join_host_port(self.announced_host, metrics_port)
        if on_built is not None:
            on_built()
        # Announced JOINING while it takes the stage's state: the live replicas hold their next step for it (see
        # SiblingReplicas.count), so the state it downloads is still the stage's when it goes ONLINE.
        self.state = PeerState.JOINING
        self.announcer = Announcer(self.registry, self.describe, ANNOUNCE_PERIOD_S, ANNOUNCE_TTL_S)
        self.announcer.start()
        self.joined_from = self._take_stage_state()
        self.state = PeerState.ONLINE
        self.announcer.announce_now()
        self._stop = threading.Event()
        self.siblings = SiblingReplicas(self.registry, config, self.span, self.peer_id, self._stop, ANNOUNCE_TTL_S)
        self._work_with_siblings(optimizer)
        threading.Thread(target=self._checkpoint_loop, daemon=True, name="stage-checkpoints").start()
        threading.Thread(target=self._catch_up_loop, daemon=True, name="stage-catch-up").start()
        logger.info(
            "stage %s replica %s serving at %s (state from %s, step %d)",
            self.stage,
            self.peer_id,
            self.address,
            self.joined_from,
            self.replica.step,
        )

    def _work_with_siblings(self, optimizer: Any) -> None:
        """Wire the replica, its service, its gradient exchange and its optimizer to its siblings; introduce it."""
        siblings, replica = self.siblings, self.replica
        replica.on_step_start, replica.on_progress = siblings.start_step, siblings.tell_progress
        replica.sibling_digests, replica.peer_id = siblings.digests_at, self.peer_id
        self.service.heard = siblings.heard
        self.service.gate = SiblingGate(lambda: dict(siblings.online), siblings.refresh)
        siblings.introduce(replica.step, optimizer.params_digest())
        optimizer.live_replicas = siblings.count
        self.exchange.siblings, self.exchange.on_unreachable = siblings.live, siblings.unreachable
        self.exchange.current_step = lambda: replica.step
        optimizer.sibling_samples = siblings.samples_toward
        optimizer.sibling_joining = lambda: siblings.joining > 0
        if self.config.averaging.overlap:
            optimizer.outside_lock = replica.unlocked

    def _take_stage_state(self) -> str:
        """Download the stage's state from a live replica; else (none alive, or the download failed before any
        step) resume from the newest checkpoint; else start from the model checkpoint."""
        live = [
            p
            for p in self.registry.peers(self.config.dht_key)
            if p.span == self.span and p.state is PeerState.ONLINE and p.peer_id != self.peer_id
        ]
        if live and (self.replica.optimizer.load_state_from_peers() or self.replica.step > 0):
            return f"replica ({len(live)} live)"
        root = self.config.checkpoint.dir
        path = latest_stage_checkpoint(root, self.config.run_id, *self.span_tuple) if root else None
        if path is not None:
            snapshot = read_stage_checkpoint(path)
            if snapshot.step > self.replica.step:
                self.replica.restore(snapshot)
                return f"checkpoint {path}"
        return f"replica ({len(live)} live)" if live else "the model checkpoint"

    @property
    def span_tuple(self) -> tuple[int, int]:
        return self.span.start, self.span.end

    def _serve(self) -> tuple[grpc.Server, str]:
        options = [
            ("grpc.so_reuseport", 0),  # a port another replica holds is taken, not shared between the two
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
        server = self.config.credentials.server(16, options)
        identity = StageIdentity(self.peer_id, self.config.run_id, self.span.start, self.span.end, self.total_blocks)
        self.downstream = StageCalls(self.config.codec_id, self.config.call_timeout_s, self.config.credentials)
        self.service = TrainingStageService(self.replica, identity, self.metrics, self.downstream)
        self.service.exchange = self.exchange
        pb_grpc.add_TrainingStageServicer_to_server(self.service, server)
        health_servicer = health.HealthServicer()
        health_servicer.set("rayswarm.v1.TrainingStage", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        try:
            port = self._bind(server)
        except InvalidRequest:  # no port free: what started so far (hivemind's processes) stops with it
            self.replica.optimizer.shutdown()
            self.registry.shutdown()
            raise
        server.start()
        own = join_host_port(self.announced_host, port)
        if self.registry.tunnel_addresses:  # nobody can dial this replica: its DHT node holds a relay slot
            self.registry.serve_tunnels(own)
            logger.info("stage %s replica %s: not reachable, serving through the relay", self.stage, self.peer_id)
            return server, self.registry.tunnel_addresses[0]
        self.registry.check_reachable(self.announced_host, port, f"stage {self.stage} replica {self.peer_id}")
        return server, own

    def _bind(self, server: grpc.Server) -> int:
        """Listen on the first port of `stage_port` that is free (any free port for 0).

        Raises:
            InvalidRequest: none of them is free, naming stage_port.
        """
        ports = self.config.stage_ports
        for port in ports:
            with contextlib.suppress(RuntimeError):  # grpcio raises on a port it cannot bind
                if bound := self.config.credentials.add_port(server, self.config.hosts.bind_address(port)):
                    return bound
        first, last = ports[0], ports[-1]
        raise InvalidRequest(f"stage_port: no port of {first}-{last} is free on {self.config.host}")

    def describe(self) -> PeerInfo:
        counters = self.replica.counters
        tokens = counters.samples_total * self.config.data.seq_len
        rate = tokens / counters.compute_seconds if counters.compute_seconds > 0 else 0.0
        return PeerInfo(
            self.peer_id,
            self.address,
            self.span,
            self.state,
            forward_tokens_per_s=rate,
            queue_length=counters.waiting,
            metrics_address=self.metrics_address,
            model=self.config.dht_key,
            total_blocks=self.total_blocks,
        )

    def info(self) -> dict[str, Any]:
        counters = self.replica.counters
        return {
            "peer_id": self.peer_id,
            "address": self.address,
            "pid": os.getpid(),
            "stage": self.stage,
            "step": self.replica.step,
            "samples_total": counters.samples_total,
            "averaging_rounds": counters.averaging_rounds,
            "compute_seconds": counters.compute_seconds,
            "compute_cpu_seconds": counters.compute_cpu_seconds,
            "averaging_seconds": counters.averaging_seconds,
            "queue_seconds": counters.queue_seconds,
            "forwards_reused": counters.forwards_reused,
            # what this replica pushed to the next stage and got back (Train): the trainers do not see these bytes
            "bytes_pushed": self.downstream.bytes_sent + self.downstream.bytes_received,
            "averaging_bytes_sent": self.exchange.bytes_sent,  # gradients sent to siblings, all rounds
            "joined_from": self.joined_from,
            "dht_addresses": self.registry.addresses,
            "metrics_address": self.metrics_address,
        }

    def parameters(self) -> dict[str, torch.Tensor]:
        """A copy of the stage's parameters (Hugging Face names), for tests and export."""
        return self.replica.snapshot().tensors

    def _checkpoint_loop(self) -> None:
        every, root = self.config.checkpoint.every, self.config.checkpoint.dir
        if not every or not root:
            return
        saved = self.replica.step // every
        while not self._stop.wait(0.5):
            if self.replica.step // every > saved:  # at multiples of `every`, so replicas write the same steps
                snapshot = self.replica.snapshot()
                write_stage_checkpoint(root, self.config.run_id, *self.span_tuple, snapshot)
                saved = snapshot.step // every

    def _catch_up_loop(self) -> None:
        while not self._stop.wait(CATCH_UP_PERIOD_S):
            try:
                self.replica.catch_up()
            except Exception as error:  # hivemind shutting down, no peer to download from: next period
                logger.info("catching up failed: %r", error)

    def stop(self) -> None:
        """Leave the run: announce OFFLINE, stop serving, shut hivemind down."""
        self._stop.set()
        self.announcer.stop(PeerState.OFFLINE)
        self.server.stop(grace=1.0).wait(2.0)
        self.downstream.close()
        self.exchange.close()
        self.replica.optimizer.shutdown()
        self.registry.shutdown()
        time.sleep(0.1)


def stage_replica(
    config: TrainConfig, span: Span, registry: Registry, model_config: PortableConfig | None
) -> StageReplica:
    """The stage's blocks from the checkpoint and their collaborative optimizer (in the run's DHT)."""
    model = load_stage_model(
        config.model,
        span.start,
        span.end,
        device=config.device,
        activation_checkpointing=config.activation_checkpointing,
        hf_config=model_config,
    )
    optimizer = build_optimizer(
        registry.dht,
        f"{config.run_id}_stage{span.start}-{span.end}",
        model.parameters(),
        config.optimizer,
        config.averaging,
        config.target_batch,
        config.steps,
        config.averaging.group_size or config.replicas_per_stage,
    )
    return StageReplica(model, optimizer, config.mixed_precision)


def gradient_exchange(config: TrainConfig, peer_id: str, optimizer: Any) -> GradientExchange:
    """The replica's side of its stage's gradient rounds, for the tensors hivemind's accumulators hold."""
    with optimizer.grad_averager.get_tensors() as gradients:
        shapes = [gradient.shape for gradient in gradients]
    averaging = config.averaging
    return GradientExchange(peer_id, shapes, averaging.compression, config.credentials, averaging.timeout_s)


def stage_registry(config: TrainConfig, initial_peers: list[str]) -> Registry:
    """The replica's DHT node. Unless `stage_dht_server` (or it has no initial peers: then it is the DHT), it only
    asks (hivemind's client mode): records live on the bootstrap nodes. hivemind's averagers and progress tracker
    read `dht.client_mode` to decide whether they accept incoming averaging streams and count as a full peer; the
    node's p2p daemon listens either way, so they are told it is not a client: client mode here means only that the
    node neither stores records nor answers lookups."""
    client = bool(initial_peers) and not config.stage_dht_server
    registry = Registry(
        initial_peers,
        host=config.host,
        announce_host=config.announce_host,
        credentials=config.credentials,
        client_mode=client,
        relay="use" if config.via_relay else "",
    )
    if client:
        registry.dht._client_mode = False  # read once through DHT.client_mode, which caches it here
    return registry
