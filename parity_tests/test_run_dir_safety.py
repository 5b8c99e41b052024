"""Run directories (issue 11, item 8): one process at a time in an output directory; nothing the
harness did not write is overwritten or deleted; file system errors are one line naming the
path, with the checkpoints already written left intact; a checkpoint that is not what its name
says is refused on resume and on translate.

Each test trains the `tiny` preset for a few steps on the CPU."""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import PIL.Image
import pytest

from rosetta import load_checkpoint
from rosetta.cli import main
from rosetta.harness.report import read_log
from rosetta.harness.run_dir import latest_checkpoint, list_checkpoints
from rosetta.harness.trainer_state import load_trainer_state

pytestmark = pytest.mark.trainable

QUICK = ["--backend", "torch", "--task", "copy", "--max-tokens", "512", "--buckets", "24", "--train-size",
         "500", "--eval-size", "8", "--bleu-samples", "4", "--eval-every", "0", "--warmup", "10",
         "--no-progress", "--device", "cpu"]


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("rosetta: error: ")]
    assert len(lines) == 1, err
    return lines[0]


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under `root` (symlinks not followed) and its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink()}


# -- One process at a time ------------------------------------------------------------------------

def test_a_second_process_is_refused_naming_the_live_runs_pid(tmp_path, capsys):
    out = tmp_path / "live"
    args = [sys.executable, "-m", "rosetta.cli", "train", *QUICK, "--steps", "100000", "--checkpoint-every",
            "2", "--out", str(out)]
    proc = subprocess.Popen(args, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        checkpoints = out / "torch" / "checkpoints"
        deadline = time.monotonic() + 120
        while not list_checkpoints(checkpoints) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read().decode()
        run_json = (out / "torch" / "run.json").read_bytes()
        for extra in (["--overwrite"], ["--resume"], []):
            assert main(["train", *QUICK, "--steps", "4", "--out", str(out), *extra]) == 2
            err = one_line_error(capsys)
            assert f"is in use by another rosetta process (pid {proc.pid})" in err, err
        # Refused before touching anything: the live run's files are its own, and it goes on.
        assert (out / "torch" / "run.json").read_bytes() == run_json
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    # The lock dies with its holder: the run can be resumed now.
    assert main(["train", *QUICK, "--steps", "4", "--checkpoint-every", "2", "--out", str(out),
                 "--resume"]) == 0


# -- Never overwrite what the harness did not write ---------------------------------------------------

USER_FILES = {"summary.md": b"# my notes\n", "summary.json": b'{"mine": true}\n',
              "plot.png": b"\x89PNG\r\n\x1a\n" + b"my own picture"}


@pytest.mark.parametrize("name", sorted(USER_FILES))
def test_a_users_file_in_out_is_refused_by_name_and_kept(name, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / name).write_bytes(USER_FILES[name])
    assert main(["train", *QUICK, "--steps", "2", "--out", str(out)]) == 2
    assert f"{out / name} exists and was not written by rosetta train" in one_line_error(capsys)
    assert (out / name).read_bytes() == USER_FILES[name]
    assert not (out / "torch").exists()  # refused before any training


def test_the_harnesss_own_files_are_rewritten_and_recognised(tmp_path, capsys):
    out = tmp_path / "ours"
    argv = ["train", *QUICK, "--steps", "2", "--out", str(out)]
    assert main(argv) == 0
    assert main([*argv, "--overwrite"]) == 0  # its own summary, plot and run directory: rewritten
    assert json.loads((out / "summary.json").read_text())["backends"]["torch"]["steps"] == 2
    for plot in (out / "plot.png", out / "torch" / "plot.png"):  # the tag, as Pillow reads PNG text
        assert "rosetta" in PIL.Image.open(plot).text["Software"]
    # Written before the format tags existed: recognised by their fixed shape and rewritten.
    (out / "summary.json").write_text(json.dumps({"backends": {}, "run": {}}))
    (out / "summary.md").write_text("# Training summary: task copy, preset tiny, dtype float32\n")
    assert main([*argv, "--overwrite"]) == 0
    capsys.readouterr()


def test_overwrite_refuses_a_run_directory_holding_a_users_file(tmp_path, capsys):
    out = tmp_path / "notes"
    argv = ["train", *QUICK, "--steps", "2", "--out", str(out)]
    assert main(argv) == 0
    notes = out / "torch" / "checkpoints" / "my-notes.txt"
    notes.write_text("keep me")
    before = snapshot(out / "torch")
    assert main([*argv, "--overwrite"]) == 2
    assert f"--overwrite deletes {out / 'torch'} whole, but {notes} was not written" in one_line_error(capsys)
    assert snapshot(out / "torch") == before


# -- File system errors: one line naming the path, nothing lost ----------------------------------------

def test_out_naming_a_file_is_one_line(tmp_path, capsys):
    path = tmp_path / "a-file"
    path.write_text("not a directory")
    assert main(["train", *QUICK, "--steps", "2", "--out", str(path)]) == 2
    assert one_line_error(capsys) == f"rosetta: error: --out {path} is a file, not a directory"
    assert path.read_text() == "not a directory"
    assert main(["train", *QUICK, "--steps", "2", "--out", str(path / "below")]) == 2
    assert f"{path}" in one_line_error(capsys)


def test_an_unwritable_out_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    # Tests may run as root, whom chmod does not stop: the refusal a read-only directory gives
    # (EACCES from mkdir) is injected instead.
    out = tmp_path / "read-only" / "run"
    real_mkdir = os.mkdir

    def mkdir(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path / "read-only")):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    assert main(["train", *QUICK, "--steps", "2", "--out", str(out)]) == 2
    err = one_line_error(capsys)
    assert "read-only" in err and "Permission denied" in err, err


