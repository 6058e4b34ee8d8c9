"""How much of a core this process gets right now, for time bounds that must hold on a loaded machine.

A bound such as "the process is gone within 2 s of its last word" is set on a quiet machine. On a busy one (a second
suite beside this one, a benchmark) every process gets a fraction of a core, and the same work takes longer: the
bound is scaled by `slowdown()`, measured as wall time over CPU time of a fixed piece of pure-Python work, so it needs
no reference figure of any machine. On a quiet machine it is 1 and the bound is the one written in the test.
"""

from __future__ import annotations

import time

WORK_ITERATIONS = 200_000  # ~20 ms of one core: short beside any bound it scales
MAX_SLOWDOWN = 8.0  # past this the machine is not loaded but broken: the bound stops stretching


def slowdown(samples: int = 3) -> float:
    """Wall time over this thread's CPU time for the same work, at least 1 (the best of `samples` runs, so one
    unlucky scheduling moment does not stretch a bound on its own)."""
    ratios = []
    for _ in range(samples):
        wall, cpu = time.perf_counter(), time.thread_time()
        total = 0
        for i in range(WORK_ITERATIONS):
            total += i & 7
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        ratios.append(wall / max(cpu, 1e-6))
    return min(max(min(ratios), 1.0), MAX_SLOWDOWN)


def scaled(bound_s: float) -> float:
    """`bound_s` as it holds on this machine now: stretched by how loaded it is."""
    return bound_s * slowdown()
