"""The stage actor: the part of a peer that lives inside a Ray actor (or, with `--no-ray`, in the peer's own process:
peers/stage_handle.py). It loads its blocks, serves them over gRPC
and reports how it is doing; peers/daemon.py announces it in the DHT and drains it.

The DHT deliberately stays out of this process: hivemind forks helper processes that inherit the worker's
connection to Ray, so Ray would never notice the worker dying and never restart it.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from peers.config import PeerConfig
from peers.scheduler import TaskKind
from peers.server import PeerServer
from swarm.partition import load_span
from swarm.registry.hosts import join_host_port, multiaddr_host
from swarm.types import Span

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Torch threads of a peer started without --threads; unset: one per core. Ray sets OMP_NUM_THREADS to an actor's
# CPUs (1), so that variable cannot say it. For several processes computing on the same few cores (the test suite's
# two tiers side by side): OpenMP's threads wait for each other at every parallel region, and one of them preempted
# stalls the rest (a training run of 13 s alone took 163 s on 2 threads beside 3 busy processes, 27 s on 1).
THREADS_VARIABLE = "SWARM_TORCH_THREADS"


def default_threads() -> int:
    """Torch threads for a peer whose --threads is 0: THREADS_VARIABLE's, or one per core."""
    return int(os.environ.get(THREADS_VARIABLE) or 0) or os.cpu_count() or 1


def resolve_dtype(name: str, device: str, has_bf16: bool | None = None) -> torch.dtype:
    """The blocks' dtype: `name`, or for auto bfloat16 on CUDA (float16 on a GPU without bf16, where BlockSpan
    clamps every block's output into float16's range) and float32 on CPU. Resolved here, in the process that owns
    the device: the command that started a Ray actor may run on another machine."""
    if name != "auto":
        return TORCH_DTYPES[name]
    if device != "cuda":
        return torch.float32
    if has_bf16 is None:
        has_bf16 = torch.cuda.is_bf16_supported()
    return torch.bfloat16 if has_bf16 else torch.float16


class StagePeer:
    """Plain class; peers/launch.py wraps it with ray.remote (when Ray restarts it, __init__ runs again), and
    peers/stage_handle.py InProcessStage builds it as it is."""

    def __init__(self, config: PeerConfig, peer_id: str, span: Span) -> None:
        self.config, self.peer_id, self.span = config, peer_id, span
        self._stopped = False
        torch.set_num_threads(config.threads or default_threads())
        dtype = resolve_dtype(config.dtype, config.device)
        started = time.monotonic()
        blocks = load_span(config.model_path, span.start, span.end, dtype, config.device, quant=config.quant)
        self.load_s = time.monotonic() - started  # reported apart from the start: it grows with the model
        toward = multiaddr_host(config.initial_peers[0]) if config.initial_peers else None
        self.server = PeerServer(blocks, config.server, peer_id=peer_id, model=config.name, announce_toward=toward)
        self.server.measure_throughput()
        self.server.start()
        metrics_port = self.server.metrics.serve(config.host, config.metrics_port)
        self.metrics_address = join_host_port(self.server.announced_host, metrics_port)
        logger.info("peer=%s span=%s address=%s serving", peer_id, span, self.server.address)

    def info(self) -> dict:
        """What the daemon announces, measured now."""
        server, engine = self.server, self.server.engine
        iteration_s = 1 / engine.meters[TaskKind.INFERENCE].rate if engine.meters[TaskKind.INFERENCE].rate else 0.0
        return {
            "peer_id": self.peer_id,
            "address": server.address,
            "span": [self.span.start, self.span.end],
            "forward_tokens_per_s": engine.meters[TaskKind.FORWARD].rate,
            "inference_steps_per_s": engine.meters[TaskKind.INFERENCE].rate,
            "queue_length": engine.queue_length,
            "cache_tokens_free": server.pool.tokens_free,
            "batch_size": engine.batch_size.value,
            "iteration_ms": 1000 * iteration_s,
            "metrics_address": self.metrics_address,
            "adapters": list(server.service.served.names()),
            "serving": engine.alive,  # False once its engine died: the daemon announces OFFLINE
            "pid": os.getpid(),
            "load_s": self.load_s,
        }

    def allow_push_to(self, addresses: frozenset[str]) -> None:
        """The next peers this stage may push to, as the daemon read them from the registry (issue 35, item 9)."""
        self.server.service.pusher.targets.update(addresses)

    def drain(self) -> bool:
        """Refuse new sessions, let in-flight work finish within the grace period, stop serving."""
        finished = self.server.drain(self.config.drain_grace_s)
        self._stopped = True
        logger.info("peer=%s drained finished=%s", self.peer_id, finished)
        return finished

    def stop(self) -> None:
        """Stop serving at once and free the ports, for a stage that ends while its process goes on (in a Ray actor
        the process ends with it)."""
        if not self._stopped:
            self._stopped = True
            self.server.stop()
        self.server.metrics.close()
