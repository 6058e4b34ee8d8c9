"""Size budgets from STYLE.md: modules <= 400 lines, functions <= 60 lines, every module opens with a docstring."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(
    path
    for package in ("swarm", "peers", "benchmarks", "cluster")
    for path in (REPO_ROOT / package).rglob("*.py")
    if "_proto" not in path.parts
)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_module_budget(path: Path) -> None:
    text = path.read_text()
    assert len(text.splitlines()) <= 400, f"{path} is over 400 lines: split it by concept"
    tree = ast.parse(text)
    if text.strip():
        assert ast.get_docstring(tree), f"{path} has no module docstring"
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = node.end_lineno - node.lineno + 1
            assert length <= 60, f"{path}:{node.lineno} {node.name} is {length} lines (budget 60)"
