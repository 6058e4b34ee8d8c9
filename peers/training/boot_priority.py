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
host that never idles, a boot finishes at normal priority rather than never. Where a thread could not return to
the normal policy (sched(7): an unprivileged user under the default RLIMIT_NICE, or a container without
CAP_SYS_NICE), tried first on a thread of its own, nothing changes and the replica boots as before.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from types import TracebackType

import psutil

logger = logging.getLogger(__name__)


class IdleBoot:
    """`with IdleBoot(deadline_s) as boot:` the calling thread (and all it starts) runs under SCHED_IDLE until
    `boot.end()`, the block's end or `deadline_s`, whichever comes first."""

    def __init__(self, deadline_s: float) -> None:
        self.deadline_s = deadline_s
        self.started_at = time.monotonic()
        self.ended_after_s: float | None = None  # seconds at idle priority; None: it never was (or still is)
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self.active = False

    def __enter__(self) -> IdleBoot:
        if self.deadline_s <= 0 or not may_leave_idle():
            return self
        # the timer's thread starts before this thread turns idle, so it keeps the normal policy
        self._timer = threading.Timer(self.deadline_s, self._deadline_passed)
        self._timer.daemon = True
        self._timer.start()
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError as error:  # a sandbox that refuses it: boot at normal priority
            logger.info("cannot boot at idle priority: %s", error)
            self._timer.cancel()
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
            self.ended_after_s = time.monotonic() - self.started_at
        if self._timer is not None:
            self._timer.cancel()
        for thread_id in _threads_of_this_process_tree():
            try:
                if os.sched_getscheduler(thread_id) == os.SCHED_IDLE:
                    os.sched_setscheduler(thread_id, os.SCHED_OTHER, os.sched_param(0))
            except OSError as error:  # exited meanwhile
                logger.debug("thread %d keeps its policy: %s", thread_id, error)

    def _deadline_passed(self) -> None:
        logger.info("boot still running after %.0f s at idle priority: going on at normal priority", self.deadline_s)
        self.end()


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


def _threads_of_this_process_tree() -> list[int]:
    me = psutil.Process()
    thread_ids: list[int] = []
    for process in [me, *me.children(recursive=True)]:
        try:
            thread_ids += [thread.id for thread in process.threads()]
        except psutil.Error as error:  # exited meanwhile
            logger.debug("process %d gone: %s", process.pid, error)
    return thread_ids
