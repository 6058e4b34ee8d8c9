"""A trainer: streams micro-batches of local data through the run's stage replicas, forward then backward.

Each micro-batch takes a fresh route from the stochastic-wiring router (per stage, the replica expected to finish
first given its measured throughput, its queue and this trainer's own work on it). A call that fails is retried
on another replica of the same stage (the failed one is banned with backoff); a backward may land on another
replica than its forward did, which is fine: stages keep no state between the two. The trainer holds no
parameters: the first stage embeds, the last computes the loss.

Plain class; peers/training/job.py runs it as a Ray actor, tests and benchmarks also in-process.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import torch

from swarm.errors import InvalidRequest, MissingBlocks, SwarmError
from swarm.partition import open_checkpoint
from swarm.registry import Registry
from swarm.registry.fork_guard import die_with_parent_on_fork
from swarm.registry.hosts import multiaddr_host
from swarm.router.wiring import WiringRouter
from swarm.training.config import TrainConfig
from swarm.training.data import load_dataset
from swarm.training.metrics import serve, trainer_registry
from swarm.training.stage_calls import StageAnswer, StageCalls
from swarm.training.stage_view import StageView
from swarm.types import Hop, Route, Span

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class TrainerProgress:
    samples: int = 0
    micro_batches: int = 0
    dropped_micro_batches: int = 0  # gave up after max_retries failures
    retries: int = 0
    stage_steps: dict[str, int] = field(default_factory=dict)  # highest step each stage has answered with
    recent_losses: deque = field(default_factory=lambda: deque(maxlen=64))
    compute_s: float = 0.0  # stage compute time of this trainer's calls
    transfer_s: float = 0.0  # the rest of the calls' time: coding, gRPC, network
    queue_s: float = 0.0  # the calls' time waiting for their replica
    averaging_s: float = 0.0  # the calls' time in a stage's collaborative step
    micro_batch_s: float = 0.0  # wall time of the micro-batches completed, first forward to last backward
    started: float = field(default_factory=time.monotonic)

    def as_dict(self) -> dict:
        losses = list(self.recent_losses)
        elapsed = max(time.monotonic() - self.started, 1e-9)
        return {
            "samples": self.samples,
            "micro_batches": self.micro_batches,
            "dropped_micro_batches": self.dropped_micro_batches,
            "retries": self.retries,
            "stage_steps": dict(self.stage_steps),
            "loss": sum(losses) / len(losses) if losses else math.nan,
            "samples_per_s": self.samples / elapsed,
            "compute_s": self.compute_s,
            "transfer_s": self.transfer_s,
            "queue_s": self.queue_s,
            "averaging_s": self.averaging_s,
            "micro_batch_s": self.micro_batch_s,
            "elapsed_s": elapsed,
        }


class Trainer:
    def __init__(self, config: TrainConfig, index: int = 0, initial_peers: list[str] | None = None) -> None:
        die_with_parent_on_fork()
        torch.set_num_threads(1)
        self.config, self.index = config, index
        self.total_blocks = open_checkpoint(config.model)[2].num_layers
        self.stage_spans = [Span(*s) for s in config.stage_spans(self.total_blocks)]
        self.dataset = load_dataset(config.data, config.model)
        self.generator = torch.Generator().manual_seed(config.seed * 7919 + index)
        peers = list(initial_peers or config.initial_peers)
        self.registry = Registry(
            peers,
            client_mode=True,
            host=config.host,
            announce_host=config.announce_host,
            credentials=config.credentials,
        )
        self.view = StageView(self.registry, config.dht_key, self.stage_spans)
        self.router = WiringRouter(rng=random.Random(config.seed * 7919 + index))
        self.calls = StageCalls(config.codec_id, config.call_timeout_s, config.credentials)
        self.progress = TrainerProgress(stage_steps={f"{s.start}-{s.end}": 0 for s in self.stage_spans})
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.metrics = trainer_registry(config.run_id, self.report)
        self.metrics_address = ""
        if config.metrics_port is not None:
            announced = config.hosts.announced(multiaddr_host(peers[0]) if peers else None)
            self.metrics_address = serve(self.metrics, config.metrics_port, config.host, announced)

    # ---- the loop ----

    def run(self, max_samples: int | None = None) -> dict:
        """Train until every stage reached `config.steps` (or `max_samples` were sent, or stop()); returns progress."""
        workers = [
            threading.Thread(target=self._work, args=(max_samples,), name=f"trainer-{self.index}-{i}", daemon=True)
            for i in range(self.config.in_flight(len(self.stage_spans)))
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        return self.report()

    def _work(self, max_samples: int | None) -> None:
        while not self._finished(max_samples):
            try:
                self.train_micro_batch()
            except MissingBlocks as error:
                logger.warning("trainer %d waiting for stages: %s", self.index, error)
                self.view.refresh()
                self._stop.wait(0.5)
            except SwarmError as error:
                with self._lock:
                    self.progress.dropped_micro_batches += 1
                logger.warning("trainer %d dropped a micro-batch: %s", self.index, error)

    def _finished(self, max_samples: int | None) -> bool:
        if self._stop.is_set():
            return True
        with self._lock:
            if max_samples is not None and self.progress.samples >= max_samples:
                return True
            return min(self.progress.stage_steps.values()) >= self.config.steps

    def train_micro_batch(self) -> float:
        """One micro-batch through every stage, forward then backward; returns its loss."""
        with self._lock:
            input_ids, labels = self.dataset.sample(self.config.micro_batch, self.generator)
        started = time.perf_counter()
        route = list(self._route(input_ids.numel()))
        batch_id = uuid.uuid4().hex  # with the stage's position, names each backward across its retries
        if self.config.push_activations:
            loss = self._push(route, input_ids, labels, batch_id)
        else:
            loss = self._relay(route, input_ids, labels, batch_id)
        with self._lock:
            self.progress.samples += input_ids.shape[0]
            self.progress.micro_batches += 1
            self.progress.micro_batch_s += time.perf_counter() - started
            self.progress.recent_losses.append(loss)
        return loss

    def _push(self, route: list[Hop], input_ids: torch.Tensor, labels: torch.Tensor, batch_id: str) -> float:
        """The stages pass the micro-batch on to each other (Train); a failed replica, wherever in the route, is
        replaced and the whole micro-batch sent again under the same request ids, so a stage that already applied
        its backward answers it again rather than applying it twice."""
        for attempt in range(self.config.max_retries + 1):
            later = [(hop.address, f"{batch_id}:{i}") for i, hop in enumerate(route)][1:]
            try:
                answer = self.calls.train(route[0].address, input_ids, labels, f"{batch_id}:0", later)
            except InvalidRequest:
                raise  # the same request would fail anywhere
            except SwarmError as error:
                if attempt == self.config.max_retries:
                    raise
                addresses = [hop.address for hop in route]
                failed = getattr(error, "failed_address", route[0].address)
                self._replace(route, addresses.index(failed) if failed in addresses else 0, error, input_ids.numel())
                continue
            for hop, timing in zip(route, answer.hops, strict=False):
                self._account_stage(hop, timing.step, timing.compute_s, timing.queue_s, timing.averaging_s)
            with self._lock:
                self.progress.transfer_s += answer.transfer_s
            return answer.loss
        raise AssertionError("unreachable")

    def _relay(self, route: list[Hop], input_ids: torch.Tensor, labels: torch.Tensor, batch_id: str) -> float:
        """The trainer carries every tensor: forward stage by stage, then backward in reverse."""
        inputs = [input_ids]
        for position in range(len(route) - 1):
            answer = self._call(route, position, "forward", inputs[position], request_id=f"{batch_id}:{position}")
            inputs.append(answer.tensor)
        end = len(route) - 1
        last = self._call(route, end, "backward", inputs[-1], labels=labels, request_id=f"{batch_id}:{end}")
        grad = last.tensor
        for position in reversed(range(end)):
            grad = self._call(
                route, position, "backward", inputs[position], grad_outputs=grad, request_id=f"{batch_id}:{position}"
            ).tensor
        return last.loss

    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor) -> float:
        """Loss of a fixed batch through the stages, forward only (no gradients, no step)."""
        route = list(self._route(input_ids.numel()))
        hidden = input_ids
        for position in range(len(route) - 1):
            hidden = self._call(route, position, "forward", hidden).tensor
        return self._call(route, len(route) - 1, "forward", hidden, labels=labels).loss

    def eval_loss(self) -> float:
        """Loss of the dataset's fixed evaluation batch with the stages' current parameters."""
        return self.evaluate(*self.dataset.eval_batch())

    # ---- routing and retries ----

    def _route(self, tokens: int, need: Span | None = None) -> Route:
        return self.router.choose(need or Span(0, self.total_blocks), self.view.peers(), tokens)

    def _call(self, route: list[Hop], position: int, kind: str, inputs: torch.Tensor, **tensors) -> StageAnswer:
        """Run one stage call, moving to another replica of the stage (and updating `route`) when one fails."""
        for attempt in range(self.config.max_retries + 1):
            hop = route[position]
            try:
                answer = getattr(self.calls, kind)(hop.address, inputs, **tensors)
            except InvalidRequest:
                raise  # the same request would fail anywhere
            except SwarmError as error:
                if attempt == self.config.max_retries:
                    raise
                self._replace(route, position, error, inputs.numel())
                continue
            self._account(hop, answer)
            return answer
        raise AssertionError("unreachable")

    def _replace(self, route: list[Hop], position: int, error: SwarmError, tokens: int) -> None:
        failed = route[position]
        logger.info(
            "trainer %d: stage %s replica %s failed (%s); retrying elsewhere",
            self.index,
            failed.span,
            failed.peer_id,
            error,
        )
        self.router.bans.ban(failed.peer_id)
        with self._lock:
            self.progress.retries += 1
        deadline = time.monotonic() + self.config.call_timeout_s
        while True:
            try:
                (route[position],) = self._route(tokens, failed.span)
                return
            except MissingBlocks:
                if time.monotonic() > deadline:
                    raise
                self.view.refresh()
                time.sleep(0.2)

    def _account(self, hop: Hop, answer: StageAnswer) -> None:
        self._account_stage(hop, answer.step, answer.compute_s, answer.queue_s, answer.averaging_s)
        with self._lock:
            self.progress.transfer_s += answer.transfer_s

    def _account_stage(self, hop: Hop, step: int, compute_s: float, queue_s: float, averaging_s: float) -> None:
        stage = f"{hop.span.start}-{hop.span.end}"
        with self._lock:
            self.progress.stage_steps[stage] = max(self.progress.stage_steps.get(stage, 0), step)
            self.progress.compute_s += compute_s
            self.progress.queue_s += queue_s
            self.progress.averaging_s += averaging_s

    # ---- control ----

    def report(self) -> dict:
        with self._lock:
            report = self.progress.as_dict()
        report["replicas"] = self.view.replicas()
        report["bytes_sent"], report["bytes_received"] = self.calls.bytes_sent, self.calls.bytes_received
        return report

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self._stop.set()
        self.view.close()
        self.calls.close()
        self.registry.shutdown()
