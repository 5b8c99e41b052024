"""Training-speed metrics of the harness, framework-free: model FLOPs of a batch's real tokens,
the device's peak rate, model FLOPs utilisation (MFU), and `train_record`, the log.jsonl record
of one step.

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

MFU = FLOPs of the step / (step wall time × the device's peak FLOP/s); the peak comes from
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
from rosetta.training import Trainer


def batch_lengths(src: np.ndarray, labels: np.ndarray, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-row real source and target lengths of a padded batch (all-padding rows give 0)."""
    return (np.asarray(src) != pad_id).sum(axis=1), (np.asarray(labels) != pad_id).sum(axis=1)


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


def train_record(cfg: ModelConfig, backend: str, trainer: Trainer, batch: Batch, metrics: dict[str, Any],
                 seconds: float, peak: float | None, first: bool, baseline: float | None) -> dict[str, Any]:
    """The log.jsonl record of one training step (docs/training.md: its keys): the trainer's
    `metrics`, the batch's real and padded tokens, rates, FLOPs and MFU over `seconds` (`peak`:
    one device's FLOP/s or None), and scaling efficiency against `baseline` (a one-device run's
    median target tokens/s, --baseline). `first`: the first step of this batch shape (compiles)."""
    src_lengths, tgt_lengths = batch_lengths(batch.src, batch.labels, cfg.pad_id)
    real = real_training_flops(cfg, src_lengths, tgt_lengths)
    rows, length = batch.shape
    padded = flops.training_flops(cfg, rows, length, length)
    seconds = max(seconds, 1e-9)
    workers = trainer.world_size
    peak = None if peak is None else peak * workers  # every worker's device computes
    tokens_per_s = metrics["num_tgt_tokens"] / seconds
    return {
        "kind": "train", "backend": backend, "step": metrics["step"],
        "loss": metrics["loss"], "lr": metrics["lr"], "grad_norm": metrics["grad_norm"],
        "src_tokens": metrics["num_src_tokens"], "tgt_tokens": metrics["num_tgt_tokens"],
        "src_tokens_padded": int(batch.src.size), "tgt_tokens_padded": int(batch.labels.size),
        "step_time_s": seconds,
        "src_tokens_per_s": metrics["num_src_tokens"] / seconds,
        "tgt_tokens_per_s": metrics["num_tgt_tokens"] / seconds,
        "src_tokens_per_s_padded": batch.src.size / seconds,
        "tgt_tokens_per_s_padded": batch.labels.size / seconds,
        "flops": real, "tflops_per_s": real / seconds / 1e12, "mfu": mfu(real, seconds, peak),
        "flops_padded": padded, "mfu_padded": mfu(padded, seconds, peak),
        "peak_memory_bytes": trainer.peak_memory_bytes(), "batch_shape": list(batch.shape),
        "first_of_shape": first, "device": trainer.device_name,
        "world_size": workers, "worker_rows": metrics["worker_rows"], "accumulate": trainer.accumulate,
        "tgt_tokens_per_s_per_worker": tokens_per_s / workers,
        "scaling_efficiency": None if not baseline else tokens_per_s / (workers * baseline),
    }
