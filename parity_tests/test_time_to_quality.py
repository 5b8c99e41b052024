"""Time to quality (docs/training.md): `--time-budget` stops cleanly and leaves a resumable run,
`--target-bleu` stops at the first evaluation at or above the target, `--recipe` supplies
defaults that flags override. Expected values come from an uninterrupted run of the same settings."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from rosetta.checkpoint import load_checkpoint
from rosetta.cli import build_parser
from rosetta.errors import RosettaError
from rosetta.harness.commands import run_from_args
from rosetta.harness.loop import RunConfig, check_run, train
from rosetta.harness.recipes import RECIPES

pytestmark = pytest.mark.trainable

NO_DROPOUT = {"dropout": 0.0, "attention_dropout": 0.0}
# 40 steps of a short copy task: BLEU leaves 0 at step 30 on this machine (the exact curve does not
# matter: every run here is compared with the uninterrupted one, and training is deterministic).
RUN = dict(backends=("torch",), task="copy", max_tokens=512, buckets=(24,), train_size=2000, eval_size=32,
           bleu_samples=16, synthetic_max_len=8, warmup=50, lr_factor=1.0, progress=False, device="cpu",
           overrides=NO_DROPOUT, steps=40, eval_every=5, checkpoint_every=5)


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "torch" / "log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("whole")
    train(RunConfig(out=str(out), **RUN))
    return out


def test_target_bleu_stops_at_the_first_evaluation_at_the_target(whole, tmp_path):
    evals = [r for r in _log(whole) if r["kind"] == "eval"]
    target = max(e["bleu"] for e in evals)
    assert target > 0, "no evaluation of the uninterrupted run has BLEU above 0: nothing to aim at"
    first = next(e for e in evals if e["bleu"] >= target)
    assert first["step"] < RUN["steps"]
    result = train(RunConfig(out=str(tmp_path), target_bleu=target, **RUN))["torch"]
    got = [r for r in _log(tmp_path) if r["kind"] == "eval"]
    assert [e["step"] for e in got] == [e["step"] for e in evals if e["step"] <= first["step"]]
    assert got[-1]["bleu"] == pytest.approx(first["bleu"])  # the same run up to there
    assert result["stopped_by"] == "target_bleu" and result["steps"] == first["step"]
    assert result["time_to_target"]["step"] == first["step"] and result["target_bleu"] == target
    assert (tmp_path / "torch" / "checkpoints" / "latest").read_text().strip() == f"step-{first['step']:08d}"


def test_time_budget_stops_cleanly_and_the_run_resumes_to_the_same_weights(whole, tmp_path):
    budget = 1e-6  # minutes (60 µs): the first step already overruns it
    result = train(RunConfig(out=str(tmp_path), time_budget=budget, **RUN))["torch"]
    assert result["stopped_by"] == "time_budget" and result["steps"] == 1
    records = _log(tmp_path)
    assert [r["kind"] for r in records] == ["train", "eval"]  # the last step, then its evaluation
    assert (tmp_path / "torch" / "checkpoints" / "latest").read_text().strip() == "step-00000001"
    resumed = train(RunConfig(out=str(tmp_path), resume=True, **RUN))["torch"]
    assert resumed["stopped_by"] == "steps" and resumed["steps"] == RUN["steps"]
    name = f"step-{RUN['steps']:08d}"
    got = load_checkpoint(tmp_path / "torch" / "checkpoints" / name / "model.safetensors").params
    want = load_checkpoint(whole / "torch" / "checkpoints" / name / "model.safetensors").params
    assert all(np.array_equal(got[k], want[k]) for k in want)  # an exact resume


def test_an_evaluation_that_crosses_the_budget_ends_the_run_at_its_step(tmp_path, monkeypatch):
    """Steps 1-5 take well under the 3 s budget; the evaluation at step 5 takes 4 s: the run stops
    there, checkpointed, instead of training step 6 and evaluating again."""
    from rosetta.harness import loop

    def slow(*args, **kwargs):
        time.sleep(4.0)
        return validation(*args, **kwargs)

    validation = loop.validation
    monkeypatch.setattr(loop, "validation", slow)
    result = train(RunConfig(out=str(tmp_path), time_budget=3 / 60, **RUN))["torch"]
    assert result["stopped_by"] == "time_budget" and result["steps"] == 5
    assert [r["step"] for r in _log(tmp_path) if r["kind"] == "eval"] == [5]
    assert (tmp_path / "torch" / "checkpoints" / "latest").read_text().strip() == "step-00000005"


def test_average_last_writes_and_evaluates_the_mean_of_the_last_checkpoints(tmp_path):
    run = RunConfig(out=str(tmp_path), average_last=2, **{**RUN, "steps": 10})
    result = train(run)["torch"]
    ckpts = tmp_path / "torch" / "checkpoints"
    a, b = (load_checkpoint(ckpts / f"step-{s:08d}" / "model.safetensors").params for s in (5, 10))
    averaged = load_checkpoint(tmp_path / "torch" / "averaged.safetensors").params
    for name in a:  # the float64 mean, rounded once to float32
        want = ((a[name].astype(np.float64) + b[name].astype(np.float64)) / 2).astype(np.float32)
        np.testing.assert_array_equal(averaged[name], want)
    record = _log(tmp_path)[-1]
    assert record["kind"] == "eval_average" and record["checkpoints"] == ["step-00000005", "step-00000010"]
    assert result["bleu_average"] == record["bleu"]


@pytest.mark.parametrize("field, value, message", [("time_budget", 0.0, "--time-budget"),
                                                   ("time_budget", float("inf"), "--time-budget"),
                                                   ("target_bleu", 101.0, "--target-bleu"),
                                                   ("target_bleu", 0.0, "--target-bleu"),
                                                   ("average_last", 1, "--average-last"),
                                                   ("average_last", 4, "--keep >= 4")])
def test_bad_budgets_and_targets_are_refused(field, value, message):
    with pytest.raises(RosettaError, match=message):
        check_run(RunConfig(**{field: value}))


def test_a_target_without_evaluations_is_refused():
    with pytest.raises(RosettaError, match="--eval-every 0 evaluates nothing"):
        check_run(RunConfig(target_bleu=20.0, eval_every=0))


def test_recipe_values_are_defaults_that_flags_override():
    argv = ["train", "--recipe", "multi30k", "--steps", "7", "--beam", "1", "--set", "dropout=0.2"]
    run = run_from_args(build_parser().parse_args(argv))
    recipe = RECIPES["multi30k"]
    assert (run.preset, run.task, run.warmup, run.lr_factor, run.max_tokens) == (
        recipe["preset"], recipe["task"], recipe["warmup"], recipe["lr_factor"], recipe["max_tokens"])
    assert (run.steps, run.epochs, run.beam, run.overrides) == (7, None, 1, {"dropout": 0.2})
    with pytest.raises(RosettaError, match="unknown recipe"):
        run_from_args(build_parser().parse_args(["train", "--recipe", "nope"]))