def test_a_full_disk_at_a_checkpoint_keeps_the_earlier_ones(tmp_path, capsys, monkeypatch):
    out = tmp_path / "full"
    real_fsync = os.fsync

    def fsync(fd):  # the disk fills up while checkpoint 4 is written
        if "step-00000004" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    assert main(["train", *QUICK, "--steps", "6", "--checkpoint-every", "2", "--out", str(out)]) == 2
    err = one_line_error(capsys)
    assert "step-00000004" in err and "No space left on device" in err, err
    checkpoints = out / "torch" / "checkpoints"
    assert [step for step, _ in list_checkpoints(checkpoints)] == [2]
    assert latest_checkpoint(checkpoints).name == "step-00000002"
    params = load_checkpoint(checkpoints / "step-00000002" / "model.safetensors").params
    assert all(np.isfinite(v).all() for v in params.values())
    assert not any(".tmp" in p.name for p in checkpoints.iterdir())
    assert not (out / "torch" / "result.json").exists()


# -- A checkpoint must be what its name says --------------------------------------------------------

@pytest.fixture
def two_checkpoints(tmp_path, capsys) -> Path:
    out = tmp_path / "run"
    assert main(["train", *QUICK, "--steps", "2", "--checkpoint-every", "1", "--out", str(out)]) == 0
    capsys.readouterr()
    return out


def refused_on_resume_and_translate(out: Path, capsys, monkeypatch) -> list[str]:
    errors = []
    before = [r["step"] for r in read_log(out / "torch" / "log.jsonl") if r["kind"] == "train"]
    assert main(["train", *QUICK, "--steps", "8", "--checkpoint-every", "1", "--out", str(out),
                 "--resume"]) == 2
    errors.append(one_line_error(capsys))
    assert [r["step"] for r in read_log(out / "torch" / "log.jsonl") if r["kind"] == "train"] == before
    monkeypatch.setattr(sys, "stdin", io.StringIO("5 6 7\n"))
    assert main(["translate", "--run", str(out / "torch")]) == 2
    errors.append(one_line_error(capsys))
    return errors


def test_a_checkpoint_whose_recorded_step_differs_from_its_name_is_refused(two_checkpoints, capsys,
                                                                           monkeypatch):
    checkpoints = two_checkpoints / "torch" / "checkpoints"
    renamed = checkpoints / "step-00000007"
    (checkpoints / "step-00000002").rename(renamed)  # holds step 2's files under step 7's name
    for err in refused_on_resume_and_translate(two_checkpoints, capsys, monkeypatch):
        assert f"{renamed}: its " in err and "records step 2, not the step 7 of its name" in err, err
    assert main(["translate", "--run", str(renamed)]) == 2  # named directly, too
    assert "records step 2, not the step 7" in one_line_error(capsys)


