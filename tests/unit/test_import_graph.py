"""The import graph of `swarm` and `peers`, read from the source (AST only, nothing imported, no process):

- no module of `swarm` outside `swarm/cli` imports `peers`, not even inside a function: the client library stands
  alone (tests/unit/test_client_stands_alone.py runs that; this names the offending line without running it);
- no import circle among the modules of either package. Module-level imports count, those under `TYPE_CHECKING`
  and in class bodies included (they are how the circles of issue 36 closed), and so does `from pkg import name`
  in a module that `pkg/__init__.py` imports; an import inside a function runs late and does not count.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("swarm", "peers")
GENERATED = "_proto"  # swarm/_proto: protoc's output, never edited


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    lazy: bool  # inside a function: runs when called, not when the module is imported


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path) -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if GENERATED not in path.relative_to(root).parts:
                found[module_name(root, path)] = path
    return found


def imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> Iterator[str]:
    """Every module name the statement may load: `from a.b import c` loads a.b, and a.b.c when that is a module."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = node.module or ""
    if node.level:  # relative: from the package holding `module` (or `module` itself, for an __init__)
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
    yield base
    yield from (f"{base}.{alias.name}" for alias in node.names)


def edges_of(module: str, path: Path, known: dict[str, Path]) -> list[Edge]:
    edges: list[Edge] = []
    is_package = path.name == "__init__.py"

    def visit(nodes: list[ast.stmt], lazy: bool) -> None:
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in imported_names(node, module, is_package):
                    if name in known and name != module:
                        edges.append(Edge(module, name, node.lineno, lazy))
            inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    visit([child], inner)
                elif isinstance(child, ast.excepthandler):
                    visit(child.body, inner)

    visit(ast.parse(path.read_text(), str(path)).body, lazy=False)
    return edges


def import_graph(root: Path) -> list[Edge]:
    known = modules(root)
    return [edge for name, path in known.items() for edge in edges_of(name, path, known)]


def circles(edges: list[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.source, set()).add(edge.target)
        graph.setdefault(edge.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = stack[stack.index(node) :]
                    del stack[stack.index(node) :]
                    if len(component) > 1:
                        found.append(sorted(component))
            elif target not in index:
                index[target] = low[target] = len(index)
                stack.append(target)
                work.append((target, iter(sorted(graph[target]))))
            elif target in stack:
                low[node] = min(low[node], index[target])
    return found


def describe(circle: list[str], edges: list[Edge]) -> str:
    inside = [e for e in edges if e.source in circle and e.target in circle]
    return "; ".join(f"{e.source}:{e.line} -> {e.target}" for e in inside)


def test_no_swarm_module_outside_the_cli_imports_peers() -> None:
    offending = [
        f"{edge.source}:{edge.line} imports {edge.target}"
        for edge in import_graph(REPO_ROOT)
        if edge.source.split(".")[:2] != ["swarm", "cli"]
        and edge.source.startswith("swarm")
        and edge.target.startswith("peers")
    ]
    assert not offending, "the client library must stand alone; move these to peers or swarm/cli:\n" + "\n".join(
        offending
    )


def test_no_import_circle_in_swarm_or_peers() -> None:
    edges = [edge for edge in import_graph(REPO_ROOT) if not edge.lazy]
    found = circles(edges)
    assert not found, "import circles (break each by moving the shared name):\n" + "\n".join(
        describe(circle, edges) for circle in found
    )


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_graph_sees_the_circles_that_hide(tmp_path: Path) -> None:
    """The checker itself: TYPE_CHECKING imports and `from package import name` close circles; a function's import
    does not, but it still counts as `swarm` importing `peers`."""
    write(
        tmp_path,
        {
            "swarm/__init__.py": "",
            "swarm/registry/__init__.py": "from swarm.registry.dht import Registry\n",
            "swarm/registry/dht.py": "from swarm.registry import reachability\n",
            "swarm/registry/reachability.py": "",
            "swarm/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from swarm.b import B\n",
            "swarm/b.py": "from . import a\n",
            "swarm/c.py": "def f():\n    from swarm import d\n    import peers.x\n",
            "swarm/d.py": "import swarm.c\n",
            "peers/__init__.py": "",
            "peers/x.py": "",
        },
    )
    edges = import_graph(tmp_path)
    eager = [edge for edge in edges if not edge.lazy]
    assert circles(eager) == [["swarm.a", "swarm.b"], ["swarm.registry", "swarm.registry.dht"]]
    assert [(e.source, e.target, e.lazy) for e in edges if e.target.startswith("peers")] == [
        ("swarm.c", "peers.x", True)
    ]
