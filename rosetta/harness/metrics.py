"""Training-speed metrics of the harness, framework-free: model FLOPs of a batch's real tokens,
the device's peak rate, model FLOPs utilisation (MFU), `batch_work` (what one batch asks of a
step) and `train_record`, the log.jsonl record of one step.

The FLOPs formula
-----------------
rosetta/flops.py counts every matrix multiplication of the model, 2 FLOPs per multiply-add,
for a training step = 3 × the forward pass (the backward pass computes two matmuls per forward
matmul); embedding lookups, biases, LayerNorm, softmax, activations, dropout, the loss and the
optimizer are not counted. For one sentence with `S` source tokens (eos included) and `T`
target positions (bos and the tokens: the non-pad labels), `d = d_model`, `f = d_ff`, `L_e`/`L_d`
encoder/decoder layers, `V = tgt_vocab_size`, the forward pass is

    2 · [ S·L_e·(4d² + 2df)                 encoder: q, k, v, o projections; feed-forward
        + T·L_d·(4d² + 2d² + 2df)           decoder: self-attention q, k, v, o; cross q, o; FFN
        + S·L_d·2d²                         decoder: cross-attention k, v of the encoder output
        + T·d·V                             output projection (tied or not)
        + L_e·2S²d                          encoder attention: Q Kᵀ and weights · V, all heads
        + L_d·(2T²d + 2TSd) ]               decoder self- (the full T×T square) and cross-attention

The harness logs two numbers per step:

* `flops`: the sum of this formula over the batch's sentences at their REAL lengths (the
  useful work; padding counts for nothing) → `mfu`, `tflops_per_s`;
* `flops_padded`: the formula at the padded batch shape `[rows, L]` for source and target (what
  the device computes, rosetta/flops.py's convention) → `mfu_padded`.

MFU = FLOPs / (time × the device's peak FLOP/s), both over the stretch of steps the record ends
(the steps since the device was last read: one at --log-every 1; rosetta/harness/stepping.py);
the peak comes from
`--peak-tflops`, else rosetta/flops.py's table of dense tensor-core rates (H100/H200 SXM bf16
989 TFLOP/s, TF32 495; A100 bf16 312, TF32 156; float32 training on a GPU runs as TF32 outside
parity mode), else it is unknown (CPUs) and MFU is null.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rosetta import flops
from rosetta.config import ModelConfig
from rosetta.harness.batching import Batch
from rosetta.harness.stepping import HOST_PHASES, Stretch
from rosetta.training import Trainer


def batch_lengths(src: np.ndarray, labels: np.ndarray, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-row real source and target lengths of a padded batch (all-padding rows give 0)."""
    return (np.asarray(src) != pad_id).sum(axis=1), (np.asarray(labels) != pad_id).sum(axis=1)


