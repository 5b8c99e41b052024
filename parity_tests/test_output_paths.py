"""Where the commands write: an output path that cannot be a file (a directory, a path under a
regular file, an empty name) is one line naming the flag and the path, exit code 2, with what was
there left as it was; a Marian export does not write into a folder that holds files unless told
to (--overwrite). Expected messages are written out from the rule in rosetta/checkpoint.py's
check_writable and rosetta/interop/convert.py's convert."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import rosetta
from rosetta.checkpoint import save_checkpoint
from rosetta.cli import main
from rosetta.errors import RosettaError
from rosetta.files import atomic_write_bytes

# Marian can hold this model exactly (post-norm, concatenated sinusoids, an output bias).
MARIAN_CFG = dict(src_vocab_size=19, tgt_vocab_size=19, d_model=16, num_heads=2, num_encoder_layers=1,
                  num_decoder_layers=2, d_ff=24, positional_encoding="sinusoidal_concat", output_bias=True,
                  dropout=0.0, activation_dropout=0.0, final_norm=False, max_len=40)


def one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith("rosetta: error: "), captured.err
    return captured.err.strip()


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """A checkpoint m.safetensors, a directory D.safetensors holding a user's file, and the
    working directory there, so that the paths in the messages are short and exact."""
    monkeypatch.chdir(tmp_path)
    assert main(["init", "--preset", "tiny", "--out", "m.safetensors"]) == 0
    for name in ("D", "D.safetensors", "D.png", "D.json"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "mine.txt").write_text("keep me")
    return tmp_path


# (command line before the bad path, after it, the flag argparse names or None where the
# refusal comes when the file is written: `convert` writes what its DST's name says).
WRITERS = {
    "init --out": (["init", "--preset", "tiny", "--out"], [], "--out"),
    "average --out": (["average", "m.safetensors", "--out"], [], "--out"),
    "convert DST": (["convert", "m.safetensors"], [], None),
    "attention --out": (["attention", "m.safetensors", "--out"], [], "--out"),
    "diff --plot": (["diff", "m.safetensors", "m.safetensors", "--plot"], [], "--plot"),
    "diff --json": (["diff", "m.safetensors", "m.safetensors", "--json"], [], "--json"),
    "evaluate --out": (["evaluate", "m.safetensors", "--tokenizer", "t.json", "--out"], [], "--out"),
    "evaluate --hyps": (["evaluate", "m.safetensors", "--tokenizer", "t.json", "--hyps"],
                        ["--out", "report.json"], "--hyps"),
}
# (bad path, the reason check_writable gives); D.safetensors for `convert`, whose DST names the
# format, D for the others.
BAD_PATHS = {
    "a directory": ("D", "cannot write {path}: it is a directory"),
    "under a file": ("m.safetensors/x.safetensors", "cannot write {path}: m.safetensors is a file, not a "
                                                    "directory"),
    "under a file, deeper": ("m.safetensors/a/x.safetensors", "cannot write {path}: m.safetensors is a file, "
                                                              "not a directory"),
}
if Path("/proc/self").is_dir():  # Linux's /proc: no file can be created there, even by root (issue 39)
    BAD_PATHS["in a folder no file can be created in"] = (
        "/proc/x.safetensors",
        "cannot write {path}: a file cannot be created in /proc (No such file or directory)")


@pytest.mark.parametrize("bad", sorted(BAD_PATHS))
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_an_output_path_that_cannot_be_a_file_is_one_line(writer, bad, workdir, capsys):
    before, after, flag = WRITERS[writer]
    path, reason = BAD_PATHS[bad]
    if path == "D":
        path = {"convert DST": "D.safetensors", "attention --out": "D.png", "diff --plot": "D.png",
                "diff --json": "D.json"}.get(writer, "D")
    kept = snapshot(workdir)
    assert main([*before, path, *after]) == 2
    message = reason.format(path=path)
    expected = f"rosetta: error: argument {flag}: {message}" if flag else f"rosetta: error: {message}"
    assert one_line_error(capsys) == expected
    assert snapshot(workdir) == kept  # the directory's file, the checkpoint: as they were


@pytest.mark.parametrize("argv,flag", [
    (["init", "--out", ""], "--out"),
    (["average", "m.safetensors", "--out", ""], "--out"),
    (["attention", "m.safetensors", "--out", ""], "--out"),
    (["diff", "m.safetensors", "m.safetensors", "--plot", ""], "--plot"),
    (["diff", "m.safetensors", "m.safetensors", "--json", ""], "--json"),
    (["evaluate", "m.safetensors", "--out", ""], "--out"),
    (["evaluate", "m.safetensors", "--hyps", "", "--out", "report.json"], "--hyps"),
    (["convert", "m.safetensors", ""], "dst"),
    (["convert", "", "x.safetensors"], "src"),
    (["train", "--out", ""], "--out"),
    (["train", "--data-dir", ""], "--data-dir"),
    (["translate", "--run", ""], "--run"),
    (["generate", "--checkpoint", ""], "--checkpoint"),
    (["parity", "--checkpoint", ""], "--checkpoint"),
])
def test_an_empty_path_is_refused_naming_the_flag(argv, flag, workdir, capsys):
    kept = snapshot(workdir)
    assert main(argv) == 2
    assert one_line_error(capsys) == f"rosetta: error: argument {flag}: must name a file or directory, got ''"
    assert snapshot(workdir) == kept


def test_evaluate_refuses_one_file_for_the_report_and_the_hypotheses(workdir, capsys):
    assert main(["evaluate", "m.safetensors", "--tokenizer", "t.json", "--hyps", "r.json", "--out",
                 "r.json"]) == 2
    assert one_line_error(capsys) == ("rosetta: error: --hyps and --out both name r.json: the report would "
                                      "replace the hypotheses")


def test_atomic_write_refuses_before_writing_and_training_saves_still_work(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_bytes(b"mine")
    cfg = rosetta.preset("tiny")
    params = rosetta.init_params(cfg, 0)
    with pytest.raises(RosettaError, match=r"cannot write .*/d: it is a directory"):
        save_checkpoint(tmp_path / "d", cfg, params)
    with pytest.raises(RosettaError, match=r"cannot write .*/f/x: .*/f is a file, not a directory"):
        atomic_write_bytes(tmp_path / "f" / "x", b"data")
    with pytest.raises(RosettaError, match="cannot write a file with an empty name"):
        atomic_write_bytes("", b"data")
    assert (tmp_path / "f").read_bytes() == b"mine" and list((tmp_path / "d").iterdir()) == []
    # What training does: new parents made, an existing file replaced.
    atomic_write_bytes(tmp_path / "new" / "deeper" / "state.json", b"{}")
    atomic_write_bytes(tmp_path / "f", b"replaced")
    assert (tmp_path / "new" / "deeper" / "state.json").read_bytes() == b"{}"
    assert (tmp_path / "f").read_bytes() == b"replaced"


def test_diff_json_makes_its_parent_directories(workdir, capsys):
    assert main(["diff", "m.safetensors", "m.safetensors", "--json", "new/dir/d.json"]) == 0
    assert json.loads((workdir / "new" / "dir" / "d.json").read_text())["differ"] is False
    capsys.readouterr()


# -- convert --to marian into a folder ----------------------------------------------------------

@pytest.fixture
def marian_ready(tmp_path) -> Path:
    cfg = rosetta.ModelConfig(**MARIAN_CFG)
    return rosetta.save_checkpoint(tmp_path / "m.safetensors", cfg, rosetta.init_params(cfg, 0))


def refusal(folder: Path) -> str:
    return (f"rosetta: error: {folder} is a folder that is not empty: writing the Marian model there "
            f"replaces its config.json, model.safetensors and other files of the same names; pass "
            f"--overwrite to replace them, or choose a new or empty folder")


def test_convert_to_marian_refuses_a_folder_holding_files(marian_ready, tmp_path, capsys):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text('{"mine": true}\n')
    assert main(["convert", str(marian_ready), str(folder), "--to", "marian"]) == 2
    assert one_line_error(capsys) == refusal(folder)
    assert snapshot(folder) == {"config.json": b'{"mine": true}\n'}
    # --overwrite: the model's files replace those of the same names; the others stay.
    (folder / "notes.txt").write_text("keep me")
    assert main(["convert", str(marian_ready), str(folder), "--to", "marian", "--overwrite"]) == 0
    assert json.loads((folder / "config.json").read_text())["model_type"] == "marian"
    assert (folder / "notes.txt").read_text() == "keep me"
    capsys.readouterr()


def test_convert_to_marian_refuses_even_its_own_earlier_export(marian_ready, tmp_path, capsys):
    folder = tmp_path / "hf"
    assert main(["convert", str(marian_ready), str(folder)]) == 0  # a new folder: no flag needed
    capsys.readouterr()
    written = snapshot(folder)
    assert main(["convert", str(marian_ready), str(folder)]) == 2
    assert one_line_error(capsys) == refusal(folder)
    assert snapshot(folder) == written


def test_convert_to_marian_writes_into_an_empty_folder(marian_ready, tmp_path, capsys):
    folder = tmp_path / "empty"
    folder.mkdir()
    assert main(["convert", str(marian_ready), str(folder)]) == 0
    back = tmp_path / "back.safetensors"
    assert main(["convert", str(folder), str(back)]) == 0
    original, round_trip = rosetta.load_checkpoint(marian_ready), rosetta.load_checkpoint(back)
    assert all(np.array_equal(original.params[k], round_trip.params[k]) for k in original.params)
    capsys.readouterr()


def _host() -> str:
    import re
    import socket

    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:64] or "host"


def test_convert_to_marian_after_a_kill_during_the_write(marian_ready, tmp_path, capsys):
    """Issue 57: kill -9 during `convert --to marian` left the folder holding only a hidden temporary,
    and the rerun was refused as 'not empty' until the user found it. The rerun now removes a partial
    file of ours whose process is gone, names it, and writes the model."""
    import subprocess
    import sys

    folder = tmp_path / "hf"
    killed = ("import os, signal\n"
              "os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)  # bytes written, not renamed\n"
              "from rosetta.cli import main\n"
              f"main(['convert', {str(marian_ready)!r}, {str(folder)!r}, '--to', 'marian'])\n")
    child = subprocess.run([sys.executable, "-c", killed], cwd=Path(__file__).parents[1], capture_output=True)
    assert child.returncode == -9, child.stderr.decode()
    left = [p.name for p in folder.iterdir()]
    assert len(left) == 1 and left[0].startswith(".model.safetensors.") and left[0].endswith(".tmp"), left
    pid = left[0].split(".")[-3]
    capsys.readouterr()
    assert main(["convert", str(marian_ready), str(folder), "--to", "marian"]) == 0
    err = capsys.readouterr().err
    assert (f"rosetta: note: removed {folder / left[0]}, a partial file left by process {pid}, "
            "which no longer exists\n") in err
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "generation_config.json",
                                                        "model.safetensors"]


def test_convert_to_marian_names_a_partial_file_it_cannot_tell_is_abandoned(marian_ready, tmp_path, capsys):
    """A partial file whose writer is running (this process), or was written on another host less than
    24 hours ago, is refused by name, the folder left as it was; one from another host untouched for
    longer is removed; a user's own hidden .tmp file is a file like any other."""
    import os
    import time

    folder = tmp_path / "hf"
    folder.mkdir()
    live = folder / f".model.safetensors.{_host()}.{os.getpid()}.0a1b2c3d.tmp"
    live.write_bytes(b"half")
    assert main(["convert", str(marian_ready), str(folder), "--to", "marian"]) == 2
    assert one_line_error(capsys) == (
        f"rosetta: error: {folder} holds {live.name}, a partial file being written by process "
        f"{os.getpid()}, which is still running; wait for that write, or delete the file if it was stopped")
    live.unlink()
    remote = folder / ".config.json.otherhost.123.0a1b2c3d.tmp"
    remote.write_bytes(b"half")
    assert main(["convert", str(marian_ready), str(folder), "--to", "marian"]) == 2
    assert one_line_error(capsys) == (
        f"rosetta: error: {folder} holds {remote.name}, a partial file written by process 123 on host "
        "otherhost less than 24 hours ago (it may still be writing); wait for that write, or delete the "
        "file if it was stopped")
    assert snapshot(folder) == {remote.name: b"half"}
    two_days_ago = time.time() - 48 * 3600
    os.utime(remote, (two_days_ago, two_days_ago))
    mine = folder / ".notes.tmp"
    mine.write_text("mine")
    assert main(["convert", str(marian_ready), str(folder), "--to", "marian"]) == 2
    assert one_line_error(capsys) == refusal(folder)
    mine.unlink()
    assert main(["convert", str(marian_ready), str(folder), "--to", "marian"]) == 0
    assert (f"rosetta: note: removed {remote}, a partial file left by process 123 on host otherhost, "
            "untouched for over 24 hours\n") in capsys.readouterr().err
    assert not remote.exists() and (folder / "config.json").is_file()
