"""The suite's tiers, as pytest markers given by where a test lives; loaded by tests/conftest.py.

- `unit`: no processes, no network, no model beyond tiny random ones (tests/unit, less the few that start a
  process: UNIT_MODULES_THAT_START_PROCESSES).
- `integration`: real Ray, gRPC, DHT and peers on 127.0.0.1 (tests/integration, less the system tier's modules
  and directory).
- `system`: several hosts (network namespaces, a Ray cluster of several nodes), chaos, convergence, fuzzing, churn,
  whole training and fine-tuning jobs submitted to a Ray head, CUDA (SYSTEM_MODULES and SYSTEM_DIRECTORIES:
  tests/chaos, tests/cuda, tests/integration/cluster).

A test may name its tier itself: `@pytest.mark.integration` on a unit module's one test that starts a process,
`@pytest.mark.system` on the churn tests of tests/integration/peers/test_swarm_daemons.py and on the LoRA
convergence test of tests/integration/peers/test_finetune_lora.py (its module's SmolLM2 peers serve no other test).
In the unit tier, starting a process or a gRPC server, or binding or connecting an internet socket, fails the test
(TierViolation).

`make test` runs each tier in its own pytest run, the integration and system tiers side by side
(tests/run_tiers.py), and prints each tier's wall time; `make test-unit`, `make test-integration` and
`make test-system` run one. Under xdist, modules that start daemons, Ray clusters or peer processes form one group
(PROCESS_MODULES), every other module is one.
"""

from __future__ import annotations

import socket
import subprocess
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

TIERS = ("unit", "integration", "system")
TESTS_ROOT = Path(__file__).resolve().parent

# Modules under tests/unit that start a process or a server: they are integration tests by what they run.
UNIT_MODULES_THAT_START_PROCESSES = frozenset(
    {
        "unit/swarm/test_ray_cluster.py",
        "unit/swarm/test_ray_reaper.py",
        "unit/test_client_stands_alone.py",
        "unit/test_dashboard_schema.py",
        "unit/training/test_boot_priority.py",
        "unit/training/test_shared_memory.py",
        "unit/training/test_stage_boot_imports.py",
        "unit/training/test_gradient_exchange.py",
        "unit/training/test_sibling_calls.py",
        "unit/swarm/test_proto_generated.py",
    }
)
SYSTEM_DIRECTORIES = ("chaos/", "cuda/", "integration/cluster/")  # cluster/: several hosts (namespaces, Ray nodes)
SYSTEM_MODULES = frozenset(
    {
        "integration/security/test_fuzz.py",
        "integration/security/test_load.py",
        "integration/peers/test_finetune_churn.py",
        "integration/peers/test_placement_daemons.py",
        "integration/training/test_replica_divergence.py",
        "integration/training/test_ray_client.py",  # whole jobs, like the training swarm's (docs/figures.md)
        "integration/training/test_training_swarm.py",
    }
)


def tier_of(path: Path) -> str:
    """The tier of the test module at `path`, from where it lives."""
    relative = path.resolve().relative_to(TESTS_ROOT).as_posix()
    if relative in SYSTEM_MODULES or relative.startswith(SYSTEM_DIRECTORIES):
        return "system"
    if relative.startswith("unit/") and relative not in UNIT_MODULES_THAT_START_PROCESSES:
        return "unit"
    return "integration"


@dataclass(slots=True)
class TierTally:
    tests: int = 0
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0  # setup + call + teardown of its tests


# Under pytest-xdist (tests/run_tiers.py runs the tiers with `--dist loadgroup`) every module is a group of its own
# (its module-scoped fixtures are built once), except the modules that start daemons, Ray clusters or peer
# processes: they form ONE group, so at most one of them runs at a time. Measured on 2 cores: four workers running
# such modules side by side drove the load past 40 and failed timing-bound tests; one of them beside in-process
# tests does not.
PROCESS_GROUP = "processes"
PROCESS_MODULES = (
    "integration/operate/",  # one `swarm up` and `swarm api` for every module (operate/conftest.py)
    "integration/cluster/test_local_multinode.py",
    "integration/peers/test_placement_daemons.py",
    "integration/peers/test_swarm_daemons.py",
    "integration/peers/test_in_process_stage.py",
    "integration/peers/test_peer_footprint.py",
    "integration/peers/test_quantized_swarm.py",
    "integration/peers/test_peer_rpc.py",
    "integration/security/test_private_cli.py",
    "integration/test_registry.py",
    "integration/test_cli.py",
    "integration/training/test_addresses.py",
    "integration/training/test_ray_client.py",
)
# Started first within their tier, so that no worker is left with a long one at the end.
LONGEST_FIRST = (
    "integration/training/test_training_swarm.py",
    "chaos/test_failover.py",
    *PROCESS_MODULES,
    "integration/peers/test_finetune_churn.py",
    "integration/security/test_fuzz.py",
)


