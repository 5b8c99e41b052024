"""The parity report: every installed backend on one random batch, compared with the float64
NumPy reference. Used by `rosetta parity` and by the parity tests (same metric, same batch,
same tolerances: `TOLERANCES` is the one table both read)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from rosetta.backends import available_backends, get_backend
from rosetta.config import ModelConfig
from rosetta.errors import RosettaError

# Target positions that hold pad_id (after position 0) are outside the contract.
FIRST_REAL_ID = 3  # ids 0, 1, 2 are pad, bos, eos in every preset

# (backend, compute dtype) -> the largest relative error ||a - b|| / ||b|| against the float64
# reference that still counts as agreement, at the contract positions. float32 allows ~80 times
# its epsilon (measured: 2.7e-7 on tiny, 6e-7 on base), float64 ~5000 times (measured 2e-15;
# JAX's float64 model runs under 64-bit JAX and is held to PyTorch's bound),
# bfloat16 about four times its epsilon of 7.8e-3 (measured 6e-3 to 8e-3 on tiny and base).
# float16 runs on CUDA only and was not measured here: 1e-2 is bfloat16's measured error scaled
# down by float16's 8x finer rounding, with a 10x margin.
# Why float32's holds on any CPU: a forward pass is a fixed chain of sums, products and
# transcendentals, each rounded to <= u = 2^-24 relative; a CPU (vector width, BLAS blocking)
# changes the order of each sum, and so which roundings happen, not their size. Rounding
# errors of random sign grow as sqrt(n) u per sum of n terms (n <= d_ff = 2048 on base: 2.7e-6
# for a sum of same-signed terms, far less for the signed sums of a layer), and the norms keep
# them from compounding across layers: base measures 6e-7 (AMD EPYC), and every float32
# parity test of the suite also passed on an Intel Xeon.
# No training is involved: no Adam to amplify a rounding difference (docs/testing.md).
TOLERANCES: dict[tuple[str, str], float] = {
    ("numpy", "float32"): 1e-5,
    ("torch", "float32"): 1e-5,
    ("torch", "float64"): 1e-12,
    ("torch", "bfloat16"): 3e-2,
    ("torch", "float16"): 1e-2,
    ("jax", "float32"): 1e-5,
    ("jax", "float64"): 1e-12,
    ("jax", "bfloat16"): 3e-2,
}


def random_batch(
    cfg: ModelConfig, batch: int = 4, src_len: int = 11, tgt_len: int = 9, seed: int = 0,
    pad: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Random source ids [B, S] and decoder inputs [B, T] (start token, then tokens). With
    `pad`, row b keeps a random real length and is padded with pad_id after it; row 0 is
    always full length, so the batch has the shape asked for."""
    rng = np.random.default_rng(seed)
    low = min(FIRST_REAL_ID, cfg.src_vocab_size - 1, cfg.tgt_vocab_size - 1)
    src = rng.integers(low, cfg.src_vocab_size, size=(batch, src_len))
    tgt = rng.integers(low, cfg.tgt_vocab_size, size=(batch, tgt_len))
    # Real tokens must not collide with pad_id, or "padding" would appear mid-sentence.
    src[src == cfg.pad_id] = low
    tgt[tgt == cfg.pad_id] = low
    tgt[:, 0] = cfg.bos_id
    if pad:
        for b in range(1, batch):
            src[b, rng.integers(1, src_len + 1):] = cfg.pad_id
            tgt[b, rng.integers(1, tgt_len + 1):] = cfg.pad_id
    return src, tgt


