"""A short OpenMP spin-wait for every process that imports RaySwarm, and for the processes it starts.

torch computes on CPU with GNU OpenMP. After each parallel region its worker threads busy-wait for the next one, up
to GOMP_SPINCOUNT turns of a pause loop, before they sleep: 300,000 by default, which libgomp's own comment reckons
at 3 ms. A process alone on its machine loses nothing by it. RaySwarm's processes seldom are alone: a client, peer A
and peer B take turns on the same cores (`swarm up`, a peer beside its client, the tests), so the stage that has
just finished keeps spinning on the cores the next stage computes on, and every preempted thread stalls that stage's
next barrier.

Measured on this 2-core machine (2026-12-07), SmolLM2-135M through 2 peers of 2 threads each with the client beside
them, as `benchmarks.generate` runs it: a 10 s loop of 64-token generations took 46-48 ms per token with the default,
41-44 ms with 10,000-100,000 spins and 54-56 ms with 1,000 (the threads then sleep and wake inside an iteration);
`benchmarks.generate` itself, three alternating pairs, gave a token p50 of 46-48 ms before and 40-44 ms after, and a
failover's recovery of 0.8-1.3 s before and 0.4 s after. Alone in its process, a peer's 15-block iteration took
12.9-15.6 ms with 300,000 spins and 13.1-15.0 ms with 30,000 (back to back up to 30 ms apart): the same.

libgomp reads the variable once, when torch loads it, which is why `swarm/__init__.py` imports this module before
anything imports torch; set later it reaches only the processes started from here (Ray's raylet and its workers,
peer processes). A Ray cluster that an operator starts with `ray start` passes its own environment to the peers'
actors: set GOMP_SPINCOUNT there for CPU peers. Handing it to each actor through a runtime_env instead cost 1-3 ms
per token in the same loop, in six alternating runs of six (Ray then starts a worker of the job's own). An
operator's own GOMP_SPINCOUNT or OMP_WAIT_POLICY wins (the policy sets its own spin).
"""

from __future__ import annotations

import os

SPIN_COUNT = "30000"

if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
