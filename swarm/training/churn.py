"""Preemption on a schedule for a training job: every period (or at given steps of the run), SIGKILL one replica of
each stage (Ray restarts it as a fresh process that rejoins and downloads the stage's state), and watch the stages'
step counters meanwhile.
A stage whose replicas are not all serving is spared until they are: killing its last live replica would lose the
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
RETRY_S = 2.0  # how soon a stage spared because a replica was restarting is tried again


@dataclass(frozen=True, slots=True)
class Sweep:
    """One look at every replica of one stage: the steps of those that answered."""

    at: float  # time.monotonic() when the sweep began
    stage: str
    steps: dict[str, int]  # peer_id -> step
    replicas: int  # replicas the stage should have

    @property
    def complete(self) -> bool:
        return len(self.steps) == self.replicas


@dataclass
class ReplicaChurn:
    """Start with `start()`, stop with `stop()`; `kills` and `seen` tell what happened."""

    job: Any  # peers.training.job.TrainingJob, started
    period_s: float
    seed: int = 0
    max_kills: int | None = None  # stop killing once this many replicas were killed (None: until stop())
    first_after_s: float | None = None  # the first kills this long after start() (None: one period)
    # Kill at these steps of each stage instead of every period: the kills land at the same points of the run on a
    # fast machine and on a loaded one (periods drawn from another run's time did not)
    at_steps: tuple[int, ...] = ()
    kills: int = 0
    last_kill_at: float | None = None  # time.monotonic() of the latest kill
    skipped: int = 0  # tries at a stage due a kill while one of its replicas was still restarting
    killed: list[tuple[float, str]] = field(default_factory=list)  # (time.monotonic(), stage) of each kill
    sweeps: list[Sweep] = field(default_factory=list)
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

    def stop_killing(self) -> None:
        """No more kills; the watch goes on (until stop()), so that rejoin_seconds() can see the last ones back."""
        self.max_kills = self.kills

    def wait_kills(self, timeout_s: float) -> bool:
        """Wait until the kills are over (the kill budget or `at_steps` spent), at most `timeout_s`; True if they
        are. A kill due at a step the run passed while a replica was still restarting comes once it serves again."""
        killer = next((thread for thread in self._threads if thread.name == "churn-kill"), None)
        if killer is not None:
            killer.join(timeout_s)
        return killer is not None and not killer.is_alive()

    @property
    def done_killing(self) -> bool:
        """The kill budget is spent: the job runs on undisturbed (and is still watched) until it ends."""
        return self.max_kills is not None and self.kills >= self.max_kills

    def rejoined_after_the_last_kill(self) -> set[str]:
        """The stages every replica of which answered (the killed one restarted and took the state) after the
        latest kill."""
        after = self.last_kill_at if self.last_kill_at is not None else float("-inf")
        return {sweep.stage for sweep in self.sweeps if sweep.at > after and sweep.complete}

    def wait_rejoined(self, timeout_s: float) -> set[str]:
        """Wait until every stage had all of its replicas answer after the latest kill (the killed ones were
        restarted and joined), at most `timeout_s`; returns the stages that did."""
        stages = {f"{start}-{end}" for start, end in self.job.stages}
        deadline = time.monotonic() + timeout_s
        while self.rejoined_after_the_last_kill() != stages and time.monotonic() < deadline:
            time.sleep(WATCH_PERIOD_S)
        return self.rejoined_after_the_last_kill()

    def rejoin_seconds(self) -> list[float | None]:
        """For each kill, the seconds until every replica of its stage answered again (the killed one restarted
        and took the state); None: not seen before the watch stopped."""
        return [self._rejoined_after(stage, at) for at, stage in self.killed]

    def _rejoined_after(self, stage: str, killed_at: float) -> float | None:
        sweeps = (s for s in self.sweeps if s.stage == stage and s.at > killed_at and s.complete)
        first = next(sweeps, None)
        return None if first is None else first.at - killed_at

    def steps_went_back(self) -> list[str]:
        """A stage's committed step (the lowest step of its replicas when all of them answered: every replica
        has applied it) must never decrease, and no replica may ever report a step below it (a replica that
        restarts takes the stage's state, not an older one). Returns each violation seen; empty: none.

        A step only the killed replica had applied (it died while its sibling was still receiving the round's
        result) is not committed: the sibling redoes it with its own gradients."""
        problems: list[str] = []
        committed: dict[str, int] = {}
        for sweep in sorted(self.sweeps, key=lambda s: s.at):
            floor = committed.get(sweep.stage, 0)
            problems += [
                f"stage {sweep.stage}: replica {peer} at step {step} after step {floor} was committed"
                for peer, step in sweep.steps.items()
                if step < floor
            ]
            if sweep.complete:
                committed[sweep.stage] = max(floor, min(sweep.steps.values()))
        return problems

    def _kill_loop(self) -> None:
        chooser = random.Random(self.seed)
        if self.at_steps:
            self._kill_at_steps(chooser)
        else:
            self._kill_every_period(chooser)

    def _kill_every_period(self, chooser: random.Random) -> None:
        """Each stage is due a kill every period; a stage that is due while one of its replicas is still
        restarting is tried again every RETRY_S, not a whole period later (a restart takes 10-20 s under load:
        waiting a period would leave a short job with one kill fewer on that stage)."""
        first = self.period_s if self.first_after_s is None else self.first_after_s
        due = {span: time.monotonic() + first for span in self.job.stages}
        while not self._stop.wait(max(min(due.values()) - time.monotonic(), 0.0)):
            for span, actors in self.job.stages.items():
                if self.done_killing:
                    return
                if due[span] <= time.monotonic():
                    killed = self._kill_one(span, actors, chooser)
                    due[span] = time.monotonic() + (self.period_s if killed else RETRY_S)

    def _kill_at_steps(self, chooser: random.Random) -> None:
        """A stage loses a replica once its step reaches each of `at_steps` in turn; while one of its replicas is
        still restarting, it is tried again at the next watch."""
        passed = dict.fromkeys(self.job.stages, 0)  # how many of at_steps each stage had its kill at
        while not self._stop.wait(WATCH_PERIOD_S):
            for span, actors in self.job.stages.items():
                if self.done_killing:
                    return
                due = passed[span] < len(self.at_steps) and self.stage_step(span) >= self.at_steps[passed[span]]
                if due and self._kill_one(span, actors, chooser):
                    passed[span] += 1
            if all(count == len(self.at_steps) for count in passed.values()):
                return

    def stage_step(self, span: tuple[int, int]) -> int:
        """The highest step a replica of the stage reported at the latest sweep that saw any (0: none yet)."""
        stage = f"{span[0]}-{span[1]}"
        latest = next((sweep for sweep in reversed(self.sweeps) if sweep.stage == stage and sweep.steps), None)
        return max(latest.steps.values()) if latest is not None else 0

    def _kill_one(self, span: tuple[int, int], actors: list[Any], chooser: random.Random) -> bool:
        """SIGKILL a random replica of the stage, if every replica serves (never the last one holding the stage's
        state); False when one is still restarting."""
        import ray

        try:
            infos = ray.get([actor.info.remote() for actor in actors], timeout=5)
        except Exception as error:
            self.skipped += 1
            logger.info("stage %s: not killing now, a replica is not serving: %s", span, error)
            return False
        os.kill(chooser.choice(infos)["pid"], signal.SIGKILL)
        self.kills += 1
        self.last_kill_at = time.monotonic()
        self.killed.append((self.last_kill_at, f"{span[0]}-{span[1]}"))
        return True

    def _watch_loop(self) -> None:
        import ray

        while not self._stop.wait(WATCH_PERIOD_S):
            for (start, end), actors in self.job.stages.items():
                began = time.monotonic()  # a sweep counts from its start: a kill during it may precede its answers
                steps: dict[str, int] = {}
                for actor in actors:
                    try:
                        info = ray.get(actor.info.remote(), timeout=2)
                    except Exception:  # dead or restarting: nothing to see
                        continue
                    steps[info["peer_id"]] = info["step"]
                self.sweeps.append(Sweep(began, f"{start}-{end}", steps, len(actors)))
