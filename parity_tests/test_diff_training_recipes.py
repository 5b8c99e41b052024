"""docs/training_diff.md's two loops (PyTorch, JAX + optax), run as the page writes them: fed the
reference run's initial weights and batches, each gives a trace that `rosetta diff` finds equal to
the reference's. The independent source is `rosetta train`'s own trace; the loops are the page's."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from rosetta.cli import main

ROOT = Path(__file__).parent.parent
PAGE = ROOT / "docs" / "training_diff.md"


def recipe(heading: str) -> str:
    """The first ```python block after `heading` on the page."""
    text = PAGE.read_text(encoding="utf-8")
    return re.search(r"```python\n(.*?)```", text[text.index(heading):], re.S)[1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    assert main(["train", "--task", "copy", "--preset", "tiny", "--backend", "torch", "--steps", "3",
                 "--trace", "3", "--set", "dropout=0", "--dtype", "float64", "--eval-every", "0",
                 "--checkpoint-every", "0", "--bleu-samples", "4", "--no-progress", "--out", str(out)]) == 0
    return out / "torch"


@pytest.mark.parametrize("heading", ["**Your PyTorch loop**", "**Your JAX + optax loop**"])
def test_the_pages_loop_agrees_with_the_reference(heading, reference, tmp_path, capsys):
    code = recipe(heading).replace('"runs/ref/torch"', repr(str(reference))).replace(
        '"mine"', repr(str(tmp_path / "mine")))
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "mine"), str(reference)]) == 0, capsys.readouterr().out
    assert "no difference at any of 3 steps" in capsys.readouterr().out
