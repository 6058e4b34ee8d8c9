"""Run `swarm` commands as real processes: read their output as it comes, signal them, and always clean up."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.swarm_process import ENV, REPO_ROOT, launch

__all__ = ["ENV", "REPO_ROOT", "Daemon", "poll_until"]  # ENV and REPO_ROOT too, for the tests that start commands


def poll_until(condition: Callable[[], Any], timeout_s: float, failure: Callable[[], str]) -> Any:
    """The first truthy result of `condition`, polled every 0.5 s; AssertionError with `failure()` on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(0.5)
    raise AssertionError(f"not within {timeout_s} s: {failure()}")


class Daemon:
    """A `python -m swarm ...` process (or another `module`) in its own session, so that everything it starts can be
    killed with it."""

    def __init__(self, *args: str, module: str = "swarm") -> None:
        self.process, self.out = launch(*args, module=module)

    @property
    def output(self) -> list[str]:
        return self.out.output

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        match = self.out.wait_for(pattern, timeout_s)
        if match is None:
            raise AssertionError(f"no line matching {pattern!r}; output so far:\n{self.out.tail(4000)}")
        return match

    def terminate(self, timeout_s: float) -> int:
        """SIGTERM the command itself (as a preemption notice would) and wait for its exit code."""
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            tail = self.out.tail(4000)
            raise AssertionError(f"no exit within {timeout_s} s of SIGTERM; output so far:\n{tail}") from None
        finally:
            self.kill()

    def kill(self) -> None:
        """SIGKILL the whole process group (Ray and DHT children included)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)


def join_peer(model: Path, initial_peers: str, ray_address: str, *flags: str) -> Daemon:
    """`swarm peer join --open` of `model` into a running swarm's DHT and Ray cluster, with `flags`."""
    where = ("--initial-peers", initial_peers, "--ray-address", ray_address)
    return Daemon("peer", "join", "--open", "--model", str(model), *where, *flags)
