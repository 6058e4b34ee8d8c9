"""A short OpenMP spin-wait for every process that imports RaySwarm, and for the processes it starts.

torch computes on CPU with GNU OpenMP. After each parallel region its worker threads busy-wait for the next one,
up to GOMP_SPINCOUNT turns of a pause loop, before they sleep: 300,000 by default, which libgomp's own comment
reckons at 3 ms and which takes several times that on this machine's cores. A process alone on its machine loses
nothing by it. RaySwarm's processes seldom are alone: a client, peer A and peer B take turns on the same cores (`swarm
up`, a peer beside its client, the tests), so the stage that has just finished keeps spinning on the cores the next
stage computes on, and every preempted thread stalls that stage's next barrier.

Measured with `benchmarks.generate` (SmolLM2-135M, 2 peers of 2 threads and the client on 2 cores, 2026-12-07): one
session's token took 46-48 ms with the default and 38-42 ms with 10,000-100,000 spins (1,000 spins: 54-56 ms; the
threads sleep and wake inside an iteration). Alone, a process's iteration did not change.

libgomp reads the variable once, when torch loads it, which is why `swarm/__init__.py` imports this module before
anything imports torch; set later it reaches only the processes started from here (Ray's raylet and its workers,
peer processes). A Ray cluster that an operator starts with `ray start` passes its own environment to the peers'
actors: set GOMP_SPINCOUNT there for CPU peers (handing it to each actor through a runtime_env instead cost 1-3 ms
per token in the same benchmark, in all six of six alternating runs: Ray then starts a worker of the job's own). An operator's own
GOMP_SPINCOUNT or OMP_WAIT_POLICY wins (the policy sets its own spin).
"""

from __future__ import annotations

import os

SPIN_COUNT = "30000"

if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
