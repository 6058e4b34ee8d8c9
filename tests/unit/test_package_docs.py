"""Every package's docstring maps its modules (STYLE.md 9): a reader finds the file that holds a concept from the
package's opening lines, and a new module without its line there fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGES = sorted(
    init.parent
    for package in ("swarm", "peers")
    for init in (REPO_ROOT / package).rglob("__init__.py")
    if "_proto" not in init.parts
)


def members(package: Path) -> list[str]:
    """The package's modules and subpackages, by the name a docstring uses for them."""
    modules = [path.stem for path in package.glob("*.py") if path.name not in ("__init__.py", "__main__.py")]
    subpackages = [child.name for child in package.iterdir() if (child / "__init__.py").exists()]
    return sorted(modules + subpackages)


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_the_package_docstring_names_every_module(package: Path) -> None:
    docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    missing = [name for name in members(package) if name not in docstring]
    assert not missing, f"{package.relative_to(REPO_ROOT)}/__init__.py's docstring does not name {missing}"
