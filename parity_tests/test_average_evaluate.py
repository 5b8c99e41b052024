"""`rosetta average` (paper §6.1 checkpoint averaging) and `rosetta evaluate` (sacreBLEU + chrF).

Expected values come from elsewhere than the code under test: the float64 mean computed here
(and rounded by PyTorch, not ml_dtypes), sacrebleu's own `corpus_bleu` / `corpus_chrf` on the
hypotheses read back from --hyps, and a perfect oracle whose BLEU and chrF are 100 by definition.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import sacrebleu
import torch

from rosetta import init_params, preset
from rosetta.backends import load
from rosetta.checkpoint import DTYPES, load_checkpoint, save_checkpoint
from rosetta.errors import RosettaError
from rosetta.files import atomic_write_bytes
from rosetta.generation import Generation
from rosetta.harness.average import average_checkpoints, resolve_checkpoints
from rosetta.harness.commands import add_parsers
from rosetta.harness.data import default_data_dir, load_multi30k
from rosetta.harness.evaluate import FORMAT, evaluate_model
from rosetta.harness.run_dir import checkpoint_name, save_checkpoint_dir
from rosetta.tokenizer import Tokenizer


def cli(argv: list[str]) -> int:
    """`rosetta ARGV` as main() runs it: through rosetta.cli once it registers these commands,
    else through a parser holding only them; a rosetta error prints one line and gives 2."""
    from rosetta import cli as rosetta_cli

    parser = rosetta_cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if argv[0] in commands.choices:
        return rosetta_cli.main(argv)
    parser = rosetta_cli._Parser(prog="rosetta")
    add_parsers(parser.add_subparsers(dest="command", required=True))
    try:
        args = parser.parse_args(argv)
        return args.func(args)
    except RosettaError as e:
        print(f"rosetta: error: {e}", file=sys.stderr)
        return 2


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("rosetta: error: ") and err.count("\n") == 1, err
    return err


def random_params(cfg, seed: int) -> dict[str, np.ndarray]:
    """Initial weights with every tensor perturbed (init leaves biases at zero, norms at one)."""
    rng = np.random.default_rng(seed)
    return {k: (v + rng.normal(0, 0.1, v.shape)).astype(np.float32)
            for k, v in init_params(cfg, seed).items()}


def make_run(root: Path, cfg, params_by_step: dict[int, dict], dtype: str = "float32",
             tokenizer: Tokenizer | None = None, run_args: dict | None = None) -> Path:
    """A run directory in rosetta/harness/run_dir.py's layout, one checkpoint per step."""
    for step, params in params_by_step.items():
        def write(tmp: Path, step=step, params=params) -> None:
            save_checkpoint(tmp / "model.safetensors", cfg, params, dtype, {"step": str(step)})
            atomic_write_bytes(tmp / "state.json", json.dumps({"step": step}).encode())
            if tokenizer is not None:
                tokenizer.save(tmp / "tokenizer.json")
        save_checkpoint_dir(root / "checkpoints", step, write)
    if run_args is not None:
        atomic_write_bytes(root / "run.json", json.dumps({"args": run_args}).encode())
    return root


def bits(params: dict) -> dict[str, bytes]:
    return {k: np.ascontiguousarray(v).tobytes() for k, v in params.items()}


