"""The deadline of an idle boot (boot_priority.py), run as a process of its own at normal priority.

A timer thread inside the booting process cannot enforce it: to act, that thread needs the GIL, and the GIL is held
by the booting thread, which runs under SCHED_IDLE and so hardly runs at all on a busy host; the deadline then
waited for the boot itself (a priority inversion, 7.2 s against a deadline of 3 s). This process needs nothing of
the booting one: at the deadline it puts every idle thread of the booting process's tree back under the normal
policy, prints when it did, and exits. It exits without acting when a line or the end comes on its stdin: the boot
ended first, or the booting process died.

It runs as a script (`python -I -S idle_deadline.py PID DEADLINE`, DEADLINE on the system's monotonic clock) and
imports nothing beyond the standard library, so it starts in milliseconds; boot_priority.py imports
`restore_normal_policy` from it for the boot's own end.
"""

from __future__ import annotations

import os
import select
import sys
import time


def restore_normal_policy(root: int) -> None:
    """Every SCHED_IDLE thread of process `root` and of its descendants back under SCHED_OTHER; their nice values
    never changed. Threads and processes that exit meanwhile are skipped."""
    for pid in process_tree(root):
        for thread_id in _threads(pid):
            try:
                if os.sched_getscheduler(thread_id) == os.SCHED_IDLE:
                    os.sched_setscheduler(thread_id, os.SCHED_OTHER, os.sched_param(0))
            except OSError:  # exited meanwhile
                continue


def process_tree(root: int) -> list[int]:
    """`root` and all its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (parent := _parent_of(int(entry))) is not None:
            children.setdefault(parent, []).append(int(entry))
    tree, frontier = [root], [root]
    while frontier:
        frontier = [child for pid in frontier for child in children.get(pid, [])]
        tree += frontier
    return tree


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()  # the command's name may hold spaces and parentheses
        return int(fields[1])
    except (OSError, IndexError, ValueError):  # exited meanwhile
        return None


def _threads(pid: int) -> list[int]:
    try:
        return [int(thread) for thread in os.listdir(f"/proc/{pid}/task")]
    except OSError:  # exited meanwhile
        return []


def main(argv: list[str]) -> int:
    root, deadline = int(argv[1]), float(argv[2])
    ended, _, _ = select.select([sys.stdin], [], [], max(0.0, deadline - time.monotonic()))
    if ended:  # the boot ended (or its process died) before the deadline
        return 0
    restore_normal_policy(root)
    print(time.monotonic(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
