"""A local Ray's processes die with the process that started it, however that process ends. Used by connect_ray.

Ray ties its head processes (gcs_server, raylet) to the driver with PR_SET_PDEATHSIG, but not what the raylet starts:
when the driver is SIGKILLed, its dashboard and runtime-env agents notice within a second that the raylet is gone,
then report it to the GCS, which is dead too, and wait out that call's 60 s timeout (ray/_private/process_watcher.py;
measured: gone 62 s after the driver). So the driver starts this reaper before Ray, in a session of its own (the
terminal's Ctrl-C is not for it), and puts a tag in the environment Ray's processes inherit. While the driver lives,
the reaper keeps a list of them: the driver's descendants that carry the tag, and everything below those (the agents
and workers overwrite their environment with a process title, so theirs cannot be read). Once the driver is gone,
the reaper kills them, and any process that holds a file of the Ray session the driver started: an agent the raylet
started after the reaper's last look is on no list, and by then the raylet is dead and the agent an orphan (seen on a
loaded machine: the dashboard and runtime-env agents outlived a SIGKILLed `swarm up`). Ray names a session's
directory after the process that started it (`session_<date>_<time>_<pid>`), and its agents keep their logs open
there.

Run as a file, `python ray_reaper.py PARENT_PID TAG`: standard library only, so it starts in milliseconds.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict

TAG_VARIABLE = "RAYSWARM_RAY_OWNER"
WATCH_PERIOD_S = 0.25  # how often the parent is checked (a system call)
LOOKS_EVERY = 4  # checks between two looks at the process table (a look costs milliseconds: once a second)
KILL_ROUNDS = 10  # processes may still start while the first ones die; WATCH_PERIOD_S apart

_reapers: list[subprocess.Popen] = []  # they outlive this process on purpose; held so that none is reported as leaked


def start_reaper() -> str:
    """Start a reaper for this process; returns the tag to put in the environment of what it must reap."""
    tag = uuid.uuid4().hex
    reaper = subprocess.Popen(
        [sys.executable, "-I", "-S", __file__, str(os.getpid()), tag],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    _reapers.append(reaper)
    return tag


def process_table() -> dict[int, tuple[int, int, bytes]]:
    """pid -> (parent pid, start time in clock ticks, state), read from /proc (about 4 ms for 100 processes)."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as file:
                stat = file.read()
        except OSError:  # gone meanwhile
            continue
        with contextlib.suppress(ValueError, IndexError):
            fields = stat[stat.rindex(b")") + 2 :].split()  # after the name: state, ppid, ..., starttime (20th)
            table[int(name)] = (int(fields[1]), int(fields[19]), fields[0])
    return table


def carries(pid: int, tag: str) -> bool:
    """Whether the process's environment, as it was started, holds the tag."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as file:
            return f"{TAG_VARIABLE}={tag}".encode() in file.read().split(b"\0")
    except OSError:  # gone meanwhile, or not ours to read
        return False


def tagged_below(root: int, tag: str, table: dict[int, tuple[int, int, bytes]]) -> dict[int, int]:
    """The processes below `root` that carry `tag`, and everything below those: pid -> start time."""
    children = defaultdict(list)
    for pid, (ppid, _, _) in table.items():
        children[ppid].append(pid)
    found, stack = {}, [(child, False) for child in children[root]]
    while stack:
        pid, inside = stack.pop()
        if inside or carries(pid, tag):
            found[pid] = table[pid][1]
            inside = True
        stack.extend((child, inside) for child in children[pid])
    return found


def holds_session_of(pid: int, driver: int) -> bool:
    """Whether the process is one of Ray's (titled `ray::...`) and holds a file of a Ray session that process
    `driver` started (the session directory's name ends in the driver's pid); a user's `tail -f` of its log is not."""
    session = re.compile(rf"/session_[^/]*_{driver}/")
    try:
        with open(f"/proc/{pid}/comm", "rb") as comm:
            if not comm.read().startswith(b"ray::"):
                return False
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # gone meanwhile, or not ours to read
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if session.search(os.readlink(f"/proc/{pid}/fd/{fd}")):
                return True
    return False


def reap(parent: int, tag: str) -> None:
    """Until `parent` is gone (this process is handed to another parent), keep the list of what to kill; then kill
    what is on it and still the same process (same start time), and any process started since `parent` that carries
    `tag` or holds a file of its Ray session."""
    known: dict[int, int] = {}
    parent_started = process_table().get(parent, (0, 0, b""))[1]
    for check in itertools.count():
        if os.getppid() != parent:
            break
        if check % LOOKS_EVERY == 0:
            known = tagged_below(parent, tag, process_table())
        time.sleep(WATCH_PERIOD_S)
    for _ in range(KILL_ROUNDS):
        table = process_table()
        live = [pid for pid, (_, _, state) in table.items() if state != b"Z" and pid != os.getpid()]
        unlisted = [pid for pid in live if pid not in known and table[pid][1] >= parent_started]
        doomed = [pid for pid in live if known.get(pid) == table[pid][1]]
        doomed += [pid for pid in unlisted if carries(pid, tag) or holds_session_of(pid, parent)]
        if not doomed:
            return
        for pid in doomed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(WATCH_PERIOD_S)


if __name__ == "__main__":
    reap(int(sys.argv[1]), sys.argv[2])
