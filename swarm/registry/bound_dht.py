"""A hivemind DHT whose process, and the p2pd daemon it starts, die with the process that made them.

hivemind forks its DHT into a child process, which in turn starts p2pd. When the parent exits in an orderly way it
shuts them down; when it is SIGKILLed (or calls os._exit) nothing does, and both run on for good (measured: still
there 10 minutes later), holding ports and a connection to the swarm. A watchdog thread in the child notices that
its parent is gone (its parent pid changes), kills the child's own children (p2pd) and exits. The kernel's
PR_SET_PDEATHSIG cannot do this alone: it would kill the child before the child could stop p2pd, and it fires when
the *thread* that forked dies, which for a client in a worker thread is too early.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading
import time
from pathlib import Path

import hivemind

WATCH_PERIOD_S = 0.25


class ParentBoundDHT(hivemind.DHT):
    def start(self) -> None:
        """Fork with the parent's objects frozen (gc.freeze): the child's garbage collector then never walks them,
        which would write to every page holding a Python object and so copy the parent's whole heap into the child
        (measured on a peer: the DHT process held 128 MiB of its own; see benchmarks/peer_footprint.py)."""
        gc.freeze()
        try:
            super().start()
        finally:
            gc.unfreeze()

    def run(self) -> None:
        """In the child: leave the terminal's process group (Ctrl-C is for the parent, which then shuts this node
        down in order, rather than for p2pd, which would die mid-connection and log errors), watch the parent, then
        serve as hivemind does. The signal handlers a command set before the fork are not this process's: SIGINT is
        ignored, and a SIGTERM (multiprocessing's exit when the parent stops while starting) ends it with p2pd."""
        os.setpgid(0, 0)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, lambda signum, frame: _exit_with_children())
        parent = os.getppid()
        threading.Thread(target=_exit_with_parent, args=(parent,), name="dht-parent-watch", daemon=True).start()
        super().run()


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_PERIOD_S)
    _exit_with_children()


def _exit_with_children() -> None:
    for child in own_children():
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    os._exit(0)


def own_children() -> list[int]:
    """Pids of this process's children (p2pd, helpers), read from /proc."""
    me, children = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        fields = stat[stat.rindex(")") + 2 :].split()  # after the name: state, ppid, ...
        if int(fields[1]) == me:
            children.append(int(entry.name))
    return children
