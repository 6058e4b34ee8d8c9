"""Shared-memory segments that killed training processes leave behind.

hivemind shares tensors between a replica and its helper processes with torch's "file_system" strategy: each is a
file /dev/shm/torch_<creator pid>_<...>, unlinked by torch's shared-memory manager once its last user lets it go. A
SIGKILLed replica (preemption, churn, `ray.kill` at a job's end) never lets go, and its segments stay in RAM until
the machine reboots: measured on the test machine, 65,000 segments and 12.8 GB after a day of test runs, until
Ray's memory monitor killed stage actors of the next run. `remove_orphaned` unlinks the segments created since a
snapshot that are orphans for certain: their creator is dead, no live process maps them, and they are older than
ORPHAN_AGE_S (the manager unlinks a released segment at once; one still there that long after is leaked).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIX = "torch_"
ORPHAN_AGE_S = 30.0
_MAPPED = re.compile(r"/dev/shm/(torch_\S+)")


def snapshot() -> set[str]:
    """The torch segments that exist now (leave these alone: they belong to somebody else)."""
    try:
        return {name for name in os.listdir(SHM_DIR) if name.startswith(PREFIX)}
    except OSError:  # no /dev/shm on this system: nothing to clean
        return set()


def remove_orphaned(before: set[str], min_age_s: float = ORPHAN_AGE_S) -> int:
    """Unlink the torch segments created since `before` that are orphans (above); returns how many."""
    now = time.time()
    candidates = [name for name in snapshot() - before if _creator_dead(name) and _age(name, now) >= min_age_s]
    if not candidates:
        return 0
    mapped = _mapped_segments()
    removed = 0
    for name in candidates:
        if name in mapped:
            continue
        try:
            (SHM_DIR / name).unlink()
            removed += 1
        except OSError:  # unlinked meanwhile by the manager
            continue
    return removed


def _creator_dead(name: str) -> bool:
    creator = name[len(PREFIX) :].split("_", 1)[0]
    return creator.isdigit() and not Path(f"/proc/{creator}").exists()


def _age(name: str, now: float) -> float:
    try:
        return now - (SHM_DIR / name).stat().st_mtime
    except OSError:
        return 0.0


def _mapped_segments() -> set[str]:
    """Every torch segment some live process has mapped (a dead creator's segment may still be in use)."""
    mapped: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as maps:
                mapped.update(match.group(1) for line in maps if (match := _MAPPED.search(line)))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return mapped
