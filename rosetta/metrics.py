"""Training-speed metrics, framework-free: the model FLOPs of a training step, the device's peak
rate, model FLOPs utilisation (MFU), and process memory.

The FLOPs formula (what `training_flops` counts)
------------------------------------------------
One multiply-add is 2 FLOPs. Only matrix multiplications are counted; embedding lookups,
positional encodings, biases, LayerNorm, activations, softmax, masking, dropout, the loss and
the optimizer update are not. For a batch whose sentence `i` has `S_i` real source tokens
(eos included) and `T_i` real target positions (the decoder input: bos and the tokens; equal to
the non-pad labels), with `N_src = Σ S_i`, `N_tgt = Σ T_i`, `d = d_model`, `f = d_ff`,
`L_e`/`L_d` encoder/decoder layers and `V = tgt_vocab_size`, the forward pass costs

    2 · [ N_src · L_e · (4d² + 2df)          encoder: q, k, v, o projections; feed-forward
        + N_tgt · L_d · (4d² + 2d² + 2df)    decoder: self-attention q, k, v, o; cross q, o; FFN
        + N_src · L_d · 2d²                  decoder: cross-attention k, v of the encoder output
        + N_tgt · d · V                      output projection (tied or not)
        + L_e · Σ_i 2 S_i² d                 encoder attention: Q Kᵀ and weights · V, all heads
        + L_d · Σ_i (2 T_i² d + 2 T_i S_i d) decoder self- (full T×T square, as computed) and cross-attention
      ]

and a training step costs 3× the forward pass (the backward pass computes two matmuls, one for
the input gradient and one for the weight gradient, per forward matmul). Only real tokens are
counted, so padding is wasted time that lowers MFU; the padded token rates are logged
separately. This is the "6 × parameters × tokens" rule of Kaplan et al. (2020) with the
parameters split by the sequence they act on, plus the attention terms it leaves out.

MFU = training FLOPs of the step / (step wall time × peak FLOP/s of the device), `None` where
the peak rate is unknown (CPUs, unlisted GPUs) unless given explicitly.
"""

from __future__ import annotations

import platform
import resource
import sys
from collections.abc import Sequence

import numpy as np

from rosetta.config import ModelConfig

# Dense (not sparse) peak tensor-core rates in TFLOP/s from NVIDIA's data sheets, by the compute
# dtype the trainer uses: float32 on a GPU runs as TF32 (the trainer's non-parity mode).
# Matched by substring of the device name, first match wins (so "H100 PCIe" before "H100").
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"bfloat16": 756.0, "float32": 378.0}),
    ("H100", {"bfloat16": 989.0, "float32": 494.0}),  # SXM / HBM3
    ("H200", {"bfloat16": 989.0, "float32": 494.0}),  # same chip as the H100 SXM
    ("A100", {"bfloat16": 312.0, "float32": 156.0}),
)


def forward_flops(cfg: ModelConfig, src_lengths: Sequence[int] | np.ndarray,
                  tgt_lengths: Sequence[int] | np.ndarray) -> int:
    """Matmul FLOPs of one forward pass over sentences of these real lengths (module docstring)."""
    s = np.asarray(src_lengths, dtype=np.int64)
    t = np.asarray(tgt_lengths, dtype=np.int64)
    if s.shape != t.shape:
        raise ValueError(f"src_lengths {s.shape} and tgt_lengths {t.shape} differ in shape")
    d, f, V = cfg.d_model, cfg.d_ff, cfg.tgt_vocab_size
    le, ld = cfg.num_encoder_layers, cfg.num_decoder_layers
    n_src, n_tgt = int(s.sum()), int(t.sum())
    macs = (n_src * le * (4 * d * d + 2 * d * f)
            + n_tgt * ld * (6 * d * d + 2 * d * f)
            + n_src * ld * 2 * d * d
            + n_tgt * d * V
            + le * int((2 * s * s * d).sum())
            + ld * int((2 * t * t * d + 2 * t * s * d).sum()))
    return 2 * macs


def training_flops(cfg: ModelConfig, src_lengths: Sequence[int] | np.ndarray,
                   tgt_lengths: Sequence[int] | np.ndarray) -> int:
    """Matmul FLOPs of one training step (forward + backward = 3 × forward)."""
    return 3 * forward_flops(cfg, src_lengths, tgt_lengths)


def batch_lengths(src: np.ndarray, labels: np.ndarray, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-row real source and target lengths of a padded batch (all-padding rows give 0)."""
    return (np.asarray(src) != pad_id).sum(axis=1), (np.asarray(labels) != pad_id).sum(axis=1)


def peak_flops(device_name: str, dtype: str, override_tflops: float | None = None) -> float | None:
    """Peak FLOP/s for `dtype` on the device: the override if given, else the table above,
    else None (unknown: CPUs and unlisted GPUs)."""
    if override_tflops is not None:
        return float(override_tflops) * 1e12
    for key, rates in PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            rate = rates.get(dtype)
            return None if rate is None else rate * 1e12
    return None


def mfu(flops: float, seconds: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over the peak; None if the peak is unknown."""
    if peak is None or seconds <= 0:
        return None
    return flops / seconds / peak


def max_rss_bytes() -> int:
    """The process's peak resident set size (ru_maxrss: kilobytes on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def cpu_name() -> str:
    """A readable CPU name: the model name of /proc/cpuinfo, else platform.processor()."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return "cpu: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu: " + (platform.processor() or platform.machine() or "unknown")
