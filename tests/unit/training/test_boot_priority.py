"""IdleBoot (peers/training/boot_priority.py): a booting replica's threads and the processes it starts run under
SCHED_IDLE, so a busy thread of normal priority keeps its core; the boot's end, or its deadline, puts every one of
them back. Each case runs in a fresh interpreter: a failed check must not leave pytest's own thread idle."""

from __future__ import annotations

import pytest

from peers.training.boot_priority import may_leave_idle

from ...fresh_python import run_python

pytestmark = pytest.mark.skipif(
    not may_leave_idle(),
    reason="this user may not return a thread from SCHED_IDLE (unprivileged, RLIMIT_NICE 0): IdleBoot does nothing",
)


def test_threads_and_processes_started_while_booting_are_idle_until_the_boot_ends() -> None:
    out = run_python(
        """
        import os, subprocess, threading
        from peers.training.boot_priority import IdleBoot

        IDLE, OTHER = os.SCHED_IDLE, os.SCHED_OTHER
        release, ids = threading.Event(), {}

        def helper():
            ids["thread"] = threading.get_native_id()
            release.wait()

        with IdleBoot(deadline_s=60) as boot:
            assert boot.active and os.sched_getscheduler(0) == IDLE
            thread = threading.Thread(target=helper)
            thread.start()
            child = subprocess.Popen(["sleep", "30"])
            while "thread" not in ids:
                pass
            assert os.sched_getscheduler(ids["thread"]) == IDLE
            assert os.sched_getscheduler(child.pid) == IDLE
            boot.end()
            assert not boot.active and boot.ended_after_s is not None
            for who in (0, ids["thread"], child.pid):
                assert os.sched_getscheduler(who) == OTHER, who
        child.kill()
        release.set()
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_the_deadline_ends_a_boot_that_runs_too_long() -> None:
    out = run_python(
        """
        import os, time
        from peers.training.boot_priority import IdleBoot

        with IdleBoot(deadline_s=0.3) as boot:
            assert os.sched_getscheduler(0) == os.SCHED_IDLE
            time.sleep(1.0)
            assert os.sched_getscheduler(0) == os.SCHED_OTHER
        assert 0.3 <= boot.ended_after_s < 1.0, boot.ended_after_s
        with IdleBoot(deadline_s=0) as never:
            assert os.sched_getscheduler(0) == os.SCHED_OTHER and not never.active
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_a_busy_normal_thread_keeps_its_core_against_an_idle_boot() -> None:
    """Both spin on one core for 1 s: CFS gives an idle-policy thread a weight of 3 against 1024."""
    out = run_python(
        """
        import os, time
        from peers.training.boot_priority import IdleBoot

        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        def spin(seconds):  # the CPU seconds this process got while spinning
            start, end = time.process_time(), time.monotonic() + seconds
            while time.monotonic() < end:
                pass
            return time.process_time() - start

        booting = os.fork()
        if booting == 0:
            with IdleBoot(deadline_s=60):
                os.write(1, f"idle {spin(1.0)}\\n".encode())
            os._exit(0)
        print("normal", spin(1.0), flush=True)
        os.waitpid(booting, 0)
        """
    )
    cpu = dict(line.split() for line in out.strip().splitlines())
    normal, idle = float(cpu["normal"]), float(cpu["idle"])
    assert normal > 5 * idle, cpu


def test_the_deadline_acts_even_while_the_booting_process_gets_no_cpu_at_all() -> None:
    """On a busy host the idle thread hardly runs and holds the GIL, so nothing inside its process can act on time
    (a timer thread waited 7.2 s for a 3 s deadline). Stopping the booting process models that exactly: the
    deadline still puts its threads back under the normal policy."""
    out = run_python(
        """
        import os, signal, time
        from peers.training.boot_priority import IdleBoot

        ready_r, ready_w = os.pipe()
        booting = os.fork()
        if booting == 0:
            with IdleBoot(deadline_s=0.5) as boot:
                os.write(ready_w, b"idle")
                time.sleep(5)
            os._exit(0)
        os.read(ready_r, 4)
        os.kill(booting, signal.SIGSTOP)
        assert os.sched_getscheduler(booting) == os.SCHED_IDLE
        time.sleep(1.5)
        policy = os.sched_getscheduler(booting)
        os.kill(booting, signal.SIGKILL)
        os.waitpid(booting, 0)
        print("other" if policy == os.SCHED_OTHER else f"policy {policy}")
        """
    )
    assert out.strip() == "other"
