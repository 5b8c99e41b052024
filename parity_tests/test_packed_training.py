"""Training on packed batches (docs/packing.md): a packed step's loss is the loss of its pairs run
one by one through the float64 reference, in both trainers and on 2 devices; the harness trains
with `--batching packed` in both frameworks with the same loss curves, and resumes exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest

from numpy_ref.model import forward as reference_forward
from rosetta.checkpoint import load_checkpoint
from rosetta.config import preset
from rosetta.harness.batching import BatchIterator
from rosetta.harness.data import synthetic_pairs
from rosetta.harness.loop import RunConfig, train, trainer_class
from rosetta.params import init_params
from rosetta.training import TrainConfig

pytestmark = pytest.mark.trainable

NO_DROPOUT = {"dropout": 0.0, "attention_dropout": 0.0}


def _packed_batches(cfg):
    pairs = synthetic_pairs("copy", 200, 64, 1, 12, seed=0)
    it = BatchIterator.from_config(pairs, cfg, max_tokens=144, buckets=[8, 16, 24], packing=True)
    return pairs, list(it.epoch_batches())[:2]


def _reference_loss(params, cfg, pairs, batch, eps):
    """Σ over the batch's pairs, each run alone through the float64 reference, of the label-smoothed
    cross entropy of its labels, over the batch's label count (SPEC §4)."""
    wide = {k: v.astype(np.float64) for k, v in params.items()}
    total = 0.0
    for i in batch.indices[batch.indices >= 0]:
        x, y = pairs[i]
        src = np.array([list(x) + [cfg.eos_id]])
        tgt = np.array([[cfg.bos_id] + list(y)])
        labels = np.array(list(y) + [cfg.eos_id])
        logits = reference_forward(wide, cfg, src, tgt)[0]
        logp = logits - logits.max(-1, keepdims=True)
        logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
        V = logits.shape[-1]
        q = (1 - eps) * np.eye(V)[labels] + eps / V
        total += float(-(q * logp).sum())
    return total / batch.num_tgt_tokens


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_a_packed_step_has_the_loss_of_its_pairs_run_alone(backend, accumulate):
    cfg = preset("tiny", **NO_DROPOUT)
    params = init_params(cfg, seed=0)
    pairs, batches = _packed_batches(cfg)
    assert batches[0].packed and (batches[0].src_segments.max(axis=1) > 1).any()  # rows hold several pairs
    tc = TrainConfig(warmup_steps=10)
    trainer = trainer_class(backend)(cfg, params, tc, device="cpu", accumulate=accumulate)
    loss = trainer.step(batches[0])["loss"]
    want = _reference_loss(params, cfg, pairs, batches[0], tc.label_smoothing)
    assert loss == pytest.approx(want, rel=1e-5)


RUN = dict(task="copy", max_tokens=512, buckets=(8, 16, 24), train_size=2000, eval_size=32, bleu_samples=16,
           warmup=10, lr_factor=0.5, progress=False, device="cpu", overrides=NO_DROPOUT, steps=8,
           eval_every=0, checkpoint_every=4, batching="packed")


def test_packed_harness_runs_agree_across_frameworks_and_resume_exactly(tmp_path):
    train(RunConfig(out=str(tmp_path / "both"), backends=("torch", "jax"), **RUN))
    logs = {b: [json.loads(line) for line in (tmp_path / "both" / b / "log.jsonl").read_text().splitlines()]
            for b in ("torch", "jax")}
    losses = {b: [r["loss"] for r in log if r["kind"] == "train"] for b, log in logs.items()}
    # Steps 1-3 agree to 1e-7; from step 4 Adam amplifies float32 rounding (3e-5 at step 8 on this
    # CPU: test_harness.py explains the mechanism), so 1e-4, the bound of the 2-device comparison.
    np.testing.assert_allclose(losses["jax"], losses["torch"], rtol=1e-4)
    # Stopped after checkpoint 4 (a time budget), resumed: the uninterrupted run's weights, bit for bit.
    out = tmp_path / "resumed"
    train(RunConfig(out=str(out), backends=("torch",), **{**RUN, "steps": 4}))
    train(RunConfig(out=str(out), backends=("torch",), resume=True, **RUN))
    name = f"step-{RUN['steps']:08d}"
    got = load_checkpoint(out / "torch" / "checkpoints" / name / "model.safetensors").params
    want = load_checkpoint(tmp_path / "both" / "torch" / "checkpoints" / name / "model.safetensors").params
    assert all(np.array_equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_chunked_loss_trains_the_weights_of_the_plain_loss(backend):
    """Three updates with --loss chunked (torch_impl/loss.py, jax_impl/loss.py) give the plain loss's
    losses and weights (float32 rounding only; k biases through the logits, PITFALLS 14)."""
    from parity_tests.dp_case import compare

    cfg = preset("tiny", **NO_DROPOUT)
    params = init_params(cfg, seed=0)
    pairs, batches = _packed_batches(cfg)
    runs = {}
    for loss in ("plain", "chunked"):
        trainer = trainer_class(backend)(cfg, params, TrainConfig(warmup_steps=10), device="cpu", loss=loss)
        runs[loss] = ([trainer.step(b)["loss"] for b in batches * 2][:3], trainer.params())
    np.testing.assert_allclose(runs["chunked"][0], runs["plain"][0], rtol=1e-6)
    worst, through_outputs = compare(cfg, runs["chunked"][1], runs["plain"][1], batches[0])
    assert worst <= 1e-5 and through_outputs <= 1e-5
