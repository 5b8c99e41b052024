"""Training that goes wrong, and what a run reports (issue 11, items 7 and 9): a non-finite loss
or gradient norm stops the run at that step with the last good checkpoint kept; poisoned optimizer
state is refused on resume; the summary's totals cover every step, logged or not.

Expected values come from outside the code under test: Adam's first-step size worked out by hand,
the other framework's gradients, a counter and a timer wrapped around the trainer's step."""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from rosetta import CheckpointError, init_params, load_checkpoint, preset
from rosetta.backends import get_trainer
from rosetta.cli import main
from rosetta.harness.batching import BatchIterator
from rosetta.harness.data import synthetic_pairs
from rosetta.harness.loop import RunConfig, train
from rosetta.harness.report import read_log
from rosetta.harness.run_dir import latest_checkpoint, list_checkpoints
from rosetta.harness.trainer_state import load_trainer_state, save_trainer_state
from rosetta.training import TrainConfig

pytestmark = pytest.mark.trainable

NO_DROPOUT = {"dropout": 0.0, "attention_dropout": 0.0}
QUICK = ["--task", "copy", "--max-tokens", "512", "--buckets", "24", "--train-size", "500",
         "--eval-size", "8", "--bleu-samples", "4", "--eval-every", "0", "--warmup", "10", "--no-progress",
         "--device", "cpu"]


def train_records(run_dir: Path) -> list[dict]:
    return [r for r in read_log(run_dir / "log.jsonl") if r["kind"] == "train"]


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("rosetta: error: ")]
    assert len(lines) == 1, err
    return lines[0]


def tiny_batches(count: int) -> tuple:
    cfg = preset("tiny", **NO_DROPOUT)
    pairs = synthetic_pairs("copy", 200, 64, 1, 16, seed=0)
    batches = list(BatchIterator.from_config(pairs, cfg, max_tokens=512, buckets=[24]).epoch_batches())
    return cfg, batches[:count]


# -- Item 7: divergence stops the run; poisoned state is refused ----------------------------------

@pytest.mark.trainable
def test_a_diverging_run_stops_at_its_first_non_finite_step(backend, tmp_path, capsys):
    # Adam's first update moves every weight by about lr = 1e30 * 32^-0.5 * 10^-1.5 ~ 6e27; the
    # next forward pass multiplies such weights (6e27^2 > float32's 3.4e38): step 2 is not finite.
    out = tmp_path / "diverged"
    argv = ["train", "--backend", backend, "--steps", "10", "--lr-factor", "1e30", "--checkpoint-every", "1",
            "--out", str(out), *QUICK]
    assert main(argv) == 2
    err = one_line_error(capsys)
    assert err.startswith(f"rosetta: error: {backend}: training diverged at step 2 (loss nan"), err
    assert "the last good checkpoint, step-00000001, stays latest" in err
    run_dir = out / backend
    assert [r["step"] for r in train_records(run_dir)] == [1]  # the bad step is not logged
    checkpoints = run_dir / "checkpoints"
    assert [step for step, _ in list_checkpoints(checkpoints)] == [1]
    assert latest_checkpoint(checkpoints).name == "step-00000001"
    params = load_checkpoint(checkpoints / "step-00000001" / "model.safetensors").params
    assert all(np.isfinite(v).all() for v in params.values())
    assert not (run_dir / "result.json").exists()
    assert not any(p.name.startswith(".tmp-") for p in checkpoints.iterdir())


def test_an_infinite_gradient_norm_alone_stops_the_run(tmp_path, capsys, monkeypatch):
    """The third update's gradient norm is infinite on the device, its loss finite (no clipping: the
    update itself does not read the norm); the trainer's device-side watch names step 3."""
    import torch

    original, calls = torch.nn.utils.get_total_norm, []

    def total_norm(*args, **kwargs):
        calls.append(1)
        norm = original(*args, **kwargs)
        return norm * math.inf if len(calls) == 3 else norm

    monkeypatch.setattr(torch.nn.utils, "get_total_norm", total_norm)
    out = tmp_path / "inf-norm"
    assert main(["train", "--backend", "torch", "--steps", "6", "--checkpoint-every", "1", "--out", str(out),
                 *QUICK]) == 2
    err = one_line_error(capsys)
    assert "torch: training diverged at step 3 (loss " in err and "gradient norm inf)" in err
    checkpoints = out / "torch" / "checkpoints"
    assert [step for step, _ in list_checkpoints(checkpoints)] == [1, 2]
    assert latest_checkpoint(checkpoints).name == "step-00000002"


