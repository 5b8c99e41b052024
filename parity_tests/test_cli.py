"""Smoke tests of every `rosetta` subcommand, and its error path."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from rosetta import load_checkpoint, preset
from rosetta.cli import main
from rosetta.parity import TOLERANCES


def test_parity_report_lists_each_backend_against_the_reference(capsys):
    assert main(["parity", "--preset", "tiny", "--backends", "numpy"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| numpy | float32"))
    rel_error = float(row.split("|")[3])
    # float32 rounding alone: nonzero, and within the float32 tolerance (rosetta.parity.TOLERANCES,
    # whose comment derives it; seen 2.7e-7 here). Not a tighter number: BLAS sums in a CPU's own order.
    assert 0 < rel_error <= TOLERANCES["numpy", "float32"]


def test_init_then_parity_from_the_checkpoint(tmp_path, capsys):
    path = tmp_path / "m.safetensors"
    assert main(["init", "--preset", "tiny", "--set", "norm_first=true", "--out", str(path)]) == 0
    assert load_checkpoint(path).config == preset("tiny", norm_first=True)
    assert main(["parity", "--checkpoint", str(path), "--backends", "numpy"]) == 0
    assert "| numpy | float32 |" in capsys.readouterr().out


def test_errors_are_one_clear_line_with_exit_code_2(tmp_path, capsys):
    assert main(["config", "--preset", "tiny", "--set", "d_model=30"]) == 2
    assert capsys.readouterr().err.strip() == (
        "rosetta: error: d_model (30) must be divisible by num_heads (4)")
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    assert main(["parity", "--checkpoint", str(tmp_path / "junk.safetensors")]) == 2
    err = capsys.readouterr().err  # the wording is rosetta/checkpoint.py's (changing): file named, one line
    assert err.count("\n") == 1 and "junk.safetensors: not a" in err and "safetensors file" in err
    assert main(["parity", "--backends", "tensorflow"]) == 2
    assert "unknown backend 'tensorflow'" in capsys.readouterr().err


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "rosetta.cli", "config", "--preset", "base"],
                         capture_output=True, text=True, check=True)
    assert '"d_model": 512' in out.stdout and "63,082,496 parameters" in out.stderr


# -- `rosetta parity` exit codes: what CI scripts call -------------------------------------------

def _report_row(out: str, backend: str, dtype: str) -> list[str]:
    line = next(line for line in out.splitlines() if line.startswith(f"| {backend} | {dtype} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def _perturb_numpy_float32(monkeypatch, change):
    """numpy's float32 logits passed through `change`; float64 (the reference) left alone."""
    from numpy_ref.backend import Model

    original = Model._logits

    def logits(self, src, tgt):
        out = original(self, src, tgt)
        return change(out) if self.dtype == "float32" else out

    monkeypatch.setattr(Model, "_logits", logits)


def test_parity_exits_1_and_marks_the_row_when_a_backend_is_over_its_tolerance(monkeypatch, capsys):
    # Logits 1.48 times the true ones: a relative error of 0.48 whatever the logits are.
    _perturb_numpy_float32(monkeypatch, lambda out: 1.48 * out)
    assert main(["parity", "--preset", "tiny", "--backends", "numpy"]) == 1
    captured = capsys.readouterr()
    row = _report_row(captured.out, "numpy", "float32")
    assert float(row[2]) == pytest.approx(0.48, rel=1e-4)
    assert row[4] == "yes" and row[-1] == "FAIL"  # finite, but over its tolerance
    assert "numpy float32: relative error 4.800e-01 is over its tolerance" in captured.err


def test_parity_exits_1_on_non_finite_logits(monkeypatch, capsys):
    def poison(out):
        out = out.copy()
        out[0, 0, 5] = np.nan
        return out

    _perturb_numpy_float32(monkeypatch, poison)
    assert main(["parity", "--preset", "tiny", "--backends", "numpy"]) == 1
    captured = capsys.readouterr()
    row = _report_row(captured.out, "numpy", "float32")
    assert row[4] == "NO" and row[-1] == "FAIL"
    assert "numpy float32: logits hold NaN or infinity" in captured.err


def test_parity_exits_0_when_every_installed_backend_is_within_tolerance(capsys):
    assert main(["parity", "--preset", "tiny"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert {row.split("|")[1].strip() for row in rows} == {"numpy", "torch", "jax"}
    assert all(row.rstrip(" |").endswith("yes") for row in rows), out


def test_parity_refuses_a_backend_named_twice(capsys):
    assert main(["parity", "--preset", "tiny", "--backends", "numpy", "numpy"]) == 2
    captured = capsys.readouterr()
    assert captured.err == "rosetta: error: --backends lists a backend twice: numpy numpy\n"
    assert captured.out == ""  # refused before the report: no row printed, let alone twice


@pytest.mark.parametrize("front", ["rosetta", "benchmark"])
def test_every_command_collects_pythons_garbage_at_the_projects_thresholds(front, capsys):
    """`rosetta` and every benchmark (whose main builds benchmarks.common's parser first) set Python's
    collector to rosetta/device.py's GC_THRESHOLDS, so a benchmark times the step as `rosetta train`
    runs it; started here from Python's own thresholds (the suite's workers already run at them)."""
    import gc

    from benchmarks.common import parser
    from rosetta.device import GC_THRESHOLDS

    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    try:
        if front == "rosetta":
            assert main(["config", "--preset", "tiny"]) == 0
        else:
            parser(__file__, None)
        assert gc.get_threshold() == GC_THRESHOLDS != (700, 10, 10)
    finally:
        gc.set_threshold(*saved)
