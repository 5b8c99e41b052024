"""One reader for untrusted JSON (issue 39, rosetta/json_input.py): every hostile JSON file is refused
in one line naming the file (the line of a JSON Lines file) and the field, exit 2, nothing written.

The bounds' expected values come from JSON's grammar and Python's own limits, not from the reader:
a nesting of 100,000 is far past Python's recursion limit (1,000), an integer of 401 digits is past
float's range (1.8e308 has 309 digits), one of 5,001 digits past int()'s default 4,300-digit limit."""

from __future__ import annotations

import io
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from parity_tests.test_diff_training import assert_refused
from rosetta.config import preset
from rosetta.errors import RosettaError, TokenizerError
from rosetta.params import init_params, param_shapes

DEEP = "[" * 100_000 + "]" * 100_000


# -- the reader's bounds ---------------------------------------------------------------------------

@pytest.mark.parametrize("text,message", [
    ("[" * 65 + "]" * 65, "nested too deeply (65 levels, at most 64)"),
    (DEEP, "nested too deeply (100,000 levels"),
    ('{"a": ' + "[" * 100_000, "nested too deeply"),  # cut off, as deep: refused before parsing
    ("9" * 401, "an integer of 401 digits (at most 40)"),
    ('{"loss": -' + "9" * 5001 + "}", "an integer of 5,001 digits"),
    ("1e309", "out of range"),
    ('{"a": 1, "a": 2}', "duplicate key 'a'"),
    ("[NaN]", "NaN is not a JSON number"),
])
def test_the_reader_refuses_what_python_would_crash_on_or_misread(text, message):
    from rosetta.json_input import JSONRefused, loads

    with pytest.raises(JSONRefused) as err:
        loads(text)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_bounds_admit_what_real_files_hold():
    from rosetta.json_input import loads

    assert loads("[" * 64 + "]" * 64) is not None
    # brackets inside strings (escaped quotes too) are text, not nesting
    assert loads('{"a": "' + "[" * 100 + '\\"", "b": ["]]"]}')["b"] == ["]]"]
    # transformers' "no limit" sentinel, int(1e30), in tokenizer_config.json files
    assert loads('{"model_max_length": 1000000000000000019884624838656}')["model_max_length"] == int(1e30)
    assert loads("[NaN, -Infinity]", nonfinite=True)[1] == float("-inf")


def test_depth_is_counted_without_recursion():
    from rosetta.json_input import nesting_depth

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(100)  # nothing that recursed per level could count 10^6 levels under this
    try:
        start = time.perf_counter()
        assert nesting_depth("[" * 10**6 + "]" * 10**6) == 10**6
    finally:
        sys.setrecursionlimit(limit)
    assert time.perf_counter() - start < 2.0


def test_a_file_over_its_limit_is_refused_from_its_size_before_it_is_read(tmp_path):
    from rosetta.json_input import read_json

    path = tmp_path / "big.json"
    with path.open("wb") as f:
        f.truncate(10**12)  # a sparse terabyte: reading it would never end
    with pytest.raises(RosettaError, match=r"big.json: 1,000,000,000,000 bytes, more than a model config"):
        read_json(path, "a model config", limit=2**20)


def test_json_lines_name_the_line_and_stay_bounded(tmp_path):
    from rosetta.json_input import read_json_lines

    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": ' + b"7" * 401 + b"}\n")
    with pytest.raises(RosettaError, match=r"x.jsonl: line 2: JSON refused: an integer of 401 digits"):
        list(read_json_lines(path, 4096, "a record"))
    path.write_bytes(b'{"a": 1}\n' + b"1" * 10**6)
    with pytest.raises(RosettaError, match="line 2 is longer than a record"):
        list(read_json_lines(path, 4096, "a record"))
    path.write_bytes(b'{"a": 1}\n{"a": 2')  # a killed writer's torn last line
    with pytest.raises(RosettaError, match="line 2 is cut off"):
        list(read_json_lines(path, 4096, "a record"))
    assert list(read_json_lines(path, 4096, "a record", cut_off=None)) == [(1, {"a": 1})]


# -- schemas ---------------------------------------------------------------------------------------

