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
