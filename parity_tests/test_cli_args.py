"""The command line's arguments and stdin (issue 11, item 6): every bad value is refused before any
work with one line on stderr and exit code 2, never a traceback, a silent exit 0 or blank output.

Expected messages are written out here from the rules in rosetta/cli.py's docstring; vocabulary
bounds come from the `tiny` preset (64 source ids)."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from parity_tests.conftest import deadline
from rosetta.cli import main
from rosetta.errors import RosettaError


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("cli-args") / "m.safetensors"
    assert main(["init", "--preset", "tiny", "--set", "max_len=16", "--out", str(path)]) == 0
    return str(path)


def one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith("rosetta: error: "), captured.err
    return captured.err.strip()


def feed_stdin(monkeypatch, data: bytes) -> None:
    """stdin as a process gets it: a text stream over bytes (sys.stdin.buffer)."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))


@pytest.mark.parametrize("argv,message", [
    (["generate", "--batch-size", "-1"], "argument --batch-size: must be an integer >= 1, got '-1'"),
    (["generate", "--batch-size", "0"], "argument --batch-size: must be an integer >= 1, got '0'"),
    (["translate", "--batch-size", "-1"], "argument --batch-size: must be an integer >= 1, got '-1'"),
    (["generate", "--beam", "0"], "argument --beam: must be an integer >= 1, got '0'"),
    (["generate", "--beam", "1_0"], "argument --beam: must be an integer >= 1, got '1_0'"),
    (["generate", "--margin", "-1"], "argument --margin: must be an integer >= 0, got '-1'"),
    (["generate", "--alpha", "nan"], "argument --alpha: must be a finite number >= 0 and <= 5, got 'nan'"),
    (["translate", "--alpha", "-0.5"], "argument --alpha: must be a finite number >= 0 and <= 5, got '-0.5'"),
    (["parity", "--batch", "-1"], "argument --batch: must be an integer >= 1, got '-1'"),
    (["parity", "--src-len", "0"], "argument --src-len: must be an integer >= 1, got '0'"),
    (["parity", "--tgt-len", "-3"], "argument --tgt-len: must be an integer >= 1, got '-3'"),
    (["parity", "--seed", "-1"], "argument --seed: must be an integer >= 0, got '-1'"),
    (["parity", "--seed", "\u0665"], "argument --seed: must be an integer >= 0, got '\u0665'"),  # Arabic 5
    (["init", "--seed", "-1", "--out", "unused.safetensors"],
     "argument --seed: must be an integer >= 0, got '-1'"),
    (["train", "--lr-factor", "inf"], "argument --lr-factor: must be a finite number, got 'inf'"),
    (["parity", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_bad_arguments_are_one_line_with_exit_code_2(argv, message, checkpoint, monkeypatch, capsys):
    feed_stdin(monkeypatch, b"5 6 7\n")  # valid input: the flag alone must stop the command
    if argv[0] in ("generate", "translate"):
        argv = [*argv, "--checkpoint", checkpoint]
    assert main(argv) == 2
    assert one_line_error(capsys) == f"rosetta: error: {message}"


@pytest.mark.parametrize("command", ["generate", "translate", "evaluate"])
def test_a_model_path_that_is_no_file_or_directory_is_named_as_such(command, tmp_path, monkeypatch, capsys):
    """A FIFO or a device given as the model: one line saying what it is, nothing opened (a FIFO's
    open would wait for a writer forever, /dev/zero would read without end); a missing path: its own line."""
    feed_stdin(monkeypatch, b"5 6 7\n")
    fifo = tmp_path / "model.fifo"
    os.mkfifo(fifo)
    flag = [] if command == "evaluate" else ["--checkpoint"]
    out = ["--out", str(tmp_path / "eval.json")] if command == "evaluate" else []
    for path in (fifo, "/dev/zero"):
        with deadline(20):
            assert main([command, *flag, str(path), *out]) == 2
        assert one_line_error(capsys) == (f"rosetta: error: {path}: not a regular file or a directory "
                                          "(a checkpoint file or model directory is needed)")
    assert main([command, *flag, str(tmp_path / "missing.safetensors"), *out]) == 2
    assert one_line_error(capsys).endswith("missing.safetensors: no such checkpoint file or model directory")


def test_a_fifo_is_never_opened_by_convert_diff_or_as_a_tokenizer(checkpoint, tmp_path, monkeypatch, capsys):
    """Format detection (convert, diff) and the tokenizer reader refuse a FIFO or a device before opening
    it; until this test, `convert FIFO OUT` and `diff FIFO CKPT` waited for a writer forever."""
    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)
    for argv in (["convert", str(fifo), str(tmp_path / "out.safetensors")], ["diff", str(fifo), checkpoint],
                 ["diff", checkpoint, "/dev/zero"]):
        with deadline(20):
            assert main(argv) == 2
        path = argv[1] if argv[0] == "convert" or argv[1] != checkpoint else argv[2]
        assert one_line_error(capsys) == f"rosetta: error: {path}: not a regular file or a directory"
    assert not (tmp_path / "out.safetensors").exists()
    feed_stdin(monkeypatch, b"Ein Hund.\n")
    with deadline(20):
        assert main(["translate", "--checkpoint", checkpoint, "--tokenizer", str(fifo)]) == 2
    assert one_line_error(capsys) == f"rosetta: error: tokenizer file {str(fifo)!r} is not a regular file"


def test_a_model_larger_than_the_memory_is_refused_before_it_is_allocated(tmp_path, monkeypatch, capsys):
    """Every field within its bound, their product not: 383 billion parameters (1.4 TiB in float32)
    were allocated until the OOM killer ended the process (24 GB in 39 s on this project's machine);
    now one line from the count alone, in `init` and `train`, nothing written. Where /proc/meminfo
    says nothing, nothing is refused; a tiny model against 100 kB available is."""
    import rosetta.params
    from rosetta import init_params, preset

    huge = ["--preset", "base", "--set", "d_model=16384", "--set", "d_ff=131072",
            "--set", "num_encoder_layers=64"]
    out = tmp_path / "huge.safetensors"
    assert main(["init", *huge, "--out", str(out)]) == 2
    assert one_line_error(capsys).startswith("rosetta: error: the model's 382,878,384,128 parameters need "
                                             "1,426.3 GiB in float32, more than the ")
    assert main(["train", "--task", "copy", *huge, "--steps", "1", "--out", str(tmp_path / "run")]) == 2
    assert "382,878,384,128 parameters need" in one_line_error(capsys)
    assert not out.exists() and not (tmp_path / "run").exists()
    monkeypatch.setattr(rosetta.params, "available_memory", lambda: 100_000)  # 179,200 bytes needed
    with pytest.raises(RosettaError, match=r"the model's 44,800 parameters need 0\.0 GiB"):
        init_params(preset("tiny"))
    monkeypatch.setattr(rosetta.params, "available_memory", lambda: None)
    assert len(init_params(preset("tiny"))) > 0


def test_train_flags_are_refused_before_any_work(tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["train", "--alpha", "-1", "--out", str(out)]) == 2
    assert "--alpha must be a number >= 0 and finite, got -1.0" in one_line_error(capsys)
    assert main(["train", "--vocab-size", "0", "--out", str(out)]) == 2
    assert "--vocab-size must be an integer >= 1, got 0" in one_line_error(capsys)
    assert not out.exists()


@pytest.mark.parametrize("command", ["generate", "translate"])
@pytest.mark.parametrize("line,message", [
    (b"\xff\xfe 7", "input line 2 is not valid UTF-8 (byte 0xff at byte 1 of the line)"),
    (b"5 \xe2\x82", "input line 2 is not valid UTF-8 (byte 0xe2 at byte 3 of the line)"),  # cut short
    (b"99999999999999999999999", "input line 2: token id 99999999999999999999999 is outside the source "
                                 "vocabulary [0, 64)"),
    (b"5 64", "input line 2: token id 64 is outside the source vocabulary [0, 64)"),
    (b"1_0", "input line 2: '1_0' is not a token id (ASCII digits 0-9 only)"),
    ("\u0665".encode(), "input line 2: '\u0665' is not a token id (ASCII digits 0-9 only)"),
    (b"-5", "input line 2: '-5' is not a token id (ASCII digits 0-9 only)"),
    (b"5,6", "input line 2: '5,6' is not a token id (ASCII digits 0-9 only)"),
])
def test_bad_stdin_is_refused_naming_the_line(command, line, message, checkpoint, monkeypatch, capsys):
    feed_stdin(monkeypatch, b"5 6 7\n" + line + b"\n8 9\n")
    assert main([command, "--checkpoint", checkpoint]) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert err.count("\n") == 1 and err.startswith(f"rosetta: error: {message}"), err
    assert captured.out == ""  # nothing printed for the lines before it either


@pytest.mark.parametrize("command", ["generate", "translate"])
def test_good_stdin_gives_one_output_line_per_input_line(command, checkpoint, monkeypatch, capsys):
    # CRLF endings, leading zeros, the largest id, tabs between ids: all fine.
    feed_stdin(monkeypatch, b"5 6 7\r\n0005\t63\r\n9\n")
    assert main([command, "--checkpoint", checkpoint, "--beam", "2", "--margin", "2"]) == 0
    out = capsys.readouterr().out.split("\n")
    assert len(out) == 4 and out[-1] == ""
    assert all(all(token.isdigit() for token in line.split()) for line in out)


def test_generate_refuses_a_line_longer_than_max_len(checkpoint, monkeypatch, capsys):
    feed_stdin(monkeypatch, b"5 6\n" + b"7 " * 17 + b"\n")
    assert main(["generate", "--checkpoint", checkpoint]) == 2
    assert one_line_error(capsys) == ("rosetta: error: input line 2 has 17 tokens, more than the model's "
                                      "max_len 16")


def test_real_stdin_with_invalid_utf8_is_one_line_not_a_traceback(checkpoint):
    for command in ("generate", "translate"):
        done = subprocess.run([sys.executable, "-m", "rosetta.cli", command, "--checkpoint", checkpoint],
                              input=b"5 6\n\xc3\x28\n", capture_output=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert done.stderr.decode() == ("rosetta: error: input line 2 is not valid UTF-8 (byte 0xc3 at "
                                        "byte 1 of the line)\n")


def test_parity_lengths_beyond_max_len_and_memory_exhaustion_are_one_line(monkeypatch, capsys):
    assert main(["parity", "--preset", "tiny", "--src-len", "129"]) == 2  # tiny: max_len 128
    assert one_line_error(capsys) == "rosetta: error: --src-len 129 is longer than the model's max_len 128"

    def exhausted(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr("rosetta.parity.parity_report", exhausted)
    assert main(["parity", "--preset", "tiny", "--batch", "100000000"]) == 2
    assert one_line_error(capsys).startswith("rosetta: error: out of memory")