def test_a_schema_names_the_field_and_json_types():
    from rosetta.json_input import check_schema, field

    schema = {"n": field("integer", required=True), "flag": field("boolean"),
              "dtype": field("string", "null", choices=("float32",)),
              "args": field("object", fields={"pair": field("string")})}
    check_schema({"n": 3, "dtype": None, "args": {"pair": "de-en"}}, schema, "f.json")
    for data, message in [({}, "f.json: missing required field n"),
                          ({"n": True}, "n must be an integer, got boolean true"),
                          ({"n": 1.0}, "n must be an integer, got a number 1.0"),
                          ({"n": 1, "flag": "yes"}, "flag must be a boolean, got a string 'yes'"),
                          ({"n": 1, "dtype": "garbage"}, "dtype must be one of float32, got a string"),
                          ({"n": 1, "args": {"pair": 7}}, "args.pair must be a string, got an integer 7")]:
        with pytest.raises(RosettaError) as err:
            check_schema(data, schema, "f.json")
        assert message in str(err.value), str(err.value)


# -- Marian config.json through translate, convert and diff ------------------------------------------

@pytest.fixture(scope="module")
def marian_dir(tmp_path_factory):
    from rosetta.interop import marian

    cfg = preset("tiny", num_encoder_layers=1, num_decoder_layers=1, positional_encoding="sinusoidal_concat")
    return Path(marian.write_marian(tmp_path_factory.mktemp("marian") / "opus-mt", cfg, init_params(cfg)))


def _with_config(marian_dir: Path, tmp_path: Path, text: str) -> Path:
    copy = tmp_path / "opus-mt"
    shutil.copytree(marian_dir, copy)
    (copy / "config.json").write_text(text)
    return copy


def _config_text(marian_dir: Path, **changes) -> str:
    return json.dumps({**json.loads((marian_dir / "config.json").read_text()), **changes})


@pytest.mark.parametrize("command", ["translate", "convert", "diff"])
def test_a_deeply_nested_marian_config_is_refused_by_every_command(command, marian_dir, tmp_path, capsys,
                                                                   monkeypatch):
    # 100,000 levels used to reach json's recursion: a RecursionError traceback in all three.
    bad = _with_config(marian_dir, tmp_path, _config_text(marian_dir)[:-1] + ', "x": ' + DEEP + "}")
    out = tmp_path / "x.safetensors"
    argv = {"translate": ["translate", "--checkpoint", str(bad)],
            "convert": ["convert", str(bad), str(out)],
            "diff": ["diff", f"{bad}@transformers", f"{bad}@numpy"]}[command]
    monkeypatch.setattr(sys, "stdin", io.StringIO("5 6 7\n"))
    assert_refused(argv, f"{bad / 'config.json'}: JSON refused: nested too deeply", capsys)
    assert not out.exists() and not out.with_suffix(".tokenizer").exists()


def test_a_huge_marian_config_is_refused_by_its_size(marian_dir, tmp_path, capsys):
    bad = _with_config(marian_dir, tmp_path, "")
    with (bad / "config.json").open("wb") as f:
        f.truncate(2**31)  # sparse: only its size says what it is
    assert_refused(["convert", str(bad), str(tmp_path / "x.safetensors")],
                   f"{bad / 'config.json'}: 2,147,483,648 bytes, more than a model config may hold", capsys)


@pytest.mark.parametrize("changes,message", [
    ({"scale_embedding": "yes"}, "scale_embedding must be a boolean, got a string 'yes'"),
    ({"eos_token_id": None}, "eos_token_id must be an integer, got null"),
    ({"pad_token_id": None}, "pad_token_id must be an integer, got null"),
    ({"decoder_vocab_size": 7}, "decoder_vocab_size 7 must equal vocab_size 64 when "
                                "share_encoder_decoder_embeddings is true"),
    ({"decoder_vocab_size": 10**9}, "decoder_vocab_size must be in [1, 2,097,152]"),
    ({"decoder_vocab_size": "64"}, "decoder_vocab_size must be an integer or null, got a string '64'"),
    ({"d_model": 10**400}, "JSON refused: an integer of 401 digits"),
    ({"vocab_size": 64.0}, "vocab_size must be an integer, got a number 64.0"),
    ({"dropout": "0.1"}, "dropout must be a number, got a string '0.1'"),
    ({"tie_word_embeddings": 1}, "tie_word_embeddings must be a boolean, got an integer 1"),
    ({"activation_function": "tanh"}, "activation_function 'tanh': rosetta's model cannot compute it"),
])
def test_marian_config_fields_of_the_wrong_type_or_size_are_refused(changes, message, marian_dir, tmp_path,
                                                                     capsys):
    bad = _with_config(marian_dir, tmp_path, _config_text(marian_dir, **changes))
    out = tmp_path / "x.safetensors"
    err = assert_refused(["convert", str(bad), str(out)], message, capsys)
    assert "config.json" in err
    assert not out.exists()


