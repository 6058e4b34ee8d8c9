"""Build the gRPC server a peer runs: the Peer service, the standard health service, message limits, and the
swarm's credentials (TLS and a member check on every call, or an explicitly open swarm).

Called by the stage actor (peers/actor.py) and by tests that serve a span in-process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from peers.backend import ForwardJob, SpanBackend
from peers.handlers import SERVICE_NAME, add_peer_service
from peers.kv_cache import CachePool
from peers.limits import LimitsConfig, stream_bytes_for
from peers.metrics import PeerMetrics
from peers.scheduler import Scheduler, TaskKind
from peers.service import PeerService, ServiceConfig
from swarm._proto import swarm_pb2 as pb
from swarm.errors import CredentialsError
from swarm.partition import BlockSpan
from swarm.security import SwarmCredentials

RESERVED_RPC_THREADS = 8  # kept free of inference streams for Push, Forward, Info and Health


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    max_message_bytes: int = 4 << 20  # gRPC's own default; bigger tensors are chunked on the stream RPCs
    max_request_tokens: int = 8192  # batch x seq of one request
    max_batch_tokens: int = 8192  # tokens the scheduler merges into one forward
    cache_tokens: int = 65536  # KV-cache pool size, in tokens (batch x max_length summed over sessions)
    max_session_length: int = 8192
    rpc_threads: int = 32  # concurrent RPCs (each open inference stream holds one)
    limits: LimitsConfig = field(default_factory=LimitsConfig)  # per-client admission (peers/limits.py)
    output_noise_std: float = 0.0  # FAULT INJECTION for tests only: see ServiceConfig.output_noise_std
    # SwarmCredentials.load(DIR) for a private swarm, SwarmCredentials.open() for an open one; None refuses to serve
    credentials: SwarmCredentials | None = None


class PeerServer:
    """A running gRPC server for one span; `state` moves it through JOINING -> ONLINE -> DRAINING."""

    def __init__(self, span: BlockSpan, config: ServerConfig, peer_id: str = "local", model: str = "") -> None:
        """Raises CredentialsError when `config.credentials` is None: an open swarm must be asked for."""
        if config.credentials is None:
            raise CredentialsError("no swarm credentials: pass SwarmCredentials.load(DIR) or SwarmCredentials.open()")
        self.config = config
        self.backend = SpanBackend(span, config.max_request_tokens)
        self.pool = CachePool(config.cache_tokens)
        self.scheduler = Scheduler(
            {
                TaskKind.FORWARD: self.backend.forward,
                TaskKind.BACKWARD: lambda jobs: [self.backend.backward(*job) for job in jobs],
                TaskKind.INFERENCE: lambda jobs: [self.backend.inference_step(*job) for job in jobs],
            },
            max_batch_tokens=config.max_batch_tokens,
        )
        service = ServiceConfig(
            peer_id,
            model,
            span.cfg.num_layers,
            config.max_message_bytes,
            config.max_session_length,
            max_sessions=max(1, config.rpc_threads - RESERVED_RPC_THREADS),
            limits=config.limits,
            stream_bytes=config.limits.stream_bytes
            or stream_bytes_for(config.max_request_tokens, span.cfg.hidden_size, config.max_message_bytes),
            output_noise_std=config.output_noise_std,
            credentials=config.credentials,
        )
        self.metrics = PeerMetrics(peer_id)
        self.service = PeerService(self.backend, self.scheduler, self.pool, service, self.metrics)
        self._bind_gauges()
        self.health = health.HealthServicer()
        options = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        self._server = config.credentials.server(config.rpc_threads, options)
        add_peer_service(self.service, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        self.port = config.credentials.add_port(self._server, f"{config.host}:{config.port}")
        self.address = f"{config.host}:{self.port}"
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    def start(self) -> None:
        self._server.start()
        self.service.state = pb.PEER_STATE_ONLINE
        self._set_health(health_pb2.HealthCheckResponse.SERVING)

    def measure_throughput(self, tokens: int = 64, steps: int = 4) -> None:
        """Seed the throughput meters before any traffic: routers need a number from the first announcement."""
        span = self.backend.span
        hidden = torch.randn(1, tokens, span.cfg.hidden_size, dtype=span.dtype, device=span.device)
        blocks = range(span.start, span.end)
        self.scheduler.submit(TaskKind.FORWARD, ForwardJob(hidden, 0, blocks), tokens=tokens).result()
        cache = span.new_cache(1, steps)
        for position in range(steps):
            payload = (cache, hidden[:, :1], position, blocks)
            self.scheduler.submit(TaskKind.INFERENCE, payload, tokens=1).result()

    def drain(self, grace_s: float) -> bool:
        """Refuse new sessions, let in-flight work finish within `grace_s`, then stop. True if all finished."""
        deadline = time.monotonic() + grace_s
        self.service.state = pb.PEER_STATE_DRAINING
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        # Keep answering while sessions finish, so that new ones get a clear UNAVAILABLE ("peer is DRAINING").
        while (self.pool.open_sessions or self.scheduler.queue_length) and time.monotonic() < deadline:
            time.sleep(0.05)
        remaining = max(deadline - time.monotonic(), 0.0)
        finished = self._server.stop(remaining).wait(remaining + 1.0)
        settle = time.monotonic() + 1.0  # handlers release their sessions in `finally`, just after stop()
        while self.pool.open_sessions and time.monotonic() < settle:
            time.sleep(0.02)
        self.service.pusher.close()
        return self.scheduler.close(timeout_s=1.0) and finished and not self.pool.open_sessions

    def stop(self) -> None:
        self._server.stop(0).wait(5.0)
        self.scheduler.close(timeout_s=5.0)
        self.service.pusher.close()

    def _bind_gauges(self) -> None:
        m, meters = self.metrics, self.scheduler.meters
        m.bind_gauges(
            {
                m.queue_length: lambda: self.scheduler.queue_length,
                m.cache_tokens_in_use: lambda: self.pool.tokens_in_use,
                m.cache_tokens_total: lambda: self.pool.capacity_tokens,
                m.open_sessions: lambda: self.pool.open_sessions,
                m.forward_tokens_per_s: lambda: meters[TaskKind.FORWARD].rate,
                m.inference_steps_per_s: lambda: meters[TaskKind.INFERENCE].rate,
            }
        )
        scheduler = self.scheduler
        m.bind_compute_totals(
            lambda: {kind.name.lower(): total for kind, total in scheduler.tokens_total.items()},
            lambda: {kind.name.lower(): total for kind, total in scheduler.busy_s_total.items()},
        )

    def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)
