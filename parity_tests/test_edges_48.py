"""Issue 48, "no hang, no traceback" and the smaller edges: a trace's files must be regular files
(a FIFO is refused before it is opened, never blocked on), tampered step values outside what a step
can produce are refused naming the field and the step, the compile cache path is checked before
any data is prepared, gpu_check's --device goes through the one device parser, and `rosetta
example` sweeps the partial folders of processes that no longer exist."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest

from parity_tests import dp_case
from parity_tests.test_diff_training import assert_refused, trainer_trace
from rosetta.cli import main


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Our torch trainer's float64 trace of dp_case (parity_tests/test_diff_training.py's "plain")."""
    return trainer_trace("torch", dp_case.case(), dp_case.TRAIN, tmp_path_factory.mktemp("trace") / "plain")


def refused_within(argv, message, capsys, seconds=60.0):
    """assert_refused, run where a blocking open cannot hang the suite: the call must return."""
    done = {}
    thread = threading.Thread(target=lambda: done.setdefault("err", _refusal(argv, capsys)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"rosetta {' '.join(argv)} blocked for {seconds} s"
    code, err = done["err"]
    assert code == 2 and err.startswith("rosetta: error:") and len(err.strip().splitlines()) == 1, err
    assert message in err, err


def _refusal(argv, capsys):
    capsys.readouterr()
    code = main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("name", ["steps.jsonl", "trace.json", "evals.jsonl", "step_000001.safetensors"])
def test_a_trace_file_that_is_a_fifo_is_refused_before_opening(name, plain, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(plain, bad)
    (bad / name).unlink(missing_ok=True)
    os.mkfifo(bad / name)
    refused_within(["diff", str(bad), str(plain)], f"{name} is a FIFO: a trace's files are regular files",
                   capsys)


def test_a_trace_file_that_is_a_directory_or_a_link_loop_is_refused(plain, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(plain, bad)
    (bad / "evals.jsonl").mkdir()
    assert_refused(["diff", str(bad), str(plain)], "evals.jsonl is a directory", capsys)
    (bad / "evals.jsonl").rmdir()
    (bad / "steps.jsonl").unlink()
    (bad / "steps.jsonl").symlink_to(bad / "steps.jsonl")
    assert_refused(["diff", str(bad), str(plain)], "steps.jsonl: cannot read", capsys)


def _edit_step(path, key, value, step=2):
    lines = (path / "steps.jsonl").read_text().splitlines()
    record = json.loads(lines[step - 1])
    if isinstance(key, tuple):  # a per-tensor field: (field, first tensor)
        record[key[0]][next(iter(record[key[0]]))] = value
    else:
        record[key] = value
    lines[step - 1] = json.dumps(record)
    (path / "steps.jsonl").write_text("\n".join(lines) + "\n")


TAMPERED = {  # (field, value): what the refusal says
    ("loss", -1e308): "step 2's loss is -1e+308: no step gives a loss (a cross entropy) outside [0, inf)",
    ("loss", -0.5): "step 2's loss is -0.5: no step gives a loss",
    ("lr", -0.5): "step 2's lr is -0.5: no step gives a learning rate outside [0, inf)",
    ("lr", float("inf")): "step 2's lr is inf: no step gives a learning rate outside [0, inf)",
    ("lr", float("nan")): "step 2's lr is nan: no step gives a learning rate",
    ("grad_norm", -1): "step 2's grad_norm is -1: no step gives a gradient norm outside [0, inf)",
    ("grad_norm", float("-inf")): "step 2's grad_norm is -inf: the run had diverged there",
    (("param_norms",), -2.0): "step 2's param_norms of",
}


@pytest.mark.parametrize("change", list(TAMPERED), ids=[f"{k[0]}={k[1]}" for k in TAMPERED])
def test_tampered_step_values_are_refused_naming_the_field_and_step(change, plain, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(plain, bad)
    _edit_step(bad, *change)
    err = assert_refused(["diff", str(bad), str(plain)], TAMPERED[change], capsys)
    assert "steps.jsonl: line 2" in err


def test_crlf_lines_are_refused(plain, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(plain, bad)
    text = (bad / "steps.jsonl").read_text()
    (bad / "steps.jsonl").write_bytes(text.replace("\n", "\r\n").encode())
    assert_refused(["diff", str(bad), str(plain)], "steps.jsonl: line 1 ends in CRLF", capsys)


def test_a_zero_rate_and_zero_norms_are_accepted(plain, tmp_path, capsys):
    """The bounds are [0, inf): a schedule's first rate of 0 (schedule_from_zero) is a real step."""
    ok = tmp_path / "ok"
    shutil.copytree(plain, ok)
    _edit_step(ok, "lr", 0.0, step=1)
    capsys.readouterr()
    assert main(["diff", str(ok), str(plain)]) == 1  # a difference in lr, not a refusal
    assert "rosetta: error" not in capsys.readouterr().err


# -- the compile cache, before any data is prepared ------------------------------------------------

def _cache_cases(tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)  # Path.resolve raises RuntimeError("Symlink loop ...") on Python 3.11
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    return {"symlink loop": (loop, "cannot resolve it"), "a file": (a_file, "is a file, not a directory"),
            "under /proc": (Path("/proc/rosetta-cache"), "a file cannot be created in /proc")}


@pytest.mark.parametrize("case", ["symlink loop", "a file", "under /proc"])
def test_a_bad_compile_cache_is_refused_before_the_data(case, tmp_path, capsys, monkeypatch):
    if case == "under /proc" and not Path("/proc/self").is_dir():
        pytest.skip("Linux's /proc: the other two cases cover the check")
    folder, message = _cache_cases(tmp_path)[case]
    prepared = []
    import rosetta.harness.loop as loop

    monkeypatch.setattr(loop, "run_task", lambda *a, **k: prepared.append(a))  # data preparation
    out = tmp_path / "out"
    err = assert_refused(["train", "--backend", "jax", "--task", "copy", "--preset", "tiny", "--steps", "1",
                          "--out", str(out), "--compile-cache", str(folder)], message, capsys)
    assert f"--compile-cache {folder}" in err
    assert not prepared and not out.exists()


def test_the_compile_cache_is_not_checked_without_jax_or_when_off(tmp_path):
    from rosetta.harness.run_config import RunConfig, check_compile_cache

    loop = _cache_cases(tmp_path)["symlink loop"][0]
    check_compile_cache(RunConfig(backends=("torch",), compile_cache=str(loop)))  # torch keeps no cache
    check_compile_cache(RunConfig(backends=("jax",), compile_cache="off"))
    check_compile_cache(RunConfig(backends=("jax",), compile_cache=str(tmp_path / "new" / "cache")))
    assert not (tmp_path / "new").exists()  # checked, not made: the trainer makes it


@pytest.mark.parametrize("compile_flag", [True, False])
def test_compile_with_jax_gets_a_one_line_note(compile_flag, tmp_path, capsys, monkeypatch):
    """--compile is PyTorch's torch.compile; JAX jits every step anyway: the run says so, once."""
    import rosetta.harness.loop as loop

    class NoTraining:  # the run up to its first step; the training itself is not this test's
        def __init__(self, *args):
            pass

        def train(self):
            return {}

    monkeypatch.setattr(loop, "_Run", NoTraining)
    monkeypatch.setattr(loop, "write_combined_report", lambda *a: None)
    argv = ["train", "--backend", "jax", "--task", "copy", "--preset", "tiny", "--steps", "1",
            "--train-size", "50", "--eval-size", "4", "--out", str(tmp_path / "out"), "--compile-cache",
            "off", "--device", "cpu", "--no-progress"]
    capsys.readouterr()
    assert main(argv + (["--compile"] if compile_flag else [])) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "--compile" in line]
    note = "rosetta: jax: --compile changes nothing here (JAX compiles every step with jit already)"
    assert notes == ([note] if compile_flag else [])


# -- rosetta example: build folders of processes that no longer exist, a folder as a data file -----

def _dead_pid() -> int:
    """The id of a process that has exited and been reaped (the kernel reuses ids only after
    wrapping around pid_max: not within this test)."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_example_sweeps_the_partial_folders_of_dead_processes(tmp_path, capsys):
    from rosetta.harness.example import check_example_args

    dead, live = _dead_pid(), os.getpid()
    for name in (f".ex.partial-{dead}-0a1b2c3d", f".ex.partial-{live}-00ff00ff", ".ex.partial-mine",
                 f".other.partial-{dead}-0a1b2c3d"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "source.spm").write_bytes(b"half")  # about 500 KB in the case
    capsys.readouterr()
    check_example_args(tmp_path / "ex")
    err = capsys.readouterr().err
    assert err == (f"rosetta: removed {tmp_path}/.ex.partial-{dead}-0a1b2c3d (left by process {dead}, which "
                   f"no longer exists)\n")
    # A live process's build, a folder not named as a build's, another DIR's: left as they are.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f".ex.partial-{live}-00ff00ff", ".ex.partial-mine", f".other.partial-{dead}-0a1b2c3d"])


def test_example_names_a_dead_processs_folder_it_cannot_remove(tmp_path, capsys, monkeypatch):
    from rosetta.harness import example

    dead = _dead_pid()
    (tmp_path / f".ex.partial-{dead}-0a1b2c3d").mkdir()

    def refuse(path):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(example.shutil, "rmtree", refuse)
    assert_refused(["example", "opus-mt", str(tmp_path / "ex")],
                   f".ex.partial-{dead}-0a1b2c3d: a build folder left by process {dead}, which no longer "
                   f"exists, cannot be removed (Permission denied); remove it", capsys)


def test_example_data_dir_with_a_folder_for_a_data_file_says_so(tmp_path, capsys):
    data = tmp_path / "data"
    (data / "train.de.gz").mkdir(parents=True)
    assert_refused(["example", "opus-mt", str(tmp_path / "ex"), "--data-dir", str(data)],
                   f"data file {str(data / 'train.de.gz')!r} is a directory", capsys)
    assert not (tmp_path / "ex").exists()


def test_every_fix_text_names_the_optax_form_too():
    """Issue 48: the fix texts were written for PyTorch only ("LambdaLR passes 0 first" to an optax
    user). Each now names the JAX side (optax, nnx or jax) beside PyTorch's, or is framework-free math
    that says which optax call computes it."""
    from rosetta.diff.training.catalogue import BY_NAME, ENTRIES

    missing = [e.name for e in ENTRIES if not any(word in e.fix for word in ("optax", "nnx", "jax"))]
    assert missing == []
    assert "optax's schedule gets its count from 0" in BY_NAME["schedule_from_zero"].fix


def test_the_pair_search_stops_a_replay_past_the_best_error(plain):
    """Issue 48: "not explained" verdicts cost minutes in the pair search. The error is a maximum over
    steps, so a replay whose error passes the best so far cannot rank first: it stops there. The
    bound changes no error below it, and an unbounded replay reads every step."""
    import numpy as np

    from rosetta.diff.training.catalogue import Settings, Variant, replay
    from rosetta.diff.training.diagnose import errors_against
    from rosetta.diff.training.trace import read_trace

    trace = read_trace(plain)
    settings = Settings.from_trace(trace.train_config)
    initial = {k: v.astype(np.float64) for k, v in trace.initial().items()}
    variant = Variant(eps_inside_sqrt=True)  # off from step 1

    def counted(read):
        for step in replay(trace, settings, variant, 3):
            read.append(step)
            yield step

    everything, stopped = [], []
    (full, where), = errors_against((trace,), counted(everything), initial)
    (part, _), = errors_against((trace,), counted(stopped), initial, bound=0.0)
    assert len(everything) == 3 and len(stopped) == 1 and 0 < part <= full
    (same, same_where), = errors_against((trace,), replay(trace, settings, variant, 3), initial, bound=full)
    assert (same, same_where) == (full, where)
