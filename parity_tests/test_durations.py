"""parity_tests/durations.py, the --durations-file plugin `make test` writes its costs with (issue 56):
a test that spins the CPU and one that sleeps, run under two xdist workers as `make test` runs, are
told apart by their CPU seconds (the process's own clock, time.process_time, and time.sleep are the
independent sources), and the module totals are the tests' sums."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parity_tests.durations import table

ROOT = Path(__file__).resolve().parents[1]

CASES = '''
import time

def test_spins():
    start = time.process_time()
    while time.process_time() - start < 0.4:
        pass

def test_sleeps():
    time.sleep(0.4)
'''


def test_cpu_and_wall_seconds_per_test_and_module_under_xdist(tmp_path):
    (tmp_path / "test_cases.py").write_text(CASES)
    out = tmp_path / "durations.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                          "parity_tests.durations", "-n", "2", f"--durations-file={out}", "test_cases.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    payload = json.loads(out.read_text())
    spins, sleeps = (payload["tests"][f"test_cases.py::{name}"] for name in ("test_spins", "test_sleeps"))
    assert spins["cpu"] >= 0.35 and spins["wall"] >= 0.35  # 0.4 s of its own CPU clock, rounded to 0.01
    assert sleeps["wall"] >= 0.35 and sleeps["cpu"] < 0.2  # asleep: wall time without CPU time
    module = payload["modules"]["test_cases.py"]
    assert module["tests"] == 2
    assert abs(module["cpu"] - spins["cpu"] - sleeps["cpu"]) <= 0.02
    # the costliest first
    assert list(payload["tests"]) == ["test_cases.py::test_spins", "test_cases.py::test_sleeps"]
    assert "| test_cases | 2 |" in table(payload)


def test_without_the_option_nothing_is_written(tmp_path):
    (tmp_path / "test_cases.py").write_text("def test_one():\n    pass\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                          "parity_tests.durations", "test_cases.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert not list(tmp_path.rglob("*.json"))


@pytest.mark.parametrize("where, message", [
    (lambda tmp: tmp, "it is a directory"),
    (lambda tmp: tmp / "test_cases.py" / "out.json", "is a file, not a directory"),
])
def test_an_unwritable_durations_file_is_refused_before_any_test(tmp_path, where, message):
    """A directory, or a path under a file: one line from pytest before any test runs (no traceback
    at the session's end after the whole suite)."""
    (tmp_path / "test_cases.py").write_text("def test_one():\n    raise AssertionError('ran')\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                          "parity_tests.durations", f"--durations-file={where(tmp_path)}", "test_cases.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 4, run.stdout + run.stderr  # pytest's usage error
    assert message in run.stderr and "Traceback" not in run.stderr and "ran" not in run.stdout


@pytest.mark.parametrize("content", ["", "{", "[1, 2]", '{"total": {}}',
                                     '{"total": {"tests": 1, "cpu": 1, "wall": 1}, "modules": {"m": 3}}'])
def test_the_table_refuses_a_file_that_is_not_a_durations_file_in_one_line(tmp_path, content, capsys):
    from parity_tests.durations import main

    path = tmp_path / "d.json"
    path.write_text(content)
    with pytest.raises(SystemExit) as exit_:
        main([str(path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert str(path) in err[-1] and "Traceback" not in "\n".join(err)
