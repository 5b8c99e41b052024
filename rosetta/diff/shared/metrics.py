"""Stage by stage comparison of two forward passes: where do they part? What both diff tools
measure, defined once.

The metric is the relative error ||a - b|| / ||b||, b being the reference side (the table's B,
docs/diff.md), taken only at the positions the contract covers (SPEC §2): a pad source position's
encoder output, or a pad target position's decoder output, is whatever each framework's masking
leaves there and means nothing. The table (compare_stages) and the diagnosis (diagnose.py) both
call stage_error, so one error prints as one number in both.

The logits are also compared as what they define, next-token distributions (logit_metrics:
KL(p_b || p_a) and top-1/top-5 agreement, in float64), and a 16-bit side is judged by the
low-precision rule (low_precision_verdict), derived from bfloat16's rounding in docs/diff.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np

from rosetta.diff.shared.dump import Dump, stage_kind, stage_order
from rosetta.errors import InputError
from rosetta.parity import target_positions

# -- Tolerances: how far a side may be from the float64 reference ----------------------------

# The numpy reference against itself (float64 vs float64): only summation order differs.
FLOAT64_TOLERANCE = 1e-10
# A dump (and Hugging Face's model) says only its arrays' dtype: that precision's entry of
# rosetta.parity.TOLERANCES; an unknown dtype gets bfloat16's 3e-2.
DUMP_TOLERANCES = {"float64": FLOAT64_TOLERANCE, "float32": 1e-5, "float16": 1e-2}
# 16-bit floating types: a side computing in one of these gets the low-precision verdict
# (low_precision_verdict, docs/diff.md).
LOW_PRECISION = ("bfloat16", "float16")


def dump_tolerance(dump: Dump) -> float:
    """A dump's agreement bound with the reference: the loosest of its arrays' dtypes'."""
    dtypes = {str(v.dtype) for v in dump.stages.values()} or {"float64"}
    return max(DUMP_TOLERANCES.get(d, 3e-2) for d in dtypes)


# -- The relative error, at the contract positions -------------------------------------------

class StageRow(NamedTuple):
    stage: str
    rel: float      # ||a - b|| / ||b|| at contract positions
    max_abs: float  # max |a - b| there
    over: bool      # rel > tolerance (or not finite)


def relative_error(a: np.ndarray, b: np.ndarray, reference: np.ndarray | None = None) -> float:
    """||a - b|| / ||reference|| in float64, the reference being b unless given (the diagnosis
    divides every candidate's error by one fixed side, the table's B). rosetta.parity's
    relative_error with the reference named: a reference of norm 0 leaves the absolute error."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    scale = np.linalg.norm(b if reference is None else np.asarray(reference, dtype=np.float64))
    return float(np.linalg.norm(a - b) / (scale if scale > 0 else 1.0))


def contract_positions(pad_id: int, src: np.ndarray, tgt: np.ndarray, stage: str) -> np.ndarray:
    """The [B, length] query positions of `stage` that count: non-pad source positions for the
    encoder's stages, rosetta.parity.target_positions (position 0 always, then non-pad) for the
    decoder's and the logits. Attention weights count at their query positions (every key)."""
    kind = stage_kind(stage)
    if kind in ("enc", "enc_self_w"):
        return src != pad_id
    return target_positions(SimpleNamespace(pad_id=pad_id), tgt)  # it reads only pad_id


def _select(value: np.ndarray, where: np.ndarray, weights: bool) -> np.ndarray:
    """The rows of `value` at `where`: [B, L, ...] indexed by [B, L]; weights are [B, h, L, K]."""
    value = np.asarray(value, dtype=np.float64)
    return np.moveaxis(value, 1, 2)[where] if weights else value[where]


def counted(pad_id: int, src: np.ndarray, tgt: np.ndarray, stage: str, value: np.ndarray) -> np.ndarray:
    """`value` of `stage` at its contract positions, float64 (attention weights: their query rows)."""
    weights = (stage_kind(stage) or "").endswith("_w")
    return _select(value, contract_positions(pad_id, np.asarray(src), np.asarray(tgt), stage), weights)


