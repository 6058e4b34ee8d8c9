"""Fixtures shared by every integration module: one `swarm up --peers 2`, started on first use with the very command
the README's Quick start gives (plus a short record TTL), and kept for the whole pytest run. The operating tests (the
API, Prometheus, the monitor, a user's mistakes), the `swarm up` daemon tests and the placement tests use it; the
system tier's churn tests among them (tests/tiers.py) start their own in the system tier's run. A test that
joins peers of its own stops them, and one whose peers must not mix with the shared ones names its own model in the
registry (`--model-name`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .daemons import Daemon
from .shared_swarm import TTL, RunningSwarm, quick_start_commands


@pytest.fixture(scope="session")
def running_swarm(smollm2_path: Path) -> Iterator[RunningSwarm]:
    up = quick_start_commands()[0]
    assert up[:1] == ["up"] and "--peers" in up, f"the README's Quick start should begin with `swarm up`: {up}"
    daemon = Daemon(*up, "--ttl", str(TTL))
    try:
        peer_ids = [daemon.wait_for(r"peer (\w+) blocks", 240).group(1) for _ in range(2)]
        ray_address = daemon.wait_for(r"ray address: (\S+)", 60).group(1)
        initial_peers = daemon.wait_for(r"initial peers: (\S+)", 60).group(1)
        yield RunningSwarm(daemon, initial_peers, ray_address, peer_ids, smollm2_path)
        assert daemon.terminate(timeout_s=90) == 0
    finally:
        daemon.kill()
