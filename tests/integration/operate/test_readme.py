"""The README's Quick start, run as written: its `swarm up` line started the tier's shared swarm
(tests/integration/conftest.py); the lines after it run here in order, with ADDR replaced by the address that
`swarm up` printed."""

from __future__ import annotations

import subprocess
import sys

from ..daemons import ENV, REPO_ROOT
from ..shared_swarm import RunningSwarm, quick_start_commands


def test_the_quick_start_runs_as_written(running_swarm: RunningSwarm) -> None:
    commands = quick_start_commands()[1:]
    assert [args[0] for args in commands] == ["status", "generate"], commands
    outputs = []
    for args in commands:
        args = [running_swarm.initial_peers if arg == "ADDR" else arg for arg in args]
        result = subprocess.run(
            [sys.executable, "-m", "swarm", *args], capture_output=True, text=True, timeout=180, cwd=REPO_ROOT, env=ENV
        )
        assert result.returncode == 0, f"swarm {' '.join(args)}:\n{result.stderr[-3000:]}"
        outputs.append(result.stdout)
    status, generated = outputs
    assert "coverage: all 30 blocks served" in status
    assert len(generated.strip()) > 20, generated  # the test model's reply (a chat template: the prompt is not echoed)