def xdist_group_of(path: Path) -> str:
    """The pytest-xdist group of the test module at `path`: PROCESS_GROUP, or the module itself."""
    relative = path.resolve().relative_to(TESTS_ROOT).as_posix()
    return PROCESS_GROUP if relative.startswith(PROCESS_MODULES) else relative


def _start_rank(path: Path) -> int:
    relative = path.resolve().relative_to(TESTS_ROOT).as_posix()
    return next((rank for rank, prefix in enumerate(LONGEST_FIRST) if relative.startswith(prefix)), len(LONGEST_FIRST))


def _tier(item: pytest.Item) -> str:
    return next(tier for tier in TIERS if item.get_closest_marker(tier) is not None)


class Tiers:
    """Marks and orders the collected tests by tier, and reports each tier's counts and time."""

    def __init__(self) -> None:
        self.tallies: dict[str, TierTally] = defaultdict(TierTally)

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        for item in items:
            marked = [tier for tier in TIERS if item.get_closest_marker(tier) is not None]
            tier = marked[0] if marked else tier_of(Path(str(item.path)))
            if not marked:
                item.add_marker(getattr(pytest.mark, tier))
            if item.get_closest_marker("xdist_group") is None:
                item.add_marker(pytest.mark.xdist_group(xdist_group_of(Path(str(item.path)))))
        # Cheap tiers first: a broken unit test is reported in minutes; within a tier, the longest groups first, so
        # that parallel workers do not end waiting on one. sort() is stable, so a module's tests stay together and
        # its module-scoped fixtures are built once.
        items.sort(key=lambda item: (TIERS.index(_tier(item)), _start_rank(Path(str(item.path)))))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
        if _tier(item) != "unit":
            return (yield)
        with _no_processes_or_network(item.nodeid):
            return (yield)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # By keyword, not by item: under pytest-xdist this runs in the controller, which collected nothing. A test's
        # directory is a keyword too (a system test in tests/integration/ has both): its marker is the later tier.
        tier = next((tier for tier in reversed(TIERS) if tier in report.keywords), None)
        if tier is None:
            return
        tally = self.tallies[tier]
        tally.seconds += report.duration
        if report.when == "setup":
            tally.tests += 1
            if report.skipped:
                tally.skipped += 1
            elif report.failed:
                tally.failed += 1
        elif report.when == "call":
            if report.passed:
                tally.passed += 1
            elif report.failed:
                tally.failed += 1
            elif report.skipped:
                tally.skipped += 1
        elif report.when == "teardown" and report.failed:
            tally.failed += 1

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.tallies:
            return
        terminalreporter.section("tiers")
        # Summed over the tests (setup, call, teardown): above the wall time when workers run in parallel
        # (tests/run_tiers.py prints that).
        header = f"{'tier':<12} {'tests':>6} {'passed':>7} {'failed':>7} {'skipped':>8} {'test time':>10}"
        terminalreporter.write_line(header)
        for tier in TIERS:
            if tier in self.tallies:
                t = self.tallies[tier]
                terminalreporter.write_line(
                    f"{tier:<12} {t.tests:>6} {t.passed:>7} {t.failed:>7} {t.skipped:>8} {_minutes(t.seconds):>10}"
                )


class TierViolation(RuntimeError):
    """A unit test started a process or opened a network socket: move it to the integration tier."""


@contextmanager
def _no_processes_or_network(nodeid: str) -> Iterator[None]:
    """Keep the unit tier honest: starting a process or binding/connecting an internet socket fails the test."""

    def refuse(what: str) -> Any:
        def refused(*args: Any, **kwargs: Any) -> Any:
            raise TierViolation(f"{nodeid} is in the unit tier but {what}: list it in tests/tiers.py")

        return refused

    def inet_only(original: Any, what: str) -> Any:
        def guarded(sock: socket.socket, *args: Any, **kwargs: Any) -> Any:
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                raise TierViolation(f"{nodeid} is in the unit tier but {what}: list it in tests/tiers.py")
            return original(sock, *args, **kwargs)

        return guarded

    import grpc  # gRPC's servers open their sockets in C: refused where they are made

    saved = (subprocess.Popen._execute_child, socket.socket.bind, socket.socket.connect)  # type: ignore[attr-defined]
    saved_servers = (grpc.server, grpc.aio.server)
    subprocess.Popen._execute_child = refuse("starts a process")  # type: ignore[attr-defined]
    socket.socket.bind = inet_only(saved[1], "binds a network socket")  # type: ignore[method-assign]
    socket.socket.connect = inet_only(saved[2], "connects a network socket")  # type: ignore[method-assign]
    grpc.server = grpc.aio.server = refuse("starts a gRPC server")
    try:
        yield
    finally:
        subprocess.Popen._execute_child, socket.socket.bind, socket.socket.connect = saved  # type: ignore[attr-defined]
        grpc.server, grpc.aio.server = saved_servers


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{seconds % 60:04.1f}s"