@pytest.mark.parametrize("backend,other", [("torch", "jax"), ("jax", "torch")])
def test_the_logged_gradient_norm_is_the_other_frameworks(backend, other):
    """The global norm of the loss gradient, from the other framework's `gradients`."""
    import importlib

    cfg, (batch,) = tiny_batches(1)
    params = init_params(cfg, seed=0)
    trainer = get_trainer(backend)(cfg, params, TrainConfig(warmup_steps=10), device="cpu")
    norm = trainer.read(trainer.step(batch))["grad_norm"]
    reference = get_trainer(other)(cfg, params, TrainConfig(warmup_steps=10), device="cpu")
    module = importlib.import_module(f"{other}_impl.train")
    if other == "torch":
        import torch

        reference.module.eval()
        _, grads = module.gradients(reference.module, *(torch.from_numpy(a) for a in
                                                        (batch.src, batch.tgt_in, batch.labels)), 0.1)
    else:
        reference.model.eval()
        _, grads = module.gradients(reference.model, batch.src, batch.tgt_in, batch.labels, 0.1)
    expected = math.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads.values()))
    assert norm == pytest.approx(expected, rel=1e-4)


@pytest.mark.trainable
@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_poisoned_optimizer_state_is_refused_naming_the_tensor(backend, poison):
    cfg, (batch,) = tiny_batches(1)
    Trainer = get_trainer(backend)
    trainer = Trainer(cfg, init_params(cfg, seed=0), TrainConfig(warmup_steps=10), device="cpu")
    trainer.step(batch)
    state = trainer.state_dict()
    # A second moment (Adam's v) of the embedding table, whatever the framework calls it.
    embed = init_params(cfg)["shared_embed.embedding"].shape
    key = next(k for k in sorted(state) if np.shape(state[k]) == embed and ("sq" in k or ".nu" in k))
    state[key] = state[key].copy()
    state[key][3, 4] = poison
    fresh = Trainer(cfg, init_params(cfg, seed=0), TrainConfig(warmup_steps=10), device="cpu")
    with pytest.raises(CheckpointError) as err:
        fresh.load_state_dict(state)
    assert str(err.value) == (f"{backend} trainer state {key} holds 1 NaN or infinite value(s) of "
                              f"{embed[0] * embed[1]}: refusing to resume from it")


def test_resume_refuses_a_checkpoint_with_nan_moments(tmp_path, capsys):
    out = tmp_path / "poisoned"
    argv = ["train", "--backend", "torch", "--checkpoint-every", "2", "--out", str(out), *QUICK]
    assert main([*argv, "--steps", "2"]) == 0
    capsys.readouterr()
    path = out / "torch" / "checkpoints" / "step-00000002" / "trainer_state.safetensors"
    state = load_trainer_state(path, "torch")
    key = "optimizer.shared_embed.weight.exp_avg"  # torch's name for the shared table's Adam m
    state[key][0, 0] = np.nan
    save_trainer_state(path, state, "torch")  # a well-formed file holding a NaN
    assert main([*argv, "--steps", "4", "--resume"]) == 2
    assert f"torch trainer state {key} holds 1 NaN" in one_line_error(capsys)
    assert [r["step"] for r in train_records(out / "torch")] == [1, 2]  # nothing was trained on it


# -- Item 9: the summary's totals cover every step --------------------------------------------------

