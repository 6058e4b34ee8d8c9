"""A stage replica boots at idle CPU priority, so the replicas its host still serves keep their cores.

Restarting a replica costs a fresh process about 3.7 s of CPU before it serves: Ray's worker, the imports (torch,
hivemind), hivemind's DHT and daemons, the stage's blocks and optimizer. On a host whose other replicas keep
training, that boot used to halve the whole swarm's throughput for the 8-11 s it took (2 cores, docs/figures.md,
"Training"). Under SCHED_IDLE the boot runs only on cycles nobody else wants, and any other thread that wakes up
takes the core at once. Plain `nice 19` was measured too and does not do this: a woken replica still waited for
the booting thread's time slice, and the swarm ran at 31 samples/s instead of 50.

Linux keeps the policy per thread; threads and processes started by an idle thread are idle too. So the boot ends
by putting every idle thread of this process and of its descendants (hivemind's DHT and averagers, p2pd, torch's
shared-memory manager) back under the normal policy; their nice values never changed. A deadline bounds it: on a
host that never idles, a boot finishes at normal priority rather than never. The deadline is a process of its own
(idle_deadline.py), since a thread of the booting process would wait for the GIL its idle thread holds. Where a
thread could not return to the normal policy (sched(7): an unprivileged user under the default RLIMIT_NICE, or a
container without CAP_SYS_NICE), tried first on a thread of its own, nothing changes and the replica boots as
before.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType

from peers.training.idle_deadline import restore_normal_policy

logger = logging.getLogger(__name__)

DEADLINE_SCRIPT = Path(__file__).with_name("idle_deadline.py")


class IdleBoot:
    """`with IdleBoot(deadline_s) as boot:` the calling thread (and all it starts) runs under SCHED_IDLE until
    `boot.end()`, the block's end or `deadline_s`, whichever comes first. The deadline is a process of its own at
    normal priority (idle_deadline.py): a thread of this process would need the GIL, which the idle thread holds."""

    def __init__(self, deadline_s: float) -> None:
        self.deadline_s = deadline_s
        self.started_at = time.monotonic()
        self.ended_after_s: float | None = None  # seconds at idle priority; None: it never was (or still is)
        self._lock = threading.Lock()
        self._deadline: subprocess.Popen[str] | None = None
        self.active = False

    def __enter__(self) -> IdleBoot:
        if self.deadline_s <= 0 or not may_leave_idle():
            return self
        self.started_at = time.monotonic()
        deadline = self.started_at + self.deadline_s
        try:  # started before this thread turns idle, so that it keeps the normal policy
            self._deadline = subprocess.Popen(
                [sys.executable, "-I", "-S", str(DEADLINE_SCRIPT), str(os.getpid()), str(deadline)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        except OSError as error:  # no deadline, no idle boot: a boot that might never end is worse than a slow one
            logger.info("cannot start the idle boot's deadline: %s", error)
            return self
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError as error:  # a sandbox that refuses it: boot at normal priority
            logger.info("cannot boot at idle priority: %s", error)
            self._stop_deadline()
            return self
        self.active = True
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.end()

    def end(self) -> None:
        """Every thread of this process and of its descendants back under the normal policy (idempotent)."""
        with self._lock:
            if not self.active:
                return
            self.active = False
            ended_at = time.monotonic()
        restored_at = self._stop_deadline()
        if restored_at is not None:
            logger.info("boot ran past %.0f s at idle priority: it went on at normal priority", self.deadline_s)
        restore_normal_policy(os.getpid())
        self.ended_after_s = min(ended_at, restored_at or ended_at) - self.started_at

    def _stop_deadline(self) -> float | None:
        """Stop the deadline's process; when it acted (monotonic clock), or None if it did not."""
        if self._deadline is None:
            return None
        try:
            # a line, not just the pipe's end: a process forked meanwhile holds that end open too
            report, _ = self._deadline.communicate("end\n", timeout=10)
        except subprocess.TimeoutExpired:
            self._deadline.kill()
            report, _ = self._deadline.communicate()
        self._deadline = None
        return float(report) if report.strip() else None


def may_leave_idle() -> bool:
    """Whether a thread of this process may go back from SCHED_IDLE to SCHED_OTHER, tried on a thread of its own
    (one that could not just ends idle)."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    outcome: list[bool] = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            outcome.append(True)
        except OSError:
            outcome.append(False)

    thread = threading.Thread(target=probe, name="idle-boot-probe")
    thread.start()
    thread.join()
    return outcome == [True]