@pytest.mark.parametrize("pointer", [b"\xff\xfe\x00 not UTF-8", b"step-00000009", "sparse"])
def test_a_corrupt_latest_pointer_falls_back_to_the_newest_complete_checkpoint(pointer, two_checkpoints,
                                                                               capsys, monkeypatch):
    """checkpoints/latest holding bytes that are not UTF-8 (a traceback before), naming a step that is
    not there, or 3 GB long (sparse; read whole before): the newest complete checkpoint, as for a
    missing pointer, with 128 bytes of it read (the peak is the checkpoint's own check, 16 MB here);
    `translate --run` and `--resume` go on from it."""
    import tracemalloc

    checkpoints = two_checkpoints / "torch" / "checkpoints"
    latest = checkpoints / "latest"
    if pointer == "sparse":
        with open(latest, "wb") as f:
            f.truncate(3 << 30)
    else:
        latest.write_bytes(pointer)
    tracemalloc.start()
    try:
        assert latest_checkpoint(checkpoints).name == "step-00000002"
        assert tracemalloc.get_traced_memory()[1] < 100 << 20  # the checkpoint's check; 3 GB read whole
    finally:
        tracemalloc.stop()
    monkeypatch.setattr(sys, "stdin", io.StringIO("5 6 7\n"))
    assert main(["translate", "--run", str(two_checkpoints / "torch")]) == 0
    assert main(["train", *QUICK, "--steps", "3", "--checkpoint-every", "1", "--out", str(two_checkpoints),
                 "--resume"]) == 0
    assert latest_checkpoint(checkpoints).name == "step-00000003"


def test_a_checkpoint_symlinked_out_of_the_run_is_refused(two_checkpoints, tmp_path, capsys, monkeypatch):
    checkpoints = two_checkpoints / "torch" / "checkpoints"
    elsewhere = tmp_path / "elsewhere" / "step-00000003"
    shutil.copytree(checkpoints / "step-00000002", elsewhere)
    state = json.loads((elsewhere / "state.json").read_text())
    (elsewhere / "state.json").write_text(json.dumps(state | {"step": 3}))  # consistent, but outside
    (checkpoints / "step-00000003").symlink_to(elsewhere, target_is_directory=True)
    for err in refused_on_resume_and_translate(two_checkpoints, capsys, monkeypatch):
        assert f"{checkpoints / 'step-00000003'} is a symlink to {elsewhere.resolve()}" in err, err
        assert "outside the run directory" in err
    # A file symlinked out of a checkpoint that is otherwise in place: refused just the same.
    (checkpoints / "step-00000003").unlink()
    model = checkpoints / "step-00000002" / "model.safetensors"
    shutil.move(model, tmp_path / "elsewhere" / "model.safetensors")
    model.symlink_to(tmp_path / "elsewhere" / "model.safetensors")
    for err in refused_on_resume_and_translate(two_checkpoints, capsys, monkeypatch):
        assert f"{model} is a symlink to" in err and "outside the run directory" in err, err


# -- A refused run leaves nothing behind ---------------------------------------------------------------

@pytest.mark.parametrize("flags,message", [
    (["--set", "d_model=33"], "d_model must be even, got 33"),
    (["--preset", "nope"], "unknown preset 'nope'; choose one of tiny, small, base, big"),
    (["--device", "cuda"], "--device cuda: no GPU here"),
    # Refused after the lock (the data is read under it): the lock and OUT go again.
    (["--task", "multi30k", "--data-dir", "no-such-dir"], "Multi30k data directory 'no-such-dir'"),
])
def test_a_refused_run_creates_no_out_directory(flags, message, tmp_path, capsys, monkeypatch):
    import torch

    if "cuda" in flags and torch.cuda.is_available():
        pytest.skip("this machine has CUDA: --device cuda is no refusal here")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "new" / "run"
    assert main(["train", *QUICK, "--steps", "2", "--out", str(out), *flags]) == 2
    assert message in one_line_error(capsys)
    assert list(tmp_path.iterdir()) == []  # neither OUT nor its parent, nor a lock file


def test_a_refused_run_in_an_existing_empty_out_leaves_it_empty(tmp_path, capsys):
    out = tmp_path / "empty"
    out.mkdir()
    assert main(["train", *QUICK, "--steps", "2", "--out", str(out), "--task", "multi30k", "--data-dir",
                 str(tmp_path / "missing")]) == 2
    assert "Multi30k data directory" in one_line_error(capsys)
    assert list(out.iterdir()) == []  # the user's directory stays, without the lock file


def test_an_unfinished_run_is_named_so(tmp_path, capsys, monkeypatch):
    out = tmp_path / "unfinished"
    assert main(["train", *QUICK, "--steps", "2", "--out", str(out)]) == 0
    (out / "torch" / "result.json").unlink()  # as a run killed before its end leaves it
    assert main(["train", *QUICK, "--steps", "2", "--out", str(out)]) == 2
    assert one_line_error(capsys) == (f"rosetta: error: {out / 'torch'} already holds an unfinished run; "
                                      f"pass --resume to continue it or --overwrite to replace it")