def stage_error(a: np.ndarray, b: np.ndarray, reference: np.ndarray | None = None,
                nan_matches: bool = False) -> float:
    """relative_error of two stages already cut to their contract positions (`counted`). Not
    finite anywhere: infinite, right for a report; with `nan_matches`, NaN where the other side
    has NaN too is agreement (a -inf fill's NaN rows, which the diagnosis looks for) and any other
    non-finite mismatch is infinite."""
    fa, fb = np.isfinite(a), np.isfinite(b)
    if not (fa.all() and fb.all()):
        same = (fa == fb) & (fa | (np.isnan(a) & np.isnan(b)) | (a == b))
        if not nan_matches or not same.all():
            return float("inf")
        a, b = np.where(fa, a, 0.0), np.where(fb, b, 0.0)
    if reference is not None:
        reference = np.where(np.isfinite(reference), reference, 0.0)
    return relative_error(a, b, reference)


def compare_stages(pad_id: int, src: np.ndarray, tgt: np.ndarray, a: Mapping[str, np.ndarray],
                   b: Mapping[str, np.ndarray], tolerance: float) -> list[StageRow]:
    """One row per stage both sides have, in forward order; B is the reference."""
    src, tgt = np.asarray(src), np.asarray(tgt)
    rows = []
    for stage in sorted(set(a) & set(b), key=stage_order):
        x, y = np.asarray(a[stage]), np.asarray(b[stage])
        if x.shape != y.shape:
            raise InputError(f"stage {stage!r} has shape {x.shape} on one side and {y.shape} on the "
                             f"other: models of different shapes cannot be compared")
        x, y = counted(pad_id, src, tgt, stage, x), counted(pad_id, src, tgt, stage, y)
        finite = bool(np.isfinite(x).all() and np.isfinite(y).all())
        rel = stage_error(x, y)  # infinite where a side is not finite
        max_abs = float(np.abs(x - y).max()) if finite and x.size else (0.0 if finite else float("inf"))
        rows.append(StageRow(stage, rel, max_abs, not finite or rel > tolerance))
    return rows


def first_over(rows: list[StageRow]) -> StageRow | None:
    """The first row (in forward order) over the tolerance: where the two sides part."""
    return next((row for row in rows if row.over), None)


def format_rows(rows: list[StageRow], tolerance: float) -> str:
    """The table `rosetta diff` prints; the first stage over the tolerance is marked."""
    first = first_over(rows)
    width = max([len("stage"), *(len(r.stage) for r in rows)])
    lines = [f"{'stage':<{width}}  {'rel. error':>10}  {'max abs':>10}  over {tolerance:.0e}?"]
    for r in rows:
        mark = "<- first difference" if r is first else ""
        lines.append(f"{r.stage:<{width}}  {r.rel:10.3e}  {r.max_abs:10.3e}  "
                     f"{'OVER' if r.over else 'ok':<4} {mark}".rstrip())
    return "\n".join(lines)


# -- The logits as distributions: KL divergence and top-k agreement ------------------------

class LogitMetrics(NamedTuple):
    positions: int   # counted target positions (contract_positions of "logits")
    kl_mean: float   # mean over them of KL(p_b || p_a), p = softmax(logits), in nats
    kl_max: float
    top1: float      # fraction of them where the two argmaxes are the same token
    top5: float      # mean of |top5(a) & top5(b)| / 5 (MaxText's top-k overlap, averaged)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log softmax over the last axis in float64, max subtracted first (no overflow in exp)."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def kl_divergence(logits_a: np.ndarray, logits_b: np.ndarray) -> np.ndarray:
    """KL(p_b || p_a) per row [..., V] -> [...]: B is the reference, as in the relative error (and
    MaxText's logit checker: KL(golden || model)). Rounding can leave -1e-17: clipped to 0."""
    log_a, log_b = log_softmax(logits_a), log_softmax(logits_b)
    return np.maximum((np.exp(log_b) * (log_b - log_a)).sum(axis=-1), 0.0)


def top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """The indices [..., k] of the k largest logits, ties to the lower index (a stable sort)."""
    return np.argsort(-np.asarray(logits, dtype=np.float64), axis=-1, kind="stable")[..., :k]


def top_k_overlap(logits_a: np.ndarray, logits_b: np.ndarray, k: int) -> np.ndarray:
    """|top_k(a) & top_k(b)| / k per row [..., V] -> [...] (k cut to V)."""
    k = min(k, np.shape(logits_b)[-1])
    ta, tb = top_k(logits_a, k), top_k(logits_b, k)
    return (ta[..., :, None] == tb[..., None, :]).any(axis=-1).sum(axis=-1) / k