# -- rosetta average -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_identical_checkpoints_average_to_themselves_bit_for_bit(tmp_path, dtype):
    cfg = preset("tiny")
    params = random_params(cfg, 0)
    paths = [save_checkpoint(tmp_path / f"copy{i}.safetensors", cfg, params, dtype) for i in range(5)]
    config, averaged = average_checkpoints(paths)
    assert config == cfg
    stored = load_checkpoint(paths[0]).params
    assert bits(averaged) == bits(stored)
    assert all(v.dtype == DTYPES[dtype] for v in averaged.values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_average_of_two_is_their_float64_mean(tmp_path, dtype):
    cfg = preset("tiny")
    a, b = random_params(cfg, 1), random_params(cfg, 2)
    pa = save_checkpoint(tmp_path / "a.safetensors", cfg, a, dtype)
    pb = save_checkpoint(tmp_path / "b.safetensors", cfg, b, dtype)
    assert cli(["average", str(pa), str(pb), "--out", str(tmp_path / "avg.safetensors")]) == 0
    out = load_checkpoint(tmp_path / "avg.safetensors")
    assert out.dtype == dtype and out.config == cfg
    stored_a, stored_b = load_checkpoint(pa).params, load_checkpoint(pb).params
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    for name, value in out.params.items():
        mean = (stored_a[name].astype(np.float64) + stored_b[name].astype(np.float64)) / 2
        # Rounded to the stored type by PyTorch, an independent implementation of the cast.
        expected = torch.from_numpy(mean).to(torch_dtype).to(torch.float64).numpy()
        np.testing.assert_array_equal(value.astype(np.float64), expected, err_msg=name)
    assert json.loads(out.metadata["averaged_from"]) == [str(pa), str(pb)]
    assert out.metadata["averaged_count"] == "2"


def test_float64_sum_does_not_depend_on_the_order(tmp_path):
    # Values a float16 sum would round differently in each order: 2048 + 1 + 1 (float16 keeps 11 bits).
    cfg = preset("tiny")
    base = random_params(cfg, 3)
    name = "decoder.layers.0.ffn.w1.bias" if "decoder.layers.0.ffn.w1.bias" in base else next(iter(base))
    paths = []
    for i, x in enumerate([2048.0, 1.0, 1.0]):
        params = dict(base)
        params[name] = np.full_like(base[name], x)
        paths.append(save_checkpoint(tmp_path / f"{i}.safetensors", cfg, params, "float16"))
    forward = average_checkpoints(paths)[1][name]
    backward = average_checkpoints(paths[::-1])[1][name]
    np.testing.assert_array_equal(forward, backward)
    np.testing.assert_array_equal(forward.astype(np.float64), np.float16(2050 / 3))


def test_run_directory_averages_its_last_checkpoints(tmp_path, capsys):
    cfg = preset("tiny")
    by_step = {step: random_params(cfg, step) for step in (100, 200, 300, 400, 500, 600)}
    run = make_run(tmp_path / "run", cfg, by_step)
    out = tmp_path / "avg.safetensors"
    assert cli(["average", str(run), "--out", str(out)]) == 0  # default: the paper's last 5
    averaged = load_checkpoint(out)
    assert json.loads(averaged.metadata["averaged_steps"]) == [200, 300, 400, 500, 600]
    for name, value in averaged.params.items():
        mean = np.mean([load_checkpoint(run / "checkpoints" / checkpoint_name(s) / "model.safetensors")
                        .params[name].astype(np.float64) for s in (200, 300, 400, 500, 600)], axis=0)
        np.testing.assert_array_equal(value, mean.astype(np.float32), err_msg=name)
    assert cli(["average", str(run), "--last", "2", "--out", str(out)]) == 0
    assert json.loads(load_checkpoint(out).metadata["averaged_steps"]) == [500, 600]
    assert cli(["average", str(run), "--last", "9", "--out", str(out)]) == 0  # fewer kept: a note
    assert "holds 6 checkpoint(s), fewer than the 9 asked for" in capsys.readouterr().err
    # The latest pointer and a checkpoint directory name one checkpoint each.
    latest, first = run / "checkpoints" / "latest", run / "checkpoints" / checkpoint_name(100)
    resolved = resolve_checkpoints([latest, first])
    assert resolved.paths == [run / "checkpoints" / checkpoint_name(600) / "model.safetensors",
                              first / "model.safetensors"]


def test_mismatched_or_bad_inputs_are_refused_by_name(tmp_path, capsys):
    cfg = preset("tiny")
    a = save_checkpoint(tmp_path / "a.safetensors", cfg, random_params(cfg, 0))
    wider = preset("tiny", d_ff=128)
    b = save_checkpoint(tmp_path / "b.safetensors", wider, random_params(wider, 0))
    c = save_checkpoint(tmp_path / "c.safetensors", cfg, random_params(cfg, 1), "bfloat16")
    out = str(tmp_path / "out.safetensors")
    assert cli(["average", str(a), str(b), "--out", out]) == 2
    assert "different configs (d_ff 128 vs 64)" in error_line(capsys)
    assert cli(["average", str(a), str(c), "--out", out]) == 2
    assert "stored as bfloat16" in error_line(capsys)
    assert cli(["average", str(a), str(tmp_path / "a.safetensors"), "--out", out]) == 2
    assert "named twice" in error_line(capsys)
    assert cli(["average", str(a), str(tmp_path / "missing.safetensors"), "--out", out]) == 2
    assert "missing.safetensors" in error_line(capsys)
    (tmp_path / "junk.safetensors").write_bytes(b"not a checkpoint at all")
    assert cli(["average", str(a), str(tmp_path / "junk.safetensors"), "--out", out]) == 2
    assert "junk.safetensors: not a valid safetensors file" in error_line(capsys)
    assert cli(["average", str(a), "--last", "3", "--out", out]) == 2
    assert "--last counts the checkpoints of a run directory" in error_line(capsys)
    assert cli(["average", str(a), str(c), "--out", str(tmp_path / "c.safetensors")]) == 2
    assert "is one of the checkpoints being averaged" in error_line(capsys)  # never overwrites an input
    assert cli(["average", str(tmp_path), "--out", out]) == 2
    assert "neither a checkpoint file" in error_line(capsys)
    assert not Path(out).exists()


def test_the_average_loads_in_every_backend(tmp_path, backend):
    cfg = preset("tiny")
    paths = [save_checkpoint(tmp_path / f"{i}.safetensors", cfg, random_params(cfg, i)) for i in range(3)]
    out = tmp_path / "avg.safetensors"
    assert cli(["average", *map(str, paths), "--out", str(out)]) == 0
    expected = average_checkpoints(paths)[1]
    model = load(out, backend)
    got = model.to_params()
    for name, value in expected.items():
        np.testing.assert_array_equal(np.asarray(got[name], dtype=np.float64), value.astype(np.float64))
    src = np.array([[5, 6, 7, 2]])
    ref = load(out, "numpy").logits(src, np.array([[1, 8, 9]]))
    np.testing.assert_allclose(model.logits(src, np.array([[1, 8, 9]])), ref, rtol=1e-4, atol=1e-4)


# -- rosetta evaluate ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    """A Multi30k de-en run with random weights: a joint BPE of 400 ids on 300 training pairs."""
    if not (default_data_dir() / "test_2016_flickr.de.gz").is_file():
        pytest.fail(f"Multi30k files not found in {default_data_dir()}: a failure, not a skip", pytrace=False)
    train = load_multi30k("train", "de", "en")[:300]
    tokenizer = Tokenizer.train([s for pair in train for s in pair], vocab_size=400)
    cfg = preset("tiny", src_vocab_size=tokenizer.vocab_size, tgt_vocab_size=tokenizer.vocab_size)
    root = tmp_path_factory.mktemp("evaluate")
    run = make_run(root / "run", cfg, {10: random_params(cfg, 10)}, tokenizer=tokenizer,
                   run_args={"task": "multi30k", "pair": "de-en"})
    return run, tokenizer, cfg


class Oracle:
    """A stand-in for a BackendModel whose output for each source is a given target: the
    reference (a perfect system) or anything else, found by the source's token ids."""

    def __init__(self, cfg, table: dict[tuple[int, ...], list[int]]):
        self.config, self.table = cfg, table

    def generate(self, src, beam_size=1, alpha=0.6, max_len_margin=50, length_rule="wu") -> Generation:
        rows = [tuple(int(t) for t in row if t != self.config.pad_id) for row in src]
        return Generation([self.table[row] for row in rows], np.zeros(len(rows)))


def test_a_perfect_system_scores_100_and_pairs_stay_aligned(text_model):
    _, tokenizer, cfg = text_model
    pairs = load_multi30k("test_2016_flickr", "de", "en")[:12]
    sources, refs = [s for s, _ in pairs], [t for _, t in pairs]

    def oracle(outputs: list[str]) -> Oracle:
        return Oracle(cfg, {tuple(tokenizer.encode(s) + [cfg.eos_id]): tokenizer.encode(o)
                            for s, o in zip(sources, outputs, strict=True)})

    result = evaluate_model(oracle(refs), tokenizer, sources, refs, beam=4, alpha=0.6, batch_size=5)
    assert result["hypotheses"] == refs
    assert result["bleu"]["score"] == pytest.approx(100.0) and result["chrf"]["score"] == pytest.approx(100.0)
    # Half the outputs shifted by one: the scores are sacrebleu's on exactly those lines.
    shifted = [refs[(i + 1) % len(refs)] if i % 2 else r for i, r in enumerate(refs)]
    result = evaluate_model(oracle(shifted), tokenizer, sources, refs, batch_size=5)
    assert result["hypotheses"] == shifted
    assert result["bleu"]["score"] == pytest.approx(sacrebleu.corpus_bleu(shifted, [refs]).score, abs=1e-12)
    assert result["chrf"]["score"] == pytest.approx(sacrebleu.corpus_chrf(shifted, [refs]).score, abs=1e-12)
    assert 0 < result["bleu"]["score"] < 100


def test_evaluate_scores_are_sacrebleus_on_the_written_hypotheses(text_model, tmp_path, backend, capsys):
    run, _, _ = text_model
    out, hyps = tmp_path / "eval.json", tmp_path / "hyps.txt"
    assert cli(["evaluate", str(run), "--split", "test_2016_flickr", "--pair", "de-en", "--beam", "2",
                "--alpha", "0.6", "--margin", "4", "--limit", "6", "--backend", backend, "--batch-size", "4",
                "--hyps", str(hyps), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text(encoding="utf-8"))
    lines = hyps.read_text(encoding="utf-8").split("\n")
    assert lines[-1] == "" and len(lines) == 7
    hypotheses = lines[:-1]
    refs = [t for _, t in load_multi30k("test_2016_flickr", "de", "en")[:6]]
    bleu_metric, chrf_metric = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    bleu, chrf = sacrebleu.corpus_bleu(hypotheses, [refs]), sacrebleu.corpus_chrf(hypotheses, [refs])
    bleu_metric.corpus_score(hypotheses, [refs]), chrf_metric.corpus_score(hypotheses, [refs])
    assert report["bleu"]["score"] == pytest.approx(bleu.score, abs=1e-12)
    assert report["chrf"]["score"] == pytest.approx(chrf.score, abs=1e-12)
    assert report["bleu"]["signature"] == str(bleu_metric.get_signature())
    assert report["chrf"]["signature"] == str(chrf_metric.get_signature())
    assert "tok:13a" in report["bleu"]["signature"] and "case:mixed" in report["bleu"]["signature"]
    expected = {"format": FORMAT, "split": "test_2016_flickr", "pair": "de-en", "beam": 2, "alpha": 0.6,
                "backend": backend, "sentences": 6, "limit": 6, "hypotheses": str(hyps),
                "checkpoint": str(run / "checkpoints" / checkpoint_name(10) / "model.safetensors")}
    assert {k: report[k] for k in expected} == expected
    assert report["bleu"]["counts"] == bleu.counts and report["bleu"]["totals"] == bleu.totals
    assert report["tokenizer"].endswith("tokenizer.json")
    assert report["bleu"]["signature"] in printed and f"wrote {out}" in printed


def test_evaluate_refuses_bad_input_by_name(text_model, tmp_path, capsys):
    run, _, _ = text_model
    out = str(tmp_path / "eval.json")
    base = ["evaluate", str(run), "--limit", "2", "--margin", "2", "--out", out]
    assert cli([*base, "--split", "test_2018"]) == 2
    assert "unknown Multi30k split 'test_2018'" in error_line(capsys)
    assert cli([*base, "--pair", "de-xx"]) == 2
    assert "--pair must be two different languages" in error_line(capsys)
    assert cli([*base, "--pair", "fr-en"]) == 2
    assert "--pair fr-en: the run was trained on de-en" in error_line(capsys)
    assert cli([*base, "--data-dir", str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in error_line(capsys) and not Path(out).exists()
    empty = tmp_path / "data"
    empty.mkdir()
    assert cli([*base, "--data-dir", str(empty)]) == 2
    assert "test_2016_flickr.de.gz' does not exist" in error_line(capsys)
    ckpt = run / "checkpoints" / checkpoint_name(10) / "model.safetensors"
    assert cli(["evaluate", str(ckpt), "--out", out]) == 2
    assert "give its --tokenizer" in error_line(capsys)
    assert cli(["evaluate", str(ckpt), "--tokenizer", str(tmp_path / "tok.json"), "--out", out]) == 2
    assert "tok.json' does not exist" in error_line(capsys)
    assert cli(["evaluate", str(tmp_path / "no-run"), "--out", out]) == 2
    assert "no-run: no such checkpoint file or model directory" in error_line(capsys)
    synthetic = make_run(tmp_path / "copy", preset("tiny"), {5: random_params(preset("tiny"), 5)},
                         run_args={"task": "copy", "pair": "de-en"})
    assert cli(["evaluate", str(synthetic), "--out", out]) == 2
    assert "no tokenizer.json" in error_line(capsys)
    assert not Path(out).exists()

