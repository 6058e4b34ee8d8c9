"""Run a training job on a Ray cluster: a DHT bootstrap node, the stage replicas (when the job starts them) and
the trainers, as Ray actors; follow their progress; stop them. It lives with the stage replicas it launches
(peers/training/stage_actor.py): `swarm` imports `peers` only in its command line (`swarm train`).

The driver may be a Ray Client (`ray://head:10001`), a `ray job submit` entrypoint or a local process: tensors
never travel through Ray here, only small progress reports, so the Ray Client's slower calls do not matter.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from swarm.registry import Registry
from swarm.registry.fork_guard import die_with_parent_on_fork
from swarm.registry.hosts import HostConfig
from swarm.security import SwarmCredentials
from swarm.training import shared_memory
from swarm.training.config import TrainConfig
from swarm.training.trainer import Trainer

logger = logging.getLogger(__name__)

ACTOR_START_TIMEOUT_S = 300.0


class RunBootstrap:
    """A DHT node that only introduces the run's actors to each other; it outlives any stage replica."""

    def __init__(self, credentials: SwarmCredentials, hosts: HostConfig) -> None:
        die_with_parent_on_fork()
        self.registry = Registry(host=hosts.host, announce_host=hosts.announce_host, credentials=credentials)

    def addresses(self) -> list[str]:
        return self.registry.addresses


