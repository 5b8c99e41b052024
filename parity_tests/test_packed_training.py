"""Training on packed batches (docs/packing.md): a packed step's loss is the loss of its pairs run
one by one through the float64 reference, in both trainers and on 2 devices; the harness trains
with `--batching packed` in both frameworks with the same loss curves, and resumes exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest

from numpy_ref.model import forward as reference_forward
from parity_tests.dp_case import FIRST_STEP_RTOL, LOSS_RTOL, WEIGHTS_RTOL, compare, train_float64
from rosetta.backends import get_trainer
from rosetta.checkpoint import load_checkpoint
from rosetta.config import preset
from rosetta.harness.batching import BatchIterator
from rosetta.harness.data import synthetic_pairs
from rosetta.harness.loop import RunConfig, train
from rosetta.params import init_params
from rosetta.training import TrainConfig

pytestmark = pytest.mark.trainable

NO_DROPOUT = {"dropout": 0.0, "attention_dropout": 0.0}
# A float64 trainer's first loss against the float64 reference: FIRST_STEP_RTOL's argument with the
# float64 parity bound (rosetta.parity.TOLERANCES, 1e-12 relative logits): 2 max|Δlogit| over the loss,
# 2 × 1e-12 × 3.7 (max |logit|) / 4.7 (the loss) < 2e-12 on this batch. Seen: 1.9e-16 (torch), 0 (jax).
REFERENCE_LOSS_RTOL = 2e-12


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
@pytest.mark.trainable
def test_a_packed_step_has_the_loss_of_its_pairs_run_alone(backend, accumulate):
    """One update, float32 (the default); with 2 micro-batches in float64 (REFERENCE_LOSS_RTOL), the
    step test_packed_trainers_are_one_algorithm[2] compiles (one JAX program, not two)."""
    cfg = preset("tiny", **NO_DROPOUT)
    params = init_params(cfg, seed=0)
    pairs, batches = _packed_batches(cfg)
    assert batches[0].packed and (batches[0].src_segments.max(axis=1) > 1).any()  # rows hold several pairs
    tc = TrainConfig(warmup_steps=10)
    want = _reference_loss(params, cfg, pairs, batches[0], tc.label_smoothing)
    if accumulate == 1:
        trainer = get_trainer(backend)(cfg, params, tc, device="cpu")
        assert trainer.read(trainer.step(batches[0]))["loss"] == pytest.approx(want, rel=FIRST_STEP_RTOL)
    else:
        (loss,), _ = train_float64(backend, cfg, params, tc, batches[:1], accumulate=accumulate)
        assert loss == pytest.approx(want, rel=REFERENCE_LOSS_RTOL)


RUN = dict(task="copy", synthetic_max_len=12, max_tokens=512, buckets=(8, 16, 24), train_size=2000,
           eval_size=32, bleu_samples=16, warmup=10, lr_factor=0.5, progress=False, device="cpu",
           overrides=NO_DROPOUT, steps=8, eval_every=0, checkpoint_every=4, batching="packed")


def test_packed_harness_runs_agree_across_frameworks_and_resume_exactly(tmp_path):
    train(RunConfig(out=str(tmp_path / "both"), backends=("torch", "jax"), **RUN))
    logs = {b: [json.loads(line) for line in (tmp_path / "both" / b / "log.jsonl").read_text().splitlines()]
            for b in ("torch", "jax")}
    train_logs = {b: [r for r in log if r["kind"] == "train"] for b, log in logs.items()}
    # The harness fed both the same packed batches on the same schedule, and step 1 (same weights)
    # agrees to float32 forward rounding (FIRST_STEP_RTOL). Later float32 losses part by Adam's
    # amplification of rounding, a CPU-dependent amount: that the two trainers take the same steps
    # is test_packed_trainers_are_one_algorithm, in float64.
    for a, b in zip(train_logs["torch"], train_logs["jax"], strict=True):
        assert (a["step"], a["tgt_tokens"], a["src_tokens"]) == (b["step"], b["tgt_tokens"], b["src_tokens"])
    assert train_logs["jax"][0]["loss"] == pytest.approx(train_logs["torch"][0]["loss"], rel=FIRST_STEP_RTOL)
    # Stopped after checkpoint 4 (a time budget), resumed: the uninterrupted run's weights, bit for bit.
    out = tmp_path / "resumed"
    train(RunConfig(out=str(out), backends=("torch",), **{**RUN, "steps": 4}))
    # At the data's row length (docs/packing.md): the longest copy pair, 12 ids + eos, rounded up to 16,
    # below the largest bucket (24), the default row length before issue 45.
    state = json.loads((out / "torch" / "checkpoints" / "step-00000004" / "state.json").read_text())
    assert state["data"]["pack_length"] == 16
    train(RunConfig(out=str(out), backends=("torch",), resume=True, **RUN))
    name = f"step-{RUN['steps']:08d}"
    got = load_checkpoint(out / "torch" / "checkpoints" / name / "model.safetensors").params
    want = load_checkpoint(tmp_path / "both" / "torch" / "checkpoints" / name / "model.safetensors").params
    assert all(np.array_equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_packed_trainers_are_one_algorithm(accumulate):
    """PyTorch's and JAX's trainers on the harness's packed batches, in float64: 6 updates give the
    same losses and weights (k biases through the logits, PITFALLS 14; the bound: dp_case.py)."""

    cfg = preset("tiny", **NO_DROPOUT)
    params = init_params(cfg, seed=0)
    _, batches = _packed_batches(cfg)
    runs = {backend: train_float64(backend, cfg, params, TrainConfig(warmup_steps=10), batches * 3,
                                   accumulate=accumulate) for backend in ("torch", "jax")}
    np.testing.assert_allclose(runs["jax"][0], runs["torch"][0], rtol=LOSS_RTOL)
    worst, through_outputs = compare(cfg, runs["jax"][1], runs["torch"][1], batches[0])
    assert worst <= WEIGHTS_RTOL and through_outputs <= WEIGHTS_RTOL


@pytest.mark.parametrize("overrides", [{}, {"logit_scale": 0.25}], ids=["plain_logits", "logit_scale"])
@pytest.mark.trainable
def test_chunked_loss_trains_the_weights_of_the_plain_loss(backend, overrides):
    """Three updates with --loss chunked (torch_impl/loss.py, jax_impl/loss.py) give the plain loss's
    losses and weights, in float64 (k biases through the logits, PITFALLS 14; the bound: dp_case.py),
    with the logits scaled too (SPEC §1 logit_scale: the Flax examples/wmt convention)."""

    cfg = preset("tiny", **NO_DROPOUT, **overrides)
    params = init_params(cfg, seed=0)
    pairs, batches = _packed_batches(cfg)
    tc = TrainConfig(warmup_steps=10)
    runs = {loss: train_float64(backend, cfg, params, tc, (batches * 2)[:3], loss=loss)
            for loss in ("plain", "chunked")}
    np.testing.assert_allclose(runs["chunked"][0], runs["plain"][0], rtol=LOSS_RTOL)
    worst, through_outputs = compare(cfg, runs["chunked"][1], runs["plain"][1], batches[0])
    assert worst <= WEIGHTS_RTOL and through_outputs <= WEIGHTS_RTOL
