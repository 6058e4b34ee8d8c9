"""Make hivemind's helper processes die with the process that forked them.

hivemind forks its DHT and averagers (multiprocessing 'fork'). A child inherits every open descriptor of its
parent, including a Ray worker's connection to its raylet; if the worker is then SIGKILLed, the orphaned child
keeps that connection open and Ray never notices the worker died (measured: no restart for minutes). With
PR_SET_PDEATHSIG set in each forked child, the kernel kills the child when its parent dies, the connection
closes, and Ray restarts the actor within seconds.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
_installed = False


def _kill_me_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died between fork and prctl
        os._exit(1)


def die_with_parent_on_fork() -> None:
    """Install (once per process) the at-fork hook; a no-op where prctl does not exist (not Linux)."""
    global _installed
    if _installed or not sys.platform.startswith("linux"):
        return
    os.register_at_fork(after_in_child=_kill_me_with_parent)
    _installed = True
