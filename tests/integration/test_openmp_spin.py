"""Importing RaySwarm sets a short OpenMP spin-wait in the process's environment before it imports torch, whose libgomp
reads it once, at load (swarm/_openmp_spin.py); an operator's own GOMP_SPINCOUNT or OMP_WAIT_POLICY is left alone.
Each case is a fresh interpreter that imports swarm as a user's program would. That `swarm peer join` hands it to
its stage actor is checked with the peer's other processes (peers/test_peer_footprint.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from swarm._openmp_spin import SPIN_COUNT

SCRIPT = "import os, swarm; print(os.environ.get('GOMP_SPINCOUNT'))"


def spin_count_seen(**settings: str) -> str:
    """GOMP_SPINCOUNT as a fresh `import swarm` leaves it, in an environment without this test process's own."""
    unset = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
    env = {name: value for name, value in os.environ.items() if name not in unset} | settings
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.timeout(120)
def test_importing_swarm_bounds_the_spin_and_leaves_an_operators_setting_alone() -> None:
    assert spin_count_seen() == SPIN_COUNT
    assert spin_count_seen(GOMP_SPINCOUNT="7") == "7"
    assert spin_count_seen(OMP_WAIT_POLICY="PASSIVE") == "None"  # the policy sets its own spin
