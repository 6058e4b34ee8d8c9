"""Preemption on a schedule for a training job: every period, SIGKILL one replica of each stage (Ray restarts it
as a fresh process that rejoins and downloads the stage's state), and watch the stages' step counters meanwhile.
A stage whose replicas are not all serving is spared that period: killing its last live replica would lose the
state that was not checkpointed, which is the all-replicas-died case (resume from checkpoints), not churn.

Used by benchmarks/train.py and the churn test. It needs the replicas' processes on this machine (it signals
their PIDs, as a preempted VM's processes would die: no clean-up runs).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

WATCH_PERIOD_S = 1.0


@dataclass(frozen=True, slots=True)
class StepSeen:
    at: float  # time.monotonic()
    stage: str
    peer_id: str
    step: int


@dataclass
class ReplicaChurn:
    """Start with `start()`, stop with `stop()`; `kills` and `seen` tell what happened."""

    job: Any  # swarm.training.job.TrainingJob, started
    period_s: float
    seed: int = 0
    kills: int = 0
    skipped: int = 0  # periods a stage was spared because one of its replicas was still restarting
    seen: list[StepSeen] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> ReplicaChurn:
        for target, name in ((self._kill_loop, "churn-kill"), (self._watch_loop, "churn-watch")):
            thread = threading.Thread(target=target, daemon=True, name=name)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)

    def steps_went_back(self) -> list[str]:
        """Each stage's step (the highest any replica reported) and each replica's own step, across restarts,
        must never decrease; returns a description of every decrease seen (empty: none)."""
        problems: list[str] = []
        for key in ("stage", "peer_id"):
            highest: dict[str, StepSeen] = {}
            for seen in sorted(self.seen, key=lambda s: s.at):
                name = getattr(seen, key)
                before = highest.get(name)
                if before is not None and seen.step < before.step:
                    problems.append(f"{key} {name}: step {before.step} then {seen.step}")
                if before is None or seen.step > before.step:
                    highest[name] = seen
        return problems

    def _kill_loop(self) -> None:
        import ray

        chooser = random.Random(self.seed)
        while not self._stop.wait(self.period_s):
            for span, actors in self.job.stages.items():
                try:  # only while every replica serves: never the last one holding the stage's state
                    infos = ray.get([actor.info.remote() for actor in actors], timeout=5)
                except Exception as error:  # one is still restarting after the last kill: skip this stage
                    self.skipped += 1
                    logger.info("stage %s: no replica killed this period: %s", span, error)
                    continue
                os.kill(chooser.choice(infos)["pid"], signal.SIGKILL)
                self.kills += 1

    def _watch_loop(self) -> None:
        import ray

        while not self._stop.wait(WATCH_PERIOD_S):
            for actors in self.job.stages.values():
                for actor in actors:
                    try:
                        info = ray.get(actor.info.remote(), timeout=2)
                    except Exception:  # dead or restarting: nothing to see
                        continue
                    self.seen.append(StepSeen(time.monotonic(), info["stage"], info["peer_id"], info["step"]))
