"""Model FLOPs of one training step, and model FLOPs utilisation (MFU).

What is counted: every matrix multiplication of the model, 2 FLOPs per multiply-add, on the
padded batch shape (what the device computes): per layer the q/k/v/o projections, the
attention scores Q K^T and the weighted sum over values (over all key positions, masked or
not), the two feed-forward matmuls; the output projection. Not counted: embedding lookups,
LayerNorm, softmax, activations, dropout, the optimizer (together a few percent). A training
step is 3x the forward pass (backward computes two matmuls per forward matmul), the usual
convention (Kaplan et al. 2020; PaLM appendix B) — so MFU compares with the hardware's dense
matmul peak.
"""

from __future__ import annotations

from rosetta.config import ModelConfig


def forward_flops(cfg: ModelConfig, batch: int, src_len: int, tgt_len: int) -> int:
    """Matmul FLOPs of one forward pass over a [batch, src_len] / [batch, tgt_len] batch."""
    d, f, V = cfg.d_model, cfg.d_ff, cfg.tgt_vocab_size
    S, T = src_len, tgt_len
    projections = 2 * 4 * d * d  # q, k, v, o per token
    ffn = 2 * 2 * d * f
    encoder = cfg.num_encoder_layers * (S * (projections + ffn) + 2 * 2 * S * S * d)
    decoder = cfg.num_decoder_layers * (
        T * (projections + ffn) + 2 * 2 * T * T * d  # self-attention
        + T * 2 * 2 * d * d + S * 2 * 2 * d * d + 2 * 2 * T * S * d  # cross: q, o on T; k, v on S
    )
    generator = 2 * T * d * V
    return batch * (encoder + decoder + generator)


def training_flops(cfg: ModelConfig, batch: int, src_len: int, tgt_len: int) -> int:
    """Forward + backward: 3x the forward matmul FLOPs."""
    return 3 * forward_flops(cfg, batch, src_len, tgt_len)


# Dense matmul peaks in TFLOP/s (vendor data sheets, without sparsity). float32 means TF32
# tensor cores: the setting the benchmarks use for float32 throughput on GPUs.
# Looked up in order, first match wins: the PCIe H100 before the SXM one.
PEAK_TFLOPS: dict[tuple[str, str], float] = {
    ("H100 PCIe", "bfloat16"): 756.0, ("H100 PCIe", "float32"): 378.0,
    ("H100", "bfloat16"): 989.4, ("H100", "float32"): 494.7,  # SXM (HBM3); H200 has the same chip
    ("H200", "bfloat16"): 989.4, ("H200", "float32"): 494.7,
    ("A100", "bfloat16"): 312.0, ("A100", "float32"): 156.0,
}


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Peak FLOP/s of a known GPU for `dtype`, or None (CPUs: unknown)."""
    for (chip, kind), tflops in PEAK_TFLOPS.items():
        if chip in device_name and kind == dtype:
            return tflops * 1e12
    return None


def mfu(flops: float, seconds: float, peak: float | None) -> float | None:
    """Achieved FLOP/s over peak FLOP/s; None when the peak is unknown."""
    return None if peak is None or seconds <= 0 else flops / seconds / peak
