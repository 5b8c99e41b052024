"""The layers hold, checked by a tool (issue 38): import-linter's contracts, declared once in
pyproject.toml ([tool.importlinter]: the contract <- the reference <- the framework backends <- the
tools <- the front doors, and no cycle inside rosetta/), pass; the `rosetta` package itself exports
the contract only; and the README's layout table names every module once, each one that exists.

`lint-imports` reads every import statement, those inside functions included (a lazy import that
breaks a layer still breaks it when it runs); imports under TYPE_CHECKING are left out, as types
only."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rosetta", "numpy_ref", "torch_impl", "jax_impl", "peer_impl", "benchmarks")


def test_import_linter_contracts_pass():
    # The venv's lint-imports, from the repository root (benchmarks/ is a package there, not installed).
    command = [str(Path(sys.executable).parent / "lint-imports"), "--no-cache"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    kept = re.findall(r"^(.+) (KEPT|BROKEN)$", done.stdout, re.M)
    assert kept and all(state == "KEPT" for _, state in kept), done.stdout[-4000:]


def test_ruff_finds_nothing():
    """`make lint` inside the suite (.ci/run runs `make test` only): a commit that ruff refuses fails
    here (c20a658 committed a test file with lines over pyproject.toml's 110)."""
    done = subprocess.run([str(Path(sys.executable).parent / "ruff"), "check", "--no-cache", "."], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_the_rosetta_package_exports_the_contract_only():
    """rosetta/__init__.py imports none of the tools built on it (a layers contract cannot say so of
    the package that contains them all): read through import-linter's own graph library."""
    import grimp

    graph = grimp.build_graph("rosetta", include_external_packages=False)
    tools = ("rosetta.harness", "rosetta.diff", "rosetta.interop", "rosetta.cli")
    imported = graph.find_modules_directly_imported_by("rosetta")
    assert imported and not [m for m in imported if m.startswith(tools)], imported


def _modules() -> set[str]:
    """Every module of the packages, as a path from the repository root (package __init__ files
    hold no code but rosetta's, the public names)."""
    found = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if path.name != "__init__.py" or path.parent == ROOT / "rosetta":
                found.add(path.relative_to(ROOT).as_posix())
    return found


def _layout_rows() -> list[str]:
    """The rows of the README's layout table."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Layout"):]
    section = section[:section.index("\n## ", 1)]
    return [line for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]


def layout_problems(modules: set[str], rows: list[str]) -> list[str]:
    """What is wrong with a layout table's `rows` for these `modules`: one line each."""
    named = Counter(path for row in rows for path in re.findall(r"\]\(([^)#]+)\)", row))
    problems = [f"not named in the README's layout table: {m}" for m in sorted(modules - set(named))]
    problems += [f"named more than once: {p}" for p, n in sorted(named.items()) if n > 1]
    problems += [f"named but not there: {p}" for p in sorted(named) if not (ROOT / p).exists()]
    problems += [f"a row without its job: {row}" for row in rows
                 if not row.rstrip(" |").split("|")[-1].strip()]
    return problems


def test_the_readme_layout_names_every_module_once():
    assert layout_problems(_modules(), _layout_rows()) == []


def test_the_layout_check_sees_a_missing_module_and_a_gone_one():
    rows = _layout_rows()
    before = set(layout_problems(_modules(), rows))
    row = "| harness | [`rosetta/gone.py`](rosetta/gone.py) | a job |"
    after = set(layout_problems(_modules() | {"rosetta/harness/unnamed.py"}, [*rows, row]))
    assert after - before == {"not named in the README's layout table: rosetta/harness/unnamed.py",
                              "named but not there: rosetta/gone.py"}
