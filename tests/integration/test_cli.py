"""The commands the README and docs/ show, run as a user would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ..documented import all_commands
from .daemons import ENV, REPO_ROOT


def test_demo_generates_the_same_tokens_as_hugging_face_locally_and_through_a_swarm(smollm2_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "swarm", "demo", "--model", str(smollm2_path), "--new-tokens", "12"],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=REPO_ROOT,
        env=ENV,
        check=True,
    )
    assert "span [ 0, 10)" in result.stdout and "span [20, 30)" in result.stdout
    assert "coverage: all 30 blocks served" in result.stdout
    assert result.stdout.count("tokens equal to Hugging Face generate on the whole model: 12/12") == 2


def test_help_lists_the_commands_the_readme_and_docs_show() -> None:
    """`swarm --help` lists every command a fenced block of the README or docs/ runs (their subcommands and flags are
    checked against the parser in tests/unit/test_docs.py, without a process per command)."""
    result = subprocess.run(
        [sys.executable, "-m", "swarm", "--help"], capture_output=True, text=True, timeout=60, check=True
    )
    shown = {command.subcommand[1][0] for command in all_commands()}
    assert len(shown) >= 10, f"too few documented commands found: {sorted(shown)}"
    for command in sorted(shown | {"demo", "convert", "convert-test-model"}):
        assert command in result.stdout, f"`swarm --help` does not list {command}"


def test_convert_reports_a_missing_gguf_clearly(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "swarm", "convert", "--gguf", str(tmp_path / "x.gguf"), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "swarm convert: GGUF file" in result.stderr and "does not exist" in result.stderr
    assert "Traceback" not in result.stderr
