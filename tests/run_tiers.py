"""`make test`: the unit tier, then the integration and system tiers side by side, each in its own pytest run, then
a table of each tier's wall time and outcome. Every tier runs even when another failed (a broken unit test should
not hide an integration failure); the exit status is the first failing tier's.

Why side by side (docs/figures.md#the-test-suite): alone, each process-heavy tier keeps about half of the 2 cores
busy (0.55 and 0.62, measured) while daemons start and tests wait on them; side by side the cores are ~90 % busy. The
same tests cost about a quarter more CPU beside each other, so the overlap gives back 5-18 % (measured), not half.
The churn tests run in the system tier, so that the two end close together (tests/tiers.py). Within a tier,
pytest-xdist did not pay on 2 cores (measured twice: the integration tier on 2 workers took as long as in one
process), so each tier runs in one process; `SWARM_TEST_WORKERS=N` runs each on N workers (`--dist loadgroup`) on a
machine with more cores, and `--one-by-one` runs the tiers one after another.

The first tier of a group prints as it goes; the others write to a log that is printed, whole, once the group ends
(so CI's output never interleaves two runs). Tests that share a machine do not clash: ports are chosen free, and
network namespaces and Ray clusters are named per process.

Run: `python tests/run_tiers.py [--tier unit|integration|system ...] [--one-by-one] [-- extra pytest args]`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class TierRun:
    tier: str
    workers: int  # pytest-xdist workers; 0: in the pytest process itself


TIER_RUNS = (TierRun("unit", 0), TierRun("integration", 0), TierRun("system", 0))
TOGETHER = (("unit",), ("integration", "system"))  # tiers of a group run side by side, groups one after another
THREADS_VARIABLE = "SWARM_TORCH_THREADS"  # peers/actor.py's (a unit test keeps them equal); torch stays out of here
WORKERS_VARIABLE = "SWARM_TEST_WORKERS"  # overrides every tier's workers (0: no xdist), e.g. to debug a failure


@dataclass(frozen=True, slots=True)
class TierResult:
    run: TierRun
    status: int  # 0: passed (pytest's 5, no tests collected, counts as passed)
    seconds: float


def pytest_command(run: TierRun, extra: list[str]) -> list[str]:
    """The pytest command line of one tier."""
    workers = int(os.environ.get(WORKERS_VARIABLE, run.workers))
    command = [sys.executable, "-m", "pytest", "tests", "-m", run.tier, "--durations=10", "-p", "no:cacheprovider"]
    if workers:
        command += ["-n", str(workers), "--dist", "loadgroup"]
    return command + extra


def groups(chosen: list[TierRun], one_by_one: bool) -> list[list[TierRun]]:
    """The chosen tiers in the groups they run in: TOGETHER's, or each alone."""
    if one_by_one:
        return [[run] for run in chosen]
    named = {run.tier: run for run in chosen}
    found = [[named[tier] for tier in group if tier in named] for group in TOGETHER]
    return [group for group in found if group]


def tier_environment(group: list[TierRun]) -> dict[str, str]:
    """The tiers' environment: tiers side by side compute with one torch thread per process (the test processes and
    the peers they start), unless THREADS_VARIABLE says otherwise. Two threads per process on 2 shared cores wait for
    each other at every parallel region: a reference training took 136-157 s beside the other tier, 13 s alone."""
    environment = dict(os.environ)
    if len(group) > 1:
        environment.setdefault(THREADS_VARIABLE, "1")
    return environment


def run_group(group: list[TierRun], extra: list[str]) -> list[TierResult]:
    """Run a group's tiers at once: the first prints as it goes, each other's output is printed once it is done."""
    with tempfile.TemporaryDirectory(prefix="swarm-tiers-") as logs:
        started = time.monotonic()
        running = []
        for index, run in enumerate(group):
            log = None if index == 0 else open(Path(logs) / f"{run.tier}.log", "w+")  # noqa: SIM115 (closed below)
            command = pytest_command(run, extra)
            process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=log, env=tier_environment(group))
            running.append((run, process, log))
        ended: dict[str, TierResult] = {}
        while len(ended) < len(running):
            for run, process, _ in running:
                status = process.poll()
                if status is not None and run.tier not in ended:
                    ended[run.tier] = TierResult(run, 0 if status == 5 else status, time.monotonic() - started)
            time.sleep(0.5)
        for run, _, log in running:
            if log is not None:
                log.seek(0)
                print(f"\n===== the {run.tier} tier's output (it ran beside {group[0].tier}) =====", flush=True)
                sys.stdout.write(log.read())
                sys.stdout.flush()
                log.close()
        return [ended[run.tier] for run, _, _ in running]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tier", action="append", choices=[run.tier for run in TIER_RUNS], help="default: all")
    parser.add_argument("--one-by-one", action="store_true", help="run the tiers one after another")
    parser.add_argument("pytest_args", nargs="*", help="passed to every pytest run (after --)")
    ns = parser.parse_args(argv)
    chosen = [run for run in TIER_RUNS if ns.tier is None or run.tier in ns.tier]
    started = time.monotonic()
    results = [result for group in groups(chosen, ns.one_by_one) for result in run_group(group, ns.pytest_args)]
    print("\n===== tiers (wall time; tiers of a group ran side by side) =====")
    print(f"{'tier':<12} {'workers':>7} {'status':>7} {'wall':>9}")
    for result in results:
        workers = os.environ.get(WORKERS_VARIABLE, result.run.workers)
        outcome = "passed" if result.status == 0 else "FAILED"
        print(f"{result.run.tier:<12} {workers:>7} {outcome:>7} {_minutes(result.seconds):>9}")
    print(f"{'all':<12} {'':>7} {'':>7} {_minutes(time.monotonic() - started):>9}")
    return next((result.status for result in results if result.status), 0)


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{seconds % 60:04.1f}s"


if __name__ == "__main__":
    sys.exit(main())
