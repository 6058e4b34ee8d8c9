"""Run a command or a script as a user would, and watch what a user would notice: the exit status, stderr, how long
the process lingers after its last word, and whether anything it started outlives it.

Every process started here carries a tag in its environment (children inherit it) and leads its own session, so
survivors are found by either mark in /proc, whoever their parent is now.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from .daemons import ENV, REPO_ROOT

TAG_VARIABLE = "RAYSWARM_TEST_USER_TAG"


@dataclass
class UserRun:
    returncode: int
    stdout: str
    stderr: str
    exit_lag_s: float  # from the last line the process wrote (or the signal it got) to its exit
    signal_lag_s: float | None  # from the last signal it got to its exit
    survivors: list[str] = field(default_factory=list)  # "pid name" of processes it left behind


class UserProcess:
    """One `python -m swarm ...` or `python -c SCRIPT` with its output timestamped line by line."""

    def __init__(self, args: list[str], cwd: Path = REPO_ROOT) -> None:
        self.tag = uuid.uuid4().hex
        self.process = subprocess.Popen(
            [sys.executable, *args],
            cwd=cwd,
            # faulthandler on: a command that hangs prints every thread's stack on SIGABRT (finish, `_stacks`)
            env={**ENV, TAG_VARIABLE: self.tag, "PYTHONFAULTHANDLER": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.last_output = time.monotonic()
        self.signalled: float | None = None
        self._out: list[str] = []
        self._err: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(self.process.stdout, self._out), daemon=True),
            threading.Thread(target=self._read, args=(self.process.stderr, self._err), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, stream, lines: list[str]) -> None:
        for line in stream:
            self.last_output = time.monotonic()
            lines.append(line)

    def wait_for_output(self, text: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in "".join(self._out) + "".join(self._err):
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise AssertionError(f"{text!r} never came; stderr:\n{''.join(self._err)[-3000:]}")
            time.sleep(0.05)

    def wait_for_process(self, name: str, timeout_s: float) -> None:
        """Until a process of this run is named `name` (e.g. ray::StagePeer, once Ray runs the stage actor)."""
        deadline = time.monotonic() + timeout_s
        while not any(f" {name}" in survivor for survivor in self.survivors()):
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise AssertionError(f"no process {name!r}; stderr:\n{''.join(self._err)[-3000:]}")
            time.sleep(0.2)

    def interrupt(self) -> None:
        """Ctrl-C: SIGINT to the process group, as a terminal sends it."""
        self.last_output = self.signalled = time.monotonic()
        os.killpg(self.process.pid, signal.SIGINT)

    def kill(self) -> None:
        """SIGKILL to the command alone (the OOM killer's way), not to what it started."""
        self.last_output = self.signalled = time.monotonic()
        self.process.kill()

    def finish(self, timeout_s: float, children_grace_s: float = 5.0) -> UserRun:
        """Wait for the exit, then up to `children_grace_s` for whatever it started to go too; kill what is left
        (so that a failing test leaves nothing behind either) and report it."""
        try:
            returncode = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            stderr, stacks = "".join(self._err)[-3000:], self._stacks()
            self._kill_all()
            raise AssertionError(
                f"still running after {timeout_s} s; stderr:\n{stderr}\nits threads:\n{stacks}"
            ) from None
        exited = time.monotonic()
        for reader in self._readers:
            reader.join(5)
        deadline = exited + children_grace_s
        while (survivors := self.survivors()) and time.monotonic() < deadline:
            time.sleep(0.1)
        self._kill_all()
        lag = exited - min(self.last_output, exited)
        signal_lag = None if self.signalled is None else exited - self.signalled
        return UserRun(returncode, "".join(self._out), "".join(self._err), lag, signal_lag, survivors)

    def _stacks(self) -> str:
        """Every thread's stack of the hung command: SIGABRT makes its faulthandler print them, then it dies."""
        printed_before = len(self._err)
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGABRT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)
        for reader in self._readers:
            reader.join(2)
        dump = "".join(line for line in self._err[printed_before:] if not line.startswith("Extension modules:"))
        return dump[-20000:]  # every thread: the one that hangs is rarely the main one

    def survivors(self) -> list[str]:
        """Live or defunct processes of this run: in its session, or carrying its tag."""
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == self.process.pid:
                continue
            try:
                stat = (proc / "stat").read_text()
                name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
                in_session = int(rest[3]) == self.process.pid  # fields after the name: state ppid pgrp session
                tagged = self.tag.encode() in (proc / "environ").read_bytes()
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile, or not ours to read
            if in_session or tagged:
                found.append(f"{proc.name} {name} ({rest[0]})")
        return found

    def _kill_all(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        for survivor in self.survivors():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(survivor.split()[0]), signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)


def run_cli(*args: str, timeout_s: float = 120) -> UserRun:
    return UserProcess(["-m", "swarm", *args]).finish(timeout_s)


def run_script(script: str, timeout_s: float = 180) -> UserRun:
    return UserProcess(["-c", script]).finish(timeout_s)