def _counted_logits(pad_id: int, src: np.ndarray, tgt: np.ndarray, a: np.ndarray, b: np.ndarray):
    """Both sides' logits [N, V] at the counted positions, float64; None when a side is not finite."""
    a, b = counted(pad_id, src, tgt, "logits", a), counted(pad_id, src, tgt, "logits", b)
    return (a, b) if np.isfinite(a).all() and np.isfinite(b).all() else None


def logit_metrics(pad_id: int, src: np.ndarray, tgt: np.ndarray, a: np.ndarray,
                  b: np.ndarray) -> LogitMetrics | None:
    """KL and top-k agreement of two sides' logits [B, T, V] at the counted target positions;
    None when a side holds NaN or infinity there (the table already says so)."""
    counted = _counted_logits(pad_id, src, tgt, a, b)
    if counted is None:
        return None
    a, b = counted
    kl = kl_divergence(a, b)
    same = top_k(a, 1)[:, 0] == top_k(b, 1)[:, 0]
    return LogitMetrics(len(kl), float(kl.mean()), float(kl.max()), float(same.mean()),
                        float(top_k_overlap(a, b, 5).mean()))


def format_logit_metrics(m: LogitMetrics) -> str:
    return (f"logits: KL mean {m.kl_mean:.1e} max {m.kl_max:.1e}, top-1 {100 * m.top1:.1f}%, "
            f"top-5 {100 * m.top5:.1f}% ({m.positions} positions)")


# -- When is a 16-bit difference rounding? (docs/diff.md, "The low-precision rule") ----------

# bfloat16 keeps 8 significant bits: round to nearest moves a value by at most u = 2^-8 relative.
BFLOAT16_U = 2.0 ** -8
# A 16-bit side's logits may be off by 8u of the position's largest |logit| (8u = 1/32 ~ 3.1e-2,
# the relative error rosetta.parity.TOLERANCES allows bfloat16 (3e-2); measured: 6e-3 to 8e-3,
# about 2u, so a 4x margin).
ROUNDINGS = 8


class LowPrecisionVerdict(NamedTuple):
    accepted: bool
    positions: int
    kl_over: int          # positions whose KL is over their budget 1/2 delta^2
    worst: float          # the largest KL / budget over the positions (0 when every KL is 0)
    flips: int            # argmax disagreements where the reference's margin is over 2 delta
    near_ties: int        # argmax disagreements within 2 delta: rounding may flip those


def low_precision_verdict(pad_id: int, src: np.ndarray, tgt: np.ndarray, a: np.ndarray, b: np.ndarray,
                          u: float = BFLOAT16_U) -> LowPrecisionVerdict | None:
    """The low-precision rule: with delta = ROUNDINGS * u * max_j |z_b[j]| at each counted
    position (z_b: the reference's logits there), accept when at every position
    KL(p_b || p_a) <= delta^2 / 2 and the argmaxes agree unless the reference's margin between
    the two tokens is <= 2 delta. Both hold whenever no logit of A is more than delta from B's:
    KL = log E_p[exp e] - E_p[e] for e = z_a - z_b, at most (2 delta)^2 / 8 by Hoeffding's lemma,
    and two logits delta apart at most can swap only across a margin of 2 delta. None when a
    side is not finite."""
    counted = _counted_logits(pad_id, src, tgt, a, b)
    if counted is None:
        return None
    a, b = counted
    delta = ROUNDINGS * u * np.abs(b).max(axis=-1)
    budget = delta ** 2 / 2
    kl = kl_divergence(a, b)
    over = kl > budget
    ratio = np.divide(kl, budget, out=np.where(kl > 0, np.inf, 0.0), where=budget > 0)
    ia, ib = top_k(a, 1)[:, 0], top_k(b, 1)[:, 0]
    rows = np.arange(len(b))
    margin = b[rows, ib] - b[rows, ia]
    differ = ia != ib
    flips, ties = int((differ & (margin > 2 * delta)).sum()), int((differ & (margin <= 2 * delta)).sum())
    return LowPrecisionVerdict(not over.any() and flips == 0, len(kl), int(over.sum()),
                               float(ratio.max()), flips, ties)


def format_verdict(v: LowPrecisionVerdict, dtype: str) -> str:
    word = "accepted" if v.accepted else "REJECTED"
    share = f"{100 * v.worst:.2g}% of it" if v.worst < 1 else f"{v.worst:.3g} times it"
    return (f"{dtype} rule: {word} (KL within its budget at {v.positions - v.kl_over} of {v.positions} "
            f"positions, worst {share}; {v.flips} top-1 flips outside near-ties, "
            f"{v.near_ties} near-ties)")
