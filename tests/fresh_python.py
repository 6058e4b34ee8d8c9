"""Run a script in a fresh Python interpreter from the repository root: for what only a process of its own shows
(which modules an import pulls in, the scheduling policy of its threads), and so that a failed check leaves
pytest's own process as it was."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_python(script: str, *args: str, timeout_s: float = 120.0) -> str:
    """The script's standard output; fails the test with its standard error if it exits non-zero."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def refusing(*packages: str) -> str:
    """A script's first lines: importing `packages` (or any module inside them) fails from then on, as on a machine
    without them."""
    return textwrap.dedent(
        f"""
        import importlib.abc, sys

        class Refuse(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {packages!r}:
                    raise ModuleNotFoundError(f"No module named {{name!r}} (refused by the test)", name=name)

        sys.meta_path.insert(0, Refuse())
        """
    )