class TrainingJob:
    def __init__(self, config: TrainConfig, max_stage_restarts: int = 100) -> None:
        self.config, self.max_stage_restarts = config, max_stage_restarts
        self.bootstrap: Any = None
        self.stages: dict[tuple[int, int], list[Any]] = {}
        self.trainers: list[Any] = []
        self.runs: list[Any] = []
        self.initial_peers: list[str] = list(config.initial_peers)
        self._shared_memory_before: set[str] = set()

    def start(self) -> None:
        """Start every actor the job needs and the trainers' loops (returns at once)."""
        import ray

        self._shared_memory_before = shared_memory.snapshot()
        if not self.initial_peers:
            self.bootstrap = (
                ray.remote(RunBootstrap).options(num_cpus=0).remote(self.config.credentials, self.config.hosts)
            )
            self.initial_peers = ray.get(self.bootstrap.addresses.remote(), timeout=ACTOR_START_TIMEOUT_S)
        if self.config.launch_stages:
            self._start_stages()
        options = {"num_cpus": 0, "max_concurrency": 4}
        self.trainers = [
            ray.remote(Trainer).options(**options).remote(self.config, index, self.initial_peers)
            for index in range(self.config.trainers)
        ]
        self.runs = [trainer.run.remote() for trainer in self.trainers]

    def _start_stages(self) -> None:
        import ray

        from peers.training.stage_actor import StageActor, stage_actor_arguments
        from swarm.partition import open_checkpoint

        # a PortableConfig: the replicas unpickle it without importing transformers
        _, model_config, block_config = open_checkpoint(self.config.model)
        total = block_config.num_layers
        options = {
            "num_cpus": 0,
            "num_gpus": 1 if self.config.device == "cuda" else 0,
            "max_restarts": self.max_stage_restarts,
            "max_concurrency": 4,
        }
        remote = ray.remote(StageActor).options(**options)
        for start, end in self.config.stage_spans(total):
            self.stages[(start, end)] = [
                remote.remote(
                    *stage_actor_arguments(
                        self.config, start, end, self.initial_peers, f"stage{start}-{end}-r{replica}", model_config
                    )
                )
                for replica in range(self.config.replicas_per_stage)
            ]
        ray.get([a.info.remote() for actors in self.stages.values() for a in actors], timeout=ACTOR_START_TIMEOUT_S)

    def progress(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """The trainers' reports summed: samples, loss, samples/s, stage steps and live replicas per stage."""
        import ray

        reports = [r for r in ray.get([t.report.remote() for t in self.trainers], timeout=timeout_s) if r]
        losses = [r["loss"] for r in reports if not math.isnan(r["loss"])]
        steps: dict[str, int] = {}
        for report in reports:
            for stage, step in report["stage_steps"].items():
                steps[stage] = max(steps.get(stage, 0), step)
        return {
            "samples": sum(r["samples"] for r in reports),
            "samples_per_s": sum(r["samples_per_s"] for r in reports),
            "loss": sum(losses) / len(losses) if losses else math.nan,
            "stage_steps": steps,
            "step": min(steps.values()) if steps else 0,
            "replicas": reports[0]["replicas"] if reports else {},
            "retries": sum(r["retries"] for r in reports),
            "dropped_micro_batches": sum(r["dropped_micro_batches"] for r in reports),
            "compute_s": sum(r["compute_s"] for r in reports),
            "transfer_s": sum(r["transfer_s"] for r in reports),
            "queue_s": sum(r["queue_s"] for r in reports),
            "averaging_s": sum(r["averaging_s"] for r in reports),
            "micro_batch_s": sum(r["micro_batch_s"] for r in reports),
            "micro_batches": sum(r["micro_batches"] for r in reports),
            "bytes_sent": sum(r["bytes_sent"] for r in reports),
            "bytes_received": sum(r["bytes_received"] for r in reports),
        }

    def wait(self, on_progress: Callable[[dict], None] | None = None, period_s: float = 1.0) -> dict[str, Any]:
        """Block until every trainer finished; calls `on_progress` with progress() every `period_s`."""
        import ray

        pending = list(self.runs)
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=period_s)
            if on_progress is not None:
                try:
                    on_progress(self.progress())
                except Exception as error:  # a trainer busy or restarting: report next time
                    logger.debug("progress not available: %s", error)
        ray.get(self.runs)  # raise a trainer's failure here
        return self.progress()

    def wait_replicas_agree(self, timeout_s: float = 30.0, poll_s: float = 0.2) -> dict[tuple[int, int], list[int]]:
        """Wait until the replicas of each stage report the same step, at most `timeout_s`; returns each stage's
        replica steps as last seen. The trainers stop once some replica of every stage answered with the last step,
        while a sibling may still be applying it: read parameters after this, not right after wait()."""
        deadline = time.monotonic() + timeout_s
        while True:
            steps = {span: [info["step"] for info in infos] for span, infos in self.stage_infos().items()}
            if all(len(set(s)) == 1 for s in steps.values()) or time.monotonic() > deadline:
                return steps
            time.sleep(poll_s)

    def eval_loss(self) -> float:
        import ray

        return float(ray.get(self.trainers[0].eval_loss.remote(), timeout=ACTOR_START_TIMEOUT_S))

    def stage_infos(self) -> dict[tuple[int, int], list[dict]]:
        import ray

        return {span: ray.get([a.info.remote() for a in actors], timeout=30) for span, actors in self.stages.items()}

    def stop(self) -> None:
        """Stop trainers and stage replicas (announcing them OFFLINE first), then the bootstrap node."""
        import ray

        for trainer in self.trainers:
            _quietly(lambda t=trainer: ray.get(t.close.remote(), timeout=10))
            ray.kill(trainer, no_restart=True)
        for actors in self.stages.values():
            for actor in actors:
                _quietly(lambda a=actor: ray.get(a.stop.remote(), timeout=10))
                ray.kill(actor, no_restart=True)
        if self.bootstrap is not None:
            ray.kill(self.bootstrap, no_restart=True)
        time.sleep(0.2)
        # what replicas killed by churn and by the kills above left in RAM (on this machine; a remote node's stay)
        shared_memory.remove_orphaned(self._shared_memory_before)


def _quietly(call: Callable[[], Any]) -> None:
    try:
        call()
    except Exception as error:  # already dead, or restarting: kill follows anyway
        logger.debug("ignoring: %s", error)
