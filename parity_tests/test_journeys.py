"""docs/journeys.md's three journeys, run as the page writes them (issue 40): the first ```bash
block of each section, line by line (`rosetta` through its entry point, the rest through bash),
offline (Hugging Face and pip told so), the Marian
and the training-loop journeys in an empty folder, the GPU benchmarker's from the repository root;
each command exits 0 unless its comment names another status. What each prints is checked against
what the page says it prints; the expected values are the page's words and an independent peer
(the same sentence translated by two backends)."""

from __future__ import annotations

import io
import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from parity_tests.test_diff_training_recipes import recipe
from rosetta.cli import main

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "journeys.md"
MISTAKE = "no_label_smoothing"  # what the tutorial journey's sed line makes of the page's loop
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PIP_NO_INDEX": "1"}


def commands(section: str) -> list[str]:
    """The first bash block of the section whose heading starts with `section`, one command a line."""
    text = PAGE.read_text(encoding="utf-8")
    start = text.index(f"\n## {section}")
    block = re.search(r"```bash\n(.*?)```", text[start:], re.S)[1]
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


ROSETTA = re.compile(r'(?:echo "(?P<stdin>[^"]*)" \| )?rosetta (?P<args>.*)')
MODULE = re.compile(r"python (?:-m (?P<module>benchmarks\.\w+)|(?P<script>\w+\.py))(?P<args>.*)")


def run(lines: list[str], cwd: Path, monkeypatch, capsys) -> list[str]:
    """Each line in `cwd`, its exit status as its comment says (0 unless `exit status N`): a `rosetta`
    command (piped an `echo` or not) through the CLI's own entry point, and `python -m benchmarks.X`
    and `python SCRIPT.py` as `runpy` runs them, in this process, which spares each a fresh import of
    torch and JAX (test_wheel.py runs the installed script itself); any other line through bash."""
    monkeypatch.chdir(cwd)
    for name, value in OFFLINE.items():
        monkeypatch.setenv(name, value)
    outputs = []
    for line in lines:
        command, _, comment = line.partition("  #")
        expected = int(m[1]) if (m := re.search(r"exit status (\d+)", comment)) else 0
        if m := ROSETTA.fullmatch(command.strip()) or MODULE.fullmatch(command.strip()):
            capsys.readouterr()
            stdin, module, script = (m.groupdict().get(k) for k in ("stdin", "module", "script"))
            args = shlex.split(m["args"])
            monkeypatch.setattr(sys, "stdin", io.StringIO(f"{stdin}\n" if stdin else ""))
            try:
                if module or script:
                    monkeypatch.setattr(sys, "argv", [module or script, *args])
                    if module:
                        runpy.run_module(module, run_name="__main__", alter_sys=True)
                    else:
                        runpy.run_path(script, run_name="__main__")
                    code = 0
                else:
                    code = main(args)
            except SystemExit as e:
                code = e.code or 0
            out, err = capsys.readouterr()
        else:
            env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
            done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                                  timeout=300)
            code, out, err = done.returncode, done.stdout, done.stderr
        assert code == expected, f"{line}\n{out[-1500:]}\n{err[-1500:]}"
        outputs.append(out)
    return outputs


def test_the_marian_porter(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("ctranslate2")
    out = run(commands("1."), tmp_path, monkeypatch, capsys)
    jax_words, numpy_words = out[1].strip(), out[4].strip()
    assert jax_words and jax_words == numpy_words  # our JAX on the Marian directory, NumPy on its conversion
    assert "no difference at any stage" in out[2]
    assert (tmp_path / "de-en-ct2" / "model.bin").is_file()


def test_the_tutorial_porter(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_loop.py").write_text(recipe("**Your PyTorch loop**"))  # "save the recipe as my_loop.py"
    out = run(commands("2."), tmp_path, monkeypatch, capsys)
    assert "no difference at any of 3 steps" in out[2]
    assert "label_smoothing=0.0)" in (tmp_path / "my_loop.py").read_text()  # the page's sed made the mistake
    assert f"diagnosis: {MISTAKE} explains the difference" in out[6]


def test_the_gpu_benchmarker(monkeypatch, capsys):
    out = run(commands("3."), ROOT, monkeypatch, capsys)
    assert "--only" in out[0] and "--suite" in out[1]
    assert "10 of 10 checks passed" in out[2]  # gpu_check's parity and attention groups on the CPU
    assert all(f"PASS {group}" in out[2] for group in ("parity torch float32", "parity jax bfloat16",
                                                        "attention torch SDPA bfloat16"))