def sentence_lengths(batch: Batch, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """The real source and target lengths of every sentence pair a batch holds: per row, or per
    segment of a packed row (docs/packing.md: a segment attends to itself alone)."""
    if not batch.packed:
        src, tgt = batch_lengths(batch.src, batch.labels, pad_id)
        return src[tgt > 0], tgt[tgt > 0]
    src_lengths, tgt_lengths = [], []
    for row_src, row_tgt in zip(batch.src_segments, batch.tgt_segments, strict=True):
        for segment in np.unique(row_src[row_src > 0]):
            src_lengths.append(int((row_src == segment).sum()))
            tgt_lengths.append(int((row_tgt == segment).sum()))
    return np.asarray(src_lengths, dtype=np.int64), np.asarray(tgt_lengths, dtype=np.int64)


def real_training_flops(cfg: ModelConfig, src_lengths: np.ndarray, tgt_lengths: np.ndarray) -> int:
    """Training FLOPs of the real tokens: the formula summed over sentences (batch of one each)."""
    return sum(flops.training_flops(cfg, 1, int(s), int(t))
               for s, t in zip(src_lengths, tgt_lengths, strict=True) if s or t)


def peak_flops(device_name: str, dtype: str, override_tflops: float | None = None) -> float | None:
    """Peak FLOP/s: `override_tflops` if given, else rosetta/flops.py's table, else None."""
    if override_tflops is not None:
        return float(override_tflops) * 1e12
    return flops.peak_flops(device_name, dtype)


mfu = flops.mfu


def batch_work(cfg: ModelConfig, batch: Batch) -> dict[str, float]:
    """What one batch asks of a step, summed over a stretch of steps (rosetta/harness/stepping.py):
    real and padded tokens, real and padded training FLOPs."""
    src_lengths, tgt_lengths = sentence_lengths(batch, cfg.pad_id)
    rows, length = batch.shape
    return {"src_tokens": int(batch.num_src_tokens), "tgt_tokens": int(batch.num_tgt_tokens),
            "src_tokens_padded": int(batch.src.size), "tgt_tokens_padded": int(batch.labels.size),
            "flops": real_training_flops(cfg, src_lengths, tgt_lengths),
            "flops_padded": flops.training_flops(cfg, rows, length, length)}


def train_record(cfg: ModelConfig, backend: str, trainer: Trainer, batch: Batch, metrics: dict[str, Any],
                 stretch: Stretch, peak: float | None, first: bool, baseline: float | None) -> dict[str, Any]:
    """The log.jsonl record of one training step (docs/training.md: its keys): the trainer's
    `metrics` (read: floats) and its batch's tokens and FLOPs; its time and the rates, FLOPs and MFU
    of the `stretch` of steps it ends (every step since the last read from the device: one step at
    --log-every 1), `peak` one device's FLOP/s or None; scaling efficiency against `baseline` (a
    one-device run's median target tokens/s, --baseline). `first`: the first step of this batch
    shape (compiles: its stretch is that step alone, and `compile_s` says how long it compiled)."""
    work = batch_work(cfg, batch)
    seconds = max(stretch.seconds, 1e-9)
    done = stretch.work  # the stretch's tokens and FLOPs
    workers = trainer.world_size
    peak = None if peak is None else peak * workers  # every worker's device computes
    tokens_per_s = done["tgt_tokens"] / seconds
    return {
        "kind": "train", "backend": backend, "step": metrics["step"],
        "loss": metrics["loss"], "lr": metrics["lr"], "grad_norm": metrics["grad_norm"],
        "src_tokens": metrics["num_src_tokens"], "tgt_tokens": metrics["num_tgt_tokens"],
        "src_tokens_padded": work["src_tokens_padded"], "tgt_tokens_padded": work["tgt_tokens_padded"],
        "step_time_s": seconds / stretch.steps, "stretch_steps": stretch.steps,
        "compile_s": stretch.compile_s,
        # The host's seconds per step: a loop whose three reach step_time_s is host-bound.
        **{f"host_{phase}_s": stretch.host_seconds(phase) for phase in HOST_PHASES},
        "src_tokens_per_s": done["src_tokens"] / seconds,
        "tgt_tokens_per_s": tokens_per_s,
        "src_tokens_per_s_padded": done["src_tokens_padded"] / seconds,
        "tgt_tokens_per_s_padded": done["tgt_tokens_padded"] / seconds,
        "flops": work["flops"], "tflops_per_s": done["flops"] / seconds / 1e12,
        "mfu": mfu(done["flops"], seconds, peak),
        "flops_padded": work["flops_padded"], "mfu_padded": mfu(done["flops_padded"], seconds, peak),
        "peak_memory_bytes": trainer.peak_memory_bytes(), "batch_shape": list(batch.shape),
        "first_of_shape": first, "device": trainer.device_name,
        "world_size": workers, "worker_rows": metrics["worker_rows"], "accumulate": trainer.accumulate,
        "tgt_tokens_per_s_per_worker": tokens_per_s / workers,
        "scaling_efficiency": None if not baseline else tokens_per_s / (workers * baseline),
    }
