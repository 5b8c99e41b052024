"""Smoke tests of every `rosetta` subcommand, and its error path."""

from __future__ import annotations

import subprocess
import sys

from rosetta import load_checkpoint, preset
from rosetta.cli import main


def test_parity_report_lists_each_backend_against_the_reference(capsys):
    assert main(["parity", "--preset", "tiny", "--backends", "numpy"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| numpy | float32"))
    rel_error = float(row.split("|")[3])
    assert 0 < rel_error < 1e-6  # float32 rounding alone: nonzero, tiny


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
    assert "not a readable safetensors file" in capsys.readouterr().err
    assert main(["parity", "--backends", "tensorflow"]) == 2
    assert "unknown backend 'tensorflow'" in capsys.readouterr().err


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "rosetta.cli", "config", "--preset", "base"],
                         capture_output=True, text=True, check=True)
    assert '"d_model": 512' in out.stdout and "63,082,496 parameters" in out.stderr
