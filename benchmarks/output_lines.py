"""A child process's output, read line by line as it comes on a thread of its own and kept for failure messages:
shared by the benchmarks that start swarm processes and by the tests' daemons (tests/integration/daemons.py)."""

from __future__ import annotations

import queue
import re
import subprocess
import threading
import time


class OutputLines:
    def __init__(self, process: subprocess.Popen) -> None:
        """`process` was started with stdout=PIPE (stderr folded in, as wanted) and text=True."""
        self.process = process
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []  # every line so far
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:  # type: ignore[union-attr]
            self.output.append(line)
            self.lines.put(line)

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match | None:
        """The first line from now on matching `pattern`; None if none comes in time or the process ends first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.process.poll() is not None:
                    return None
                continue
            if match := re.search(pattern, line):
                return match
        return None

    def tail(self, chars: int) -> str:
        return "".join(self.output)[-chars:]