def test_an_unshared_decoder_vocabulary_may_differ(marian_dir, tmp_path):
    """decoder_vocab_size is the target vocabulary when the tables are separate: accepted."""
    from rosetta.interop.marian import config_from_marian

    hf = json.loads(_config_text(marian_dir, share_encoder_decoder_embeddings=False,
                                 tie_word_embeddings=False, decoder_vocab_size=48))
    cfg = config_from_marian(hf)
    assert (cfg.src_vocab_size, cfg.tgt_vocab_size, cfg.share_embeddings) == (64, 48, "none")


# -- training traces through `rosetta diff` ---------------------------------------------------------

@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    """A two-step trace (the first stored whole) with one evaluation, written from NumPy arrays."""
    from rosetta.diff.training.trace import TraceWriter

    cfg = preset("tiny", num_encoder_layers=1, num_decoder_layers=1)
    params = init_params(cfg, 0)
    grads = {n: np.full(s, 0.01, np.float32) for n, s in param_shapes(cfg).items()}
    ids = np.array([[1, 5, 6, 2]]), np.array([[1, 7, 8]]), np.array([[7, 8, 2]])
    path = tmp_path_factory.mktemp("trace") / "good"
    with TraceWriter(path, cfg, full_steps=1, train_config={"warmup": 4}) as writer:
        writer.start(params)
        for k in (1, 2):
            writer.step(k, *ids, 3.0 - k, 1e-3 * k, grads, params)
        writer.evaluation(2, *ids, 1.5)
    return path


def _edit_line(path: Path, number: int, key: str, raw: str) -> None:
    """Line `number` of a JSON Lines file with `key`'s value replaced by the raw text `raw`."""
    lines = path.read_text().splitlines()
    record = json.loads(lines[number - 1])
    record[key] = "@@"
    lines[number - 1] = json.dumps(record).replace('"@@"', raw)
    path.write_text("\n".join(lines) + "\n")


def _edit_header(path: Path, **changes) -> None:
    header = json.loads((path / "trace.json").read_text())
    (path / "trace.json").write_text(json.dumps({**header, **changes}))


BAD_TRACES = {
    "401-digit loss": (lambda p: _edit_line(p / "steps.jsonl", 2, "loss", "9" * 401),
                       "steps.jsonl: line 2: JSON refused: an integer of 401 digits"),
    "5001-digit lr": (lambda p: _edit_line(p / "steps.jsonl", 1, "lr", "1" * 5001),
                      "steps.jsonl: line 1: JSON refused: an integer of 5,001 digits"),
    "nested step": (lambda p: _edit_line(p / "steps.jsonl", 2, "loss", "[" * 100 + "]" * 100),
                    "steps.jsonl: line 2: JSON refused: nested too deeply"),
    "duplicate key": (lambda p: _edit_line(p / "steps.jsonl", 1, "loss", '1, "loss": 2'),
                      "steps.jsonl: line 1: JSON refused: duplicate key 'loss'"),
    "401-digit eval loss": (lambda p: _edit_line(p / "evals.jsonl", 1, "loss", "9" * 401),
                            "evals.jsonl: line 1: JSON refused: an integer of 401 digits"),
    "train_config a string": (lambda p: _edit_header(p, train_config="warmup=4"),
                              "trace.json: train_config must be an object or null, got a string"),
    "compute_dtype garbage": (lambda p: _edit_header(p, compute_dtype="garbage"),
                              "trace.json: compute_dtype must be one of bfloat16, float16, float32, float64"),
    "compute_dtype 7": (lambda p: _edit_header(p, compute_dtype=7),
                        "trace.json: compute_dtype must be a string or null, got an integer 7"),
    "full_steps a string": (lambda p: _edit_header(p, full_steps="1"),
                            "trace.json: full_steps must be an integer, got a string '1'"),
    "header 20 MB": (lambda p: (p / "trace.json").open("ab").truncate(20 * 2**20),
                     "trace.json: 20,971,520 bytes, more than a trace header may hold"),
}