def diagnostic_batch(cfg: ModelConfig, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """`rosetta diff`'s default batch (docs/diff.md): random ids in a fixed layout that lets every
    entry of rosetta.diff.shared.catalogue show. Source length 11, target length 9 (cut to max_len; the
    lengths differ, or keys sized with the query length pass unseen); start token bos_id in every
    row (equal to pad_id where the config says so, PITFALLS 12). Rows:
      0  full length, no padding (the row rosetta.diff.shared.plots draws);
      1  both sides padded after about half their length (mask polarity, PITFALLS 4);
      2  a source of nothing but padding: every cross-attention key masked (the fills, PITFALLS 4);
      3  one source token, the start token alone (the shortest pair)."""
    S = min(11, cfg.max_len)
    T = max(1, min(9, S - 1))
    src, tgt = random_batch(cfg, 4, S, T, seed, pad=False)
    src[1, max(1, (S + 1) // 2):] = cfg.pad_id
    tgt[1, max(1, (T + 1) // 2):] = cfg.pad_id
    src[2, :] = cfg.pad_id
    src[3, 1:] = cfg.pad_id
    tgt[3, 1:] = cfg.pad_id
    return src, tgt


def target_positions(cfg: ModelConfig, tgt: np.ndarray) -> np.ndarray:
    """[B, T] bool: the positions whose logits are part of the contract."""
    real = tgt != cfg.pad_id
    real[:, 0] = True
    return real


def relative_error(a: np.ndarray, b: np.ndarray, where: np.ndarray | None = None) -> float:
    """||a - b|| / ||b|| in float64 over the positions selected by `where` ([B, T] bool)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if where is not None:
        a, b = a[where], b[where]
    denom = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / (denom if denom > 0 else 1.0))


@dataclass(frozen=True)
class ParityRow:
    backend: str
    dtype: str
    relative_error: float
    max_abs_error: float
    finite: bool
    tolerance: float | None  # TOLERANCES[backend, dtype]; None: the table has no entry

    @property
    def passed(self) -> bool:
        """Finite, and within a tolerance the table defines (no entry is a failure: a new
        backend or dtype must state what it promises before it can pass)."""
        return self.finite and self.tolerance is not None and self.relative_error <= self.tolerance


def parity_report(
    cfg: ModelConfig, params: Mapping[str, np.ndarray], backends: list[str] | None = None,
    batch: int = 4, src_len: int = 11, tgt_len: int = 9, seed: int = 0,
) -> list[ParityRow]:
    """Logits of each backend and dtype against the float64 reference, at contract positions."""
    src, tgt = random_batch(cfg, batch, src_len, tgt_len, seed)
    where = target_positions(cfg, tgt)
    reference = get_backend("numpy")(cfg, params, "float64").logits(src, tgt)
    rows = []
    for name in backends or available_backends():
        model_cls = get_backend(name)
        for dtype in model_cls.dtypes:
            if (name, dtype) == ("numpy", "float64"):
                continue  # the reference itself
            try:
                out = model_cls(cfg, params, dtype).logits(src, tgt)
            except RosettaError:
                continue  # a dtype this device does not offer (e.g. bfloat16 on old CPUs)
            out = np.asarray(out, dtype=np.float64)
            rows.append(ParityRow(
                name, dtype, relative_error(out, reference, where),
                float(np.abs(out - reference)[where].max()), bool(np.isfinite(out).all()),
                TOLERANCES.get((name, dtype)),
            ))
    return rows


def format_report(rows: list[ParityRow]) -> str:
    lines = [
        "| backend | dtype | rel. error vs float64 reference | max abs error | all finite | tolerance "
        "| pass |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        tolerance = "none defined" if r.tolerance is None else f"{r.tolerance:.0e}"
        lines.append(f"| {r.backend} | {r.dtype} | {r.relative_error:.3e} | {r.max_abs_error:.3e} | "
                     f"{'yes' if r.finite else 'NO'} | {tolerance} | {'yes' if r.passed else 'FAIL'} |")
    return "\n".join(lines)


def failures(rows: list[ParityRow]) -> list[str]:
    """One line per row that did not pass, saying why (for stderr and CI logs)."""
    out = []
    for r in rows:
        if not r.finite:
            out.append(f"{r.backend} {r.dtype}: logits hold NaN or infinity")
        elif r.tolerance is None:
            out.append(f"{r.backend} {r.dtype}: no tolerance defined in rosetta.parity.TOLERANCES")
        elif not r.passed:
            out.append(f"{r.backend} {r.dtype}: relative error {r.relative_error:.3e} is over its "
                       f"tolerance {r.tolerance:.0e}")
    return out


def integrity_line(path: str) -> str:
    """The report's line on a checkpoint's integrity record (docs/checkpoint.md), once
    load_checkpoint has read the file: a record it finds is verified, or the load is refused."""
    from rosetta.checkpoint import INTEGRITY_KEY, has_integrity_record

    if has_integrity_record(path):
        return f"integrity: {INTEGRITY_KEY} record present, verified"
    return f"integrity: no {INTEGRITY_KEY} record (data bytes not verified)"