# -- A truncated newest checkpoint: the message names the intact one and how to resume from it -------

RESUMABLE = [*QUICK, "--checkpoint-every", "2"]


@pytest.fixture(scope="module")
def straight_and_stopped(tmp_path_factory) -> tuple[Path, Path]:
    """Six steps straight; and four steps (checkpoints at 2 and 4) to be resumed to six."""
    straight = tmp_path_factory.mktemp("straight") / "run"
    stopped = tmp_path_factory.mktemp("stopped") / "run"
    assert main(["train", *RESUMABLE, "--steps", "6", "--out", str(straight)]) == 0
    assert main(["train", *RESUMABLE, "--steps", "4", "--out", str(stopped)]) == 0
    return straight, stopped


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("broken", ["model.safetensors", "trainer_state.safetensors", "state.json"])
def test_resume_from_a_truncated_checkpoint_names_the_intact_one_and_following_it_resumes_exactly(
        broken, straight_and_stopped, tmp_path, capsys):
    straight, stopped = straight_and_stopped
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    checkpoints = out / "torch" / "checkpoints"
    truncate(checkpoints / "step-00000004" / broken)
    argv = ["train", *RESUMABLE, "--steps", "6", "--out", str(out), "--resume"]
    assert main(argv) == 2
    err = one_line_error(capsys)
    assert f"{checkpoints / 'step-00000004' / broken}: " in err, err  # the broken file, by name
    assert err.endswith(f"; the previous checkpoint {checkpoints / 'step-00000002'} is intact: move "
                        f"step-00000004 out of {checkpoints} (or delete it) and run again with --resume to "
                        f"continue from step 2"), err
    # Following the instruction: the run resumes at step 2 and ends where the straight run ended.
    shutil.move(checkpoints / "step-00000004", tmp_path / "broken-step-00000004")
    assert main(argv) == 0
    capsys.readouterr()
    name = "checkpoints/step-00000006/"
    a, b = (load_checkpoint(run / "torch" / name / "model.safetensors").params for run in (straight, out))
    assert list(a) == list(b) and all(np.array_equal(a[k], b[k]) for k in a)
    state_a, state_b = (load_trainer_state(run / "torch" / name / "trainer_state.safetensors", "torch")
                        for run in (straight, out))
    assert sorted(state_a) == sorted(state_b) and all(np.array_equal(state_a[k], state_b[k]) for k in state_a)
    steps = [r["step"] for r in read_log(out / "torch" / "log.jsonl") if r["kind"] == "train"]
    assert steps == [1, 2, 3, 4, 5, 6]  # steps 3 and 4 once each: the first tries were dropped


def test_resume_with_no_intact_checkpoint_says_so(straight_and_stopped, tmp_path, capsys):
    _, stopped = straight_and_stopped
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    checkpoints = out / "torch" / "checkpoints"
    for step in ("step-00000002", "step-00000004"):
        truncate(checkpoints / step / "model.safetensors")
    assert main(["train", *RESUMABLE, "--steps", "6", "--out", str(out), "--resume"]) == 2
    err = one_line_error(capsys)
    assert err.endswith(f"; no earlier checkpoint in {checkpoints} is intact to resume from"), err


@pytest.mark.parametrize("backend", ["numpy", "tensorflow"])
def test_a_run_json_naming_a_backend_that_does_not_train_is_refused(backend, two_checkpoints, tmp_path,
                                                                   capsys, monkeypatch):
    """Issue 57: run.json's "backend" was obeyed by translate, evaluate and --resume whatever it said
    ("numpy" decoded with the reference as if it had trained the run). A backend that does not train
    (the registry's list: torch, jax, peer) is refused in one line naming the field and those values."""
    run_json = two_checkpoints / "torch" / "run.json"
    run_json.write_text(json.dumps(json.loads(run_json.read_text()) | {"backend": backend}))
    expected = f"{run_json}: backend must be one of torch, jax, peer, got a string {backend!r}"
    for err in refused_on_resume_and_translate(two_checkpoints, capsys, monkeypatch):
        assert err == f"rosetta: error: {expected}", err
    (two_checkpoints / "torch" / "tokenizer.json").write_text("{}")  # evaluate reads run.json before it
    assert main(["evaluate", str(two_checkpoints / "torch"), "--out", str(tmp_path / "e.json")]) == 2
    assert one_line_error(capsys) == f"rosetta: error: {expected}"
