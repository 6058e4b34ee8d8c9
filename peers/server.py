"""Build the gRPC server a peer runs: the Peer service, the standard health service, message limits, and the
swarm's credentials (TLS and a member check on every call, or an explicitly open swarm).

Called by the stage actor (peers/actor.py) and by tests that serve a span in-process.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time

import grpc
import torch
from grpc_health.v1 import health, health_pb2

from peers.config import ServerConfig
from peers.engine import Engine
from peers.engine_records import EngineConfig
from peers.kv_cache import PagePool, PoolShape
from peers.limits import stream_bytes_for
from peers.memory import kv_pool_pages
from peers.metrics import PeerMetrics
from peers.model_runner import ModelRunner
from peers.rpc_handlers import SERVICE_NAME, add_health_service, add_peer_service
from peers.scheduler import TaskKind
from peers.service import PeerService, ServiceConfig
from peers.serving_loop import serving_loop
from peers.task_runner import ForwardJob, TaskRunner
from swarm._proto import swarm_pb2 as pb
from swarm.errors import CredentialsError
from swarm.partition import BlockSpan
from swarm.prefix_keys import KEY_TOKENS
from swarm.registry.hosts import HostConfig, join_host_port, warn_if_unreachable

logger = logging.getLogger(__name__)

# Keepalive: pings on idle connections find peers and clients that vanished without closing (a host gone, a cable
# pulled), so their streams end and their sessions give their pages back.
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
]


class PeerServer:
    """A running gRPC server for one span; `state` moves it through JOINING -> ONLINE -> DRAINING."""

    def __init__(
        self,
        span: BlockSpan,
        config: ServerConfig,
        peer_id: str = "local",
        model: str = "",
        announce_toward: str | None = None,
    ) -> None:
        """`announce_toward` (an initial peer's host) picks the announced address when binding 0.0.0.0.

        Raises CredentialsError when `config.credentials` is None: an open swarm must be asked for."""
        if config.credentials is None:
            raise CredentialsError("no swarm credentials: pass SwarmCredentials.load(DIR) or SwarmCredentials.open()")
        self.config = config
        self.metrics = PeerMetrics(peer_id)
        self.backend = TaskRunner(span, config.max_request_tokens)
        caching = config.prefix_cache and config.page_size % KEY_TOKENS == 0
        self.pool = PagePool(pool_shape(span, config), span.dtype, span.device, prefix_cache=caching)
        self.engine = Engine(
            ModelRunner(span, self.pool),
            {
                TaskKind.FORWARD: self.backend.forward,
                TaskKind.BACKWARD: lambda jobs: [self.backend.backward(job) for job in jobs],
            },
            EngineConfig(config.max_batch_tokens, config.session_idle_s),
            self.metrics,
        )
        service = ServiceConfig(
            peer_id,
            model,
            span.cfg.num_layers,
            config.max_message_bytes,
            config.max_session_length,
            max_sessions=config.max_sessions,
            limits=config.limits,
            stream_bytes=config.limits.stream_bytes
            or stream_bytes_for(config.max_request_tokens, span.cfg.hidden_size, config.max_message_bytes),
            output_noise_std=config.output_noise_std,
            credentials=config.credentials,
            open_timeout_s=config.open_timeout_s,
        )
        self.service = PeerService(self.backend, self.engine, service, self.metrics)
        self.engine.on_dead = self._engine_died
        if config.adapters:  # loaded before the server listens: a bad adapter stops the start, naming it
            self.service.served.load_directory(config.adapters, span)
        self._bind_gauges()
        self.health = health.aio.HealthServicer()  # Watch streams are coroutines, cancelled when the server stops
        self._loop = serving_loop()
        self._server = self._loop.run(self._serve_on_loop())
        self.announced_host = HostConfig(config.host, config.announce_host).announced(announce_toward)
        self.address = join_host_port(self.announced_host, self.port)
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    async def _serve_on_loop(self) -> grpc.aio.Server:
        """The asyncio gRPC server, made on the loop that will run it, listening but not started."""
        config = self.config
        options = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),
            *KEEPALIVE_OPTIONS,
        ]
        server = config.credentials.aio_server(config.rpc_threads, options)
        add_peer_service(self.service, server)
        add_health_service(self.health, server)
        self.port = config.credentials.add_port(server, join_host_port(config.host, config.port))
        return server

    def start(self) -> None:
        self._loop.run(self._server.start())
        warn_if_unreachable(self.announced_host, self.port, f"peer {self.service.config.peer_id}")
        self.service.state = pb.PEER_STATE_ONLINE
        self._set_health(health_pb2.HealthCheckResponse.SERVING)

    def measure_throughput(self, tokens: int = 64, steps: int = 4) -> None:
        """Seed the throughput meters before any traffic: routers need a number from the first announcement."""
        span = self.backend.span
        hidden = torch.randn(1, tokens, span.cfg.hidden_size, dtype=span.dtype, device=span.device)
        blocks = range(span.start, span.end)
        self.engine.submit(TaskKind.FORWARD, ForwardJob(hidden, 0, blocks), tokens=tokens).result()
        session_id = "throughput-measurement"
        self.engine.open(session_id, blocks, batch_size=1, max_length=steps)
        try:
            for position in range(steps):
                self.engine.step(session_id, hidden[:, :1], position).result()
        finally:
            self.engine.close(session_id)

    def drain(self, grace_s: float) -> bool:
        """Refuse new sessions, let in-flight work finish within `grace_s`, then stop. True if all finished."""
        deadline = time.monotonic() + grace_s
        self.service.state = pb.PEER_STATE_DRAINING
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        # Keep answering while sessions finish, so that new ones get a clear UNAVAILABLE ("peer is DRAINING").
        while (self.engine.open_sessions or self.engine.queue_length) and time.monotonic() < deadline:
            time.sleep(0.05)
        remaining = max(deadline - time.monotonic(), 0.0)
        finished = self._stop_serving(remaining)
        settle = time.monotonic() + 1.0  # handlers release their sessions in `finally`, just after stop()
        while self.engine.open_sessions and time.monotonic() < settle:
            time.sleep(0.02)
        self.service.pusher.close()
        return self.engine.shutdown(timeout_s=1.0) and finished and not self.engine.open_sessions

    def stop(self) -> None:
        self._stop_serving(0.0)
        self.engine.shutdown(timeout_s=5.0)
        self.service.pusher.close()

    def _stop_serving(self, grace_s: float) -> bool:
        """Stop the gRPC server: calls still running after `grace_s` are cancelled. True if it stopped in time."""
        try:
            self._loop.run(self._server.stop(grace_s), timeout_s=grace_s + 5.0)
        except concurrent.futures.TimeoutError:
            return False
        return True

    def _engine_died(self) -> None:
        """The engine's loop is gone: answer OFFLINE and NOT_SERVING from now on, so that clients, health checks and
        the daemon's next announcement (peers/actor.py info) stop sending work here instead of losing it."""
        logger.critical("peer=%s engine died: serving OFFLINE", self.service.config.peer_id)
        self.service.state = pb.PEER_STATE_OFFLINE
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    def _bind_gauges(self) -> None:
        m, engine, pool = self.metrics, self.engine, self.pool
        m.bind_gauges(
            {
                m.queue_length: lambda: engine.queue_length,
                m.cache_tokens_in_use: lambda: pool.tokens_total - pool.tokens_free,
                m.cache_tokens_total: lambda: pool.tokens_total,
                m.kv_pages_used: lambda: pool.pages_used,
                m.kv_pages_free: lambda: pool.pages_free,
                m.open_sessions: lambda: engine.open_sessions,
                m.forward_tokens_per_s: lambda: engine.meters[TaskKind.FORWARD].rate,
                m.inference_steps_per_s: lambda: engine.meters[TaskKind.INFERENCE].rate,
            }
        )
        m.bind_compute_totals(
            lambda: {kind.name.lower(): total for kind, total in engine.tokens_total.items()},
            lambda: {kind.name.lower(): total for kind, total in engine.busy_s_total.items()},
        )
        if (cache := pool.cache) is not None:
            m.bind_prefix_cache(cache.stats, lambda: cache.pages)

    def _set_health(self, status: int) -> None:
        self._loop.run(self._set_health_on_loop(status))

    async def _set_health_on_loop(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)


def pool_shape(span: BlockSpan, config: ServerConfig) -> PoolShape:
    """The pool's pages (kv_pool_pages: the configured size, or the device's free memory) for every block."""
    pages = kv_pool_pages(span, config.page_size, config.cache_tokens, config.cache_gib, config.max_batch_tokens)
    return PoolShape.for_span(span, pages, config.page_size)
