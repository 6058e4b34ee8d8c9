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
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import hivemind

logger = logging.getLogger(__name__)

WATCH_PERIOD_S = 0.25
# The DHT's child is forked from a process full of threads (gRPC, torch): in a full test run one died at once of a
# SIGABRT in an at-fork handler, and hivemind waits for a dead child's readiness for good (a CI run: 240 s, then
# killed). p2pd, the Go binary the child starts, has missed hivemind's default 15 s to start on a loaded machine.
P2PD_STARTUP_TIMEOUT_S = 45.0
READY_TIMEOUT_S = 90.0
READY_POLL_S = 0.25  # how often the wait looks whether the child still lives
START_ATTEMPTS = 3


def start_dht(**kwargs: Any) -> ParentBoundDHT:
    """A started, ready ParentBoundDHT. A child that dies before it is ready is started again at once, one that is
    not ready within READY_TIMEOUT_S is killed with its p2pd and started again (START_ATTEMPTS in all); hivemind
    itself would wait forever. Errors the child reports (a refused initial peer, a bad address) are raised at once:
    trying again would not change them."""
    kwargs.setdefault("startup_timeout", P2PD_STARTUP_TIMEOUT_S)
    p2pd_flags = kwargs.pop("p2pd_flags", {})
    for attempt in range(1, START_ATTEMPTS + 1):
        dht = ParentBoundDHT(start=False, **kwargs)
        dht.p2pd_flags = p2pd_flags
        dht.run_in_background(await_ready=False)
        try:
            if _ready(dht):
                return dht
        except BaseException:
            kill_group(dht)
            raise
        what = "died before it was ready" if not dht.is_alive() else f"was not ready in {READY_TIMEOUT_S:.0f} s"
        kill_group(dht)
        logger.warning("the DHT node's process %s (attempt %d of %d)", what, attempt, START_ATTEMPTS)
    raise TimeoutError(f"the DHT node's process did not start, {START_ATTEMPTS} times")


def _ready(dht: hivemind.DHT) -> bool:
    """Wait until the child reports ready (True), dies, or READY_TIMEOUT_S passes (False)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        try:
            dht.wait_until_ready(min(READY_POLL_S, max(deadline - time.monotonic(), 0.0)))
            return True
        except TimeoutError:
            if not dht.is_alive():
                with contextlib.suppress(TimeoutError):
                    dht.wait_until_ready(1.0)  # an error it reported on its way out arrives now, and is raised
                    return True
                return False
            if time.monotonic() >= deadline:
                return False


def kill_group(dht: hivemind.DHT) -> None:
    """SIGKILL a DHT child and its p2pd: the child leads a process group of its own (ParentBoundDHT.run)."""
    if dht.pid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(dht.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(dht.pid, signal.SIGKILL)  # before setpgid ran, the child is still in our group
        dht.join(5)


class ParentBoundDHT(hivemind.DHT):
    p2pd_flags: dict[str, Any] | None = None  # p2pd options hivemind's P2P.create has no argument for

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
        _with_p2pd_flags(self.p2pd_flags or {})
        super().run()


def _with_p2pd_flags(flags: dict[str, Any]) -> None:
    """In the child: p2pd's command lines get options that hivemind's P2P.create has no argument for: `flags` (a
    relay's `relayMaxCircuits`), and `-relayDiscovery=0` for a node given relays (`trusted_relays`), which then
    reserves a slot on them at once (with discovery on, libp2p waits for 4 candidate relays, or 3 minutes)."""
    from hivemind.p2p.p2p_daemon import P2P

    make_args = P2P._make_process_args

    def with_flags(*args: Any, **kwargs: Any) -> list[str]:
        if kwargs.get("trustedRelays"):
            kwargs["relayDiscovery"] = False
        return make_args(*args, **{**kwargs, **flags})

    P2P._make_process_args = staticmethod(with_flags)


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
