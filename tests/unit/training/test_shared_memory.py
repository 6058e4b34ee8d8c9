"""swarm/training/shared_memory.py unlinks the torch segments a dead process left since a snapshot, and nothing
else: not those of live processes, not those mapped by one, not those that existed before."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import uuid

import pytest

from swarm.training import shared_memory

pytestmark = pytest.mark.skipif(not shared_memory.SHM_DIR.is_dir(), reason="no /dev/shm on this system")


def _segment(pid: int) -> str:
    name = f"torch_{pid}_{uuid.uuid4().int % 10**9}_0"
    (shared_memory.SHM_DIR / name).write_bytes(b"x")
    return name


def test_only_new_segments_of_dead_creators_are_removed() -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    old = _segment(dead_pid)
    before = shared_memory.snapshot()
    orphaned, alive, mapped = _segment(dead_pid), _segment(os.getpid()), _segment(dead_pid)
    with open(shared_memory.SHM_DIR / mapped, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ):
        try:
            assert shared_memory.remove_orphaned(before, min_age_s=0.0) >= 1
            names = set(os.listdir(shared_memory.SHM_DIR))
            assert orphaned not in names
            assert alive in names and old in names and mapped in names
        finally:
            for name in (old, orphaned, alive, mapped):
                (shared_memory.SHM_DIR / name).unlink(missing_ok=True)
