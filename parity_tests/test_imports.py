"""No import cycle in rosetta/: the package reads in one direction (contract, then harness,
interop and diff, then the CLI), so a newcomer follows an import without coming back to where
they started. Every import statement counts, those inside functions and under TYPE_CHECKING
too: a lazy import that closes a cycle is still a cycle, only hidden until it runs.

The graph is read from the source with `ast` (nothing is imported), from modules of rosetta/ to
modules of rosetta/; the backends (numpy_ref, torch_impl, jax_impl) are outside it by design:
rosetta.backends names them by string and they import the contract.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path, base: Path) -> str:
    """rosetta/harness/loop.py -> rosetta.harness.loop, relative to the folder `base` holding the package."""
    parts = path.relative_to(base).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, base: Path, modules: set[str]) -> set[str]:
    """The modules of `modules` that `path` imports (`from a import b` counts a.b when b is a module)."""
    name = module_name(path, base)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up `level` packages from this one
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return (found & modules) - {name}


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, for every module of the folder `package`."""
    paths = {module_name(p, package.parent): p for p in sorted(package.rglob("*.py"))}
    return {name: imported(path, package.parent, set(paths)) for name, path in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected component of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_rosetta_has_no_import_cycle():
    graph = import_graph(ROOT / "rosetta")
    assert "rosetta.harness.loop" in graph and graph["rosetta.cli"]  # the walk found the package
    assert cycles(graph) == []


def test_the_walk_sees_a_cycle_through_a_lazy_import(tmp_path):
    """The check can fail: two modules that import each other, one only inside a function."""
    package = tmp_path / "rosetta"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from rosetta import b\n")
    (package / "b.py").write_text("def f():\n    from rosetta.a import g\n")
    (package / "c.py").write_text("from .a import b\n")  # relative, no cycle
    assert cycles(import_graph(package)) == [["rosetta.a", "rosetta.b"]]