@pytest.mark.parametrize("name", sorted(BAD_TRACES))
def test_hostile_trace_json_is_refused_naming_file_line_and_field(name, trace, tmp_path, capsys):
    change, message = BAD_TRACES[name]
    bad = tmp_path / "bad"
    shutil.copytree(trace, bad)
    change(bad)
    for argv in (["diff", str(bad), str(trace)], ["diff", str(trace), str(bad), "--diagnose"]):
        assert_refused(argv, message, capsys)


def test_the_writer_refuses_what_the_reader_would(tmp_path):
    from rosetta.diff.training.trace import TraceWriter

    message = "compute_dtype must be one of bfloat16, float16, float32, float64 or None"
    with pytest.raises(RosettaError, match=message):
        TraceWriter(tmp_path / "t", preset("tiny"), compute_dtype="garbage")
    assert not (tmp_path / "t").exists()


def test_the_good_trace_reads(trace):
    from rosetta.diff.training.trace import read_trace

    read = read_trace(trace)
    assert (len(read), read.full_steps, read.train_config, read.compute_dtype) == (2, 1, {"warmup": 4}, None)


# -- tokenizer files, run files, flags, results ---------------------------------------------------------

@pytest.mark.parametrize("config,message", [
    ({"separate_vocabs": "false"}, "separate_vocabs must be a boolean, got a string 'false'"),
    ({"eos_token": {"content": "</s>"}}, "eos_token must be a string or null, got an object"),
    ({"model_max_length": 10**400}, "JSON refused: an integer of 401 digits"),
])
def test_a_hostile_tokenizer_config_is_refused_naming_the_field(config, message, tmp_path):
    from rosetta.tokenizer import SentencePieceTokenizer

    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError) as err:
        SentencePieceTokenizer(tmp_path)
    assert "tokenizer_config.json" in str(err.value) and message in str(err.value), str(err.value)


def test_a_tokenizer_file_is_bounded_before_the_library_reads_it(tmp_path):
    from rosetta.tokenizer import Tokenizer

    path = tmp_path / "tokenizer.json"
    path.write_text('{"model": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(TokenizerError, match="tokenizer.json: JSON refused: nested too deeply"):
        Tokenizer.load(path)


def test_run_files_are_read_bounded_and_typed(tmp_path):
    from rosetta.harness.report import RUN_SCHEMA, read_json, read_log

    run = tmp_path / "run.json"
    run.write_text(json.dumps({"backend": "torch", "args": "task=copy"}))
    with pytest.raises(RosettaError, match="run.json: args must be an object, got a string"):
        read_json(run, RUN_SCHEMA)
    run.write_text(json.dumps({"args": {"pair": ["de", "en"]}}))
    with pytest.raises(RosettaError, match="run.json: args.pair must be a string or null, got an array"):
        read_json(run, RUN_SCHEMA)
    log = tmp_path / "log.jsonl"
    first = '{"kind": "train", "step": 1, "loss": NaN}\n'  # a diverged step: NaN reads as NaN
    log.write_text(first + '{"kind": "train", "loss": ' + "9" * 5001 + "}\n")
    with pytest.raises(RosettaError, match="log.jsonl: line 2: JSON refused: an integer of 5,001 digits"):
        read_log(log)
    log.write_text(first + '{"kind": "tr')  # a killed writer's last line
    assert [r["step"] for r in read_log(log)] == [1]


@pytest.mark.parametrize("value,message", [
    ("NaN", "--set dropout: NaN is not a JSON number"),
    ("1e400", "--set dropout: number 1e400 is out of range"),
    ("9" * 401, "--set dropout: an integer of 401 digits"),
])
def test_set_values_are_read_by_the_same_rules(value, message, marian_dir, tmp_path, capsys):
    out = tmp_path / "x.safetensors"
    assert_refused(["convert", str(marian_dir), str(out), "--set", f"dropout={value}"], message, capsys)
    assert not out.exists()


def test_benchmark_results_files_go_through_the_reader(tmp_path):
    from benchmarks import pitfalls, report

    path = tmp_path / "results.json"
    path.write_text('{"rows": ' + DEEP + "}")
    with pytest.raises(SystemExit, match="results.json: JSON refused: nested too deeply"):
        report.load(path)
    path.write_text('{"rows": 7, "environment": {}, "settings": {}, "wall_s": 1}')
    with pytest.raises(SystemExit, match="results.json: rows must be an array, got an integer 7"):
        pitfalls.load(path)
