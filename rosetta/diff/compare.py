"""Stage by stage comparison of two forward passes: where do they part?

The metric is rosetta.parity's relative error ||a - b|| / ||b|| (b: the second side, usually the
reference), taken only at the positions the contract covers (SPEC §2): a pad source position's
encoder output, or a pad target position's decoder output, is whatever each framework's masking
leaves there and means nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np

from rosetta.diff.dump import stage_kind, stage_order
from rosetta.errors import InputError
from rosetta.parity import relative_error, target_positions


class StageRow(NamedTuple):
    stage: str
    rel: float      # ||a - b|| / ||b|| at contract positions
    max_abs: float  # max |a - b| there
    over: bool      # rel > tolerance (or not finite)


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


def compare_stages(pad_id: int, src: np.ndarray, tgt: np.ndarray, a: Mapping[str, np.ndarray],
                   b: Mapping[str, np.ndarray], tolerance: float) -> list[StageRow]:
    """One row per stage both sides have, in forward order."""
    src, tgt = np.asarray(src), np.asarray(tgt)
    rows = []
    for stage in sorted(set(a) & set(b), key=stage_order):
        x, y = np.asarray(a[stage]), np.asarray(b[stage])
        if x.shape != y.shape:
            raise InputError(f"stage {stage!r} has shape {x.shape} on one side and {y.shape} on the "
                             f"other: models of different shapes cannot be compared")
        weights = (stage_kind(stage) or "").endswith("_w")
        where = contract_positions(pad_id, src, tgt, stage)
        x, y = _select(x, where, weights), _select(y, where, weights)
        finite = bool(np.isfinite(x).all() and np.isfinite(y).all())
        rel = relative_error(x, y) if finite else float("inf")
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
