"""`make test`: the three tiers one after another, each in its own pytest run with its own parallelism, then a
table of each tier's wall time and outcome. Every tier runs even when an earlier one failed (a broken unit test
should not hide an integration failure); the exit status is the first failing tier's.

Parallelism (pytest-xdist) does not pay on the 2-core machine CI uses, measured (docs/figures.md#the-test-suite):
the unit tier took 55 s of wall time on 2 workers, about what it takes in one process (each worker imports torch
and collects the suite); the integration tier took 30 min 14 s on 2 workers (the modules that start daemons, Ray
clusters or peer processes all on one of them: tests/tiers.py's PROCESS_MODULES), as long as in one process, with
two tests failing under the load; on 4 workers the load passed 40. So every tier runs in one process;
`SWARM_TEST_WORKERS=N` runs each on N workers (`--dist loadgroup`) on a machine with more cores.

Run: `python tests/run_tiers.py [--tier unit|integration|system ...] [-- extra pytest args]`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class TierRun:
    tier: str
    workers: int  # pytest-xdist workers; 0: in the pytest process itself


TIER_RUNS = (TierRun("unit", 0), TierRun("integration", 0), TierRun("system", 0))
WORKERS_VARIABLE = "SWARM_TEST_WORKERS"  # overrides every tier's workers (0: no xdist), e.g. to debug a failure


def pytest_command(run: TierRun, extra: list[str]) -> list[str]:
    """The pytest command line of one tier."""
    workers = int(os.environ.get(WORKERS_VARIABLE, run.workers))
    command = [sys.executable, "-m", "pytest", "tests", "-m", run.tier, "--durations=10", "-p", "no:cacheprovider"]
    if workers:
        command += ["-n", str(workers), "--dist", "loadgroup"]
    return command + extra


def run_tier(run: TierRun, extra: list[str]) -> tuple[int, float]:
    """Run one tier; its exit status (5, no tests collected, counts as success) and wall seconds."""
    started = time.monotonic()
    status = subprocess.call(pytest_command(run, extra), cwd=REPO_ROOT)
    return (0 if status == 5 else status), time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tier", action="append", choices=[run.tier for run in TIER_RUNS], help="default: all")
    parser.add_argument("pytest_args", nargs="*", help="passed to every pytest run (after --)")
    ns = parser.parse_args(argv)
    chosen = [run for run in TIER_RUNS if ns.tier is None or run.tier in ns.tier]
    results = [(run, *run_tier(run, ns.pytest_args)) for run in chosen]
    print("\n===== tiers (wall time) =====")
    print(f"{'tier':<12} {'workers':>7} {'status':>7} {'wall':>9}")
    for run, status, seconds in results:
        workers = os.environ.get(WORKERS_VARIABLE, run.workers)
        print(f"{run.tier:<12} {workers:>7} {'passed' if status == 0 else 'FAILED':>7} {_minutes(seconds):>9}")
    total = sum(seconds for _, _, seconds in results)
    print(f"{'all':<12} {'':>7} {'':>7} {_minutes(total):>9}")
    return next((status for _, status, _ in results if status), 0)


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{seconds % 60:04.1f}s"


if __name__ == "__main__":
    sys.exit(main())
