"""`python -m swarm ...` (or another module) as a child process in a session of its own, so that everything it
starts can be killed with it, its output read line by line as it comes: shared by the benchmarks that start swarm
processes (benchmarks.peer_footprint; benchmarks.wan_swarm takes ENV) and by the tests' daemons
(tests/integration/daemons.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from benchmarks.output_lines import OutputLines

REPO_ROOT = Path(__file__).resolve().parent.parent
ENV = {
    **os.environ,
    "RAY_AUTH_MODE": "disabled",  # DESIGN.md: set explicitly, or Ray writes ~/.ray/auth_token
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # keep Ray on 127.0.0.1
    "PYTHONUNBUFFERED": "1",
}


def launch(*args: str, module: str = "swarm") -> tuple[subprocess.Popen, OutputLines]:
    """`python -m module *args` run from the repository root with ENV, stderr folded into stdout, in a new session;
    returns the process and its output lines."""
    process = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=REPO_ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    return process, OutputLines(process)