class StepMeter:
    """Wraps a Trainer's `step` to count, time and add up every call, logged or not. The time is the
    call's: all of a step on a CPU for PyTorch (it computes as the host waits), only its dispatch
    (and compilation) for JAX, which returns before the device has finished."""

    def __init__(self, monkeypatch, backend: str):
        self.calls, self.seconds, self.src_tokens, self.tgt_tokens = 0, 0.0, 0, 0
        Trainer = get_trainer(backend)
        original = Trainer.step

        def step(trainer, prepared, **kwargs):
            start = time.perf_counter()
            metrics = original(trainer, prepared, **kwargs)
            self.seconds += time.perf_counter() - start
            self.calls += 1
            batch = getattr(prepared, "batch", prepared)  # the harness passes Trainer.prepare's copy
            self.src_tokens += int((batch.src != 0).sum())
            self.tgt_tokens += int((batch.labels != 0).sum())
            return metrics

        monkeypatch.setattr(Trainer, "step", step)


@pytest.mark.trainable
def test_summary_totals_cover_every_step_not_only_logged_ones(backend, tmp_path, monkeypatch):
    meter = StepMeter(monkeypatch, backend)
    out = tmp_path / "totals"
    result = train(RunConfig(backends=(backend,), out=str(out), steps=11, log_every=5, eval_every=0,
                             checkpoint_every=0, overrides=NO_DROPOUT, task="copy", max_tokens=512,
                             buckets=(24,), train_size=500, eval_size=8, bleu_samples=4, warmup=10,
                             progress=False, device="cpu"))[backend]
    assert meter.calls == 11 and [r["step"] for r in train_records(out / backend)] == [5, 10, 11]
    assert result["steps"] == 11
    # --eval-every 0: no evaluation at all, the last step's included (issue 46)
    assert result["evaluations"] == [] and result["bleu"] is None and result["val_loss"] is None
    assert result["src_tokens_total"] == meter.src_tokens and result["tgt_tokens_total"] == meter.tgt_tokens
    # The harness times stretches of steps from the first one's call to the read of the last one's
    # values (rosetta/harness/stepping.py): every call lies inside one, so the totals hold the meter's
    # calls (compilation taken apart), and the training loop's wall time holds the totals.
    total = result["step_time_total_s"]
    assert meter.seconds - result["compile_time_total_s"] <= total <= result["wall_time_s"]
    logged = sum(r["step_time_s"] for r in train_records(out / backend))
    assert logged < 0.75 * total  # 3 of 11 steps, step 1 (the slowest) not among them
    # Medians are over logged steps that were not the first of their shape (one bucket: step 1).
    assert result["timed_steps"] == 3
    summary = json.loads((out / "summary.json").read_text())["backends"][backend]
    assert summary["step_time_total_s"] == result["step_time_total_s"]
    table = (out / "summary.md").read_text()
    assert f"| target tokens trained, all steps | {meter.tgt_tokens:,} |" in table


def test_totals_survive_a_resume(tmp_path, monkeypatch):
    meter = StepMeter(monkeypatch, "torch")
    common = dict(backends=("torch",), log_every=3, eval_every=0, checkpoint_every=4, overrides=NO_DROPOUT,
                  task="copy", max_tokens=512, buckets=(24,), train_size=500, eval_size=8, bleu_samples=4,
                  warmup=10, progress=False, device="cpu")
    straight = train(RunConfig(out=str(tmp_path / "straight"), steps=10, **common))["torch"]
    tokens_straight = meter.tgt_tokens
    train(RunConfig(out=str(tmp_path / "split"), steps=6, **common))  # checkpoints at steps 4 and 6
    # As if killed after step 6 before its checkpoint: the resume starts again from step 4.
    shutil.rmtree(tmp_path / "split" / "torch" / "checkpoints" / "step-00000006")
    split = train(RunConfig(out=str(tmp_path / "split"), steps=10, resume=True, **common))["torch"]
    # The split run trained steps 1-6, then 5-10 again from checkpoint 4: its totals are the ten
    # steps of the result, the straight run's, not the 12 calls made.
    assert meter.calls == 10 + 6 + 6
    assert split["tgt_tokens_total"] == straight["tgt_tokens_total"] == tokens_straight
