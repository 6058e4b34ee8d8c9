"""Upper bounds on the best pipeline capacity the live peers of a simulated swarm could reach, over time.

Two bounds, both computed from the trace alone (who is live and loaded when), so that runs with and without
rebalancing are compared with the same optimum:
- even: sum of the peers' per-block speeds / number of blocks, as if each peer's work could be spread evenly over
  all blocks. Ignores that spans are contiguous and of fixed length.
- packing: the linear-programming relaxation of max-min placement with the peers' real span lengths: a peer may be
  split into fractions placed at different starts, but each fraction covers `length` consecutive blocks. Every
  real placement is a feasible point of it, so it bounds the true optimum from above, and it is below `even`
  (long spans cannot avoid overlapping near the model's edges). `vs_optimal` in benchmarks/rebalance_sim.py uses it.
The packing bound is recomputed every `sample_s` of simulated time and applied as a factor on the exact `even`
bound in between.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog

from benchmarks.swarm_trace import Arrival, SimConfig, load_s, span_length


def packing_bound(throughput_by_length: Mapping[int, float], num_blocks: int) -> float:
    """max T such that fractions of each length class, placed anywhere, give every block at least T.

    `throughput_by_length[L]`: summed tokens/s that the peers with spans of L blocks push through each of their
    blocks. Variables: the class-L throughput starting at each start s, and T.
    """
    columns = [(length, start) for length in throughput_by_length for start in range(num_blocks - length + 1)]
    cover = np.zeros((num_blocks, len(columns) + 1))
    for column, (length, start) in enumerate(columns):
        cover[start : start + length, column] = -1.0
    cover[:, -1] = 1.0  # T - sum of what covers block b <= 0
    totals = np.zeros((len(throughput_by_length), len(columns) + 1))
    for row, length in enumerate(throughput_by_length):
        totals[row, [c for c, (column_length, _) in enumerate(columns) if column_length == length]] = 1.0
    objective = np.zeros(len(columns) + 1)
    objective[-1] = -1.0
    solved = linprog(
        objective,
        A_ub=cover,
        b_ub=np.zeros(num_blocks),
        A_eq=totals,
        b_eq=np.array(list(throughput_by_length.values())),
        method="highs",
    )
    if not solved.success:
        raise RuntimeError(f"the packing LP failed: {solved.message}")
    return -float(solved.fun)


@dataclass
class OptimumIntegrals:
    even: float = 0.0  # integral over measured time of the even bound
    packing: float = 0.0  # integral of the packing bound


def optimum_integrals(trace: list[Arrival], config: SimConfig, sample_s: float = 300.0) -> OptimumIntegrals:
    """Integrate both bounds over the measured time. A peer counts from the end of its first load (as in the
    simulation: no placement serves with weights still loading) until it is preempted; moves are not excused."""
    num_blocks = config.model.num_layers
    changes: list[tuple[float, int, int, float]] = []  # (time, +1/-1, span length, block speed)
    for arrival in trace:
        length, speed = span_length(arrival.gpu, config), arrival.gpu.block_tokens_per_s
        online, gone = arrival.time_s + load_s(length, config), arrival.time_s + arrival.lifetime_s
        if online < gone:
            changes += [(online, 1, length, speed), (gone, -1, length, speed)]
    heapq.heapify(changes)
    start, end = config.warmup_hours * 3600, (config.warmup_hours + config.hours) * 3600
    speed_by_length: dict[int, float] = defaultdict(float)
    result, now, factor, next_sample = OptimumIntegrals(), 0.0, 1.0, start
    while now < end:
        upcoming = min(changes[0][0] if changes else end, next_sample, end)
        if upcoming > now and upcoming > start:
            even = sum(speed_by_length.values()) / num_blocks
            duration = upcoming - max(now, start)
            result.even += even * duration
            result.packing += even * factor * duration
        now = upcoming
        while changes and changes[0][0] <= now:
            _, sign, length, speed = heapq.heappop(changes)
            speed_by_length[length] += sign * speed
        if now >= next_sample:
            factor = _packing_factor(speed_by_length, num_blocks)
            next_sample = now + sample_s
    return result


def _packing_factor(speed_by_length: Mapping[int, float], num_blocks: int) -> float:
    """packing bound / even bound for the peers live now (1 when none are)."""
    live = {length: speed / length for length, speed in speed_by_length.items() if speed > 1e-9}
    even = sum(speed_by_length.values()) / num_blocks
    return packing_bound(live, num_blocks) / even if live and even > 0 else 1.0
