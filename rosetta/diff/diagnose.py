"""`rosetta diff --diagnose`: which catalogue entry explains where two implementations part.

We know one side's weights (cfg, params) and observe the other side's stages. Every catalogue
entry that applies is built from the correct model (rosetta.diff.catalogue) and compared with
the observation; if none brings the error under the tolerance, pairs of the best few are tried
(ports make mistakes in twos: a converter that transposes and a loop that forgets the offset).
Candidates rank by the error that remains (the worst stage), ties going to the simpler
explanation: one entry before two, fewer stages changed before more. docs/diagnose.md.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from rosetta.config import ModelConfig
from rosetta.diff.catalogue import BY_NAME, CATALOGUE, Entry, as_float64, build, mistaken_stages
from rosetta.diff.compare import contract_positions
from rosetta.diff.dump import stage_kind, stage_order
from rosetta.diff.variant import Stages, forward_stages
from rosetta.errors import ConfigError, InputError
from rosetta.parity import relative_error

__all__ = ["Diagnosis", "Explanation", "diagnose", "mistaken_stages", "stage_errors"]

DEFAULT_TOLERANCE = 1e-5  # float32 against the float64 reference (rosetta.parity.TOLERANCES)
PAIR_POOL = 6  # pairs are tried among this many best single entries,
PAIR_LEAD = 3  # and between each of this many best and every other entry
SHOWN = 3  # the closest candidates listed when nothing explains the difference


class Explanation(NamedTuple):
    names: tuple[str, ...]
    fix: str              # the fixes of the entries, joined with " and "
    rel_before: float     # worst stage: the correct model against the observation
    rel_after: float      # worst stage: the mistaken model against the observation
    first_stage: str | None  # where the correct model and the observation part


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    """rosetta.parity.relative_error, NaN-aware: NaN where the other side has NaN too is a match
    (a -inf fill's NaN rows are what we look for), any other non-finite mismatch is infinite.
    rosetta.diff.compare calls every non-finite stage infinite, which is right for a report and
    would make the -inf fill unexplainable here."""
    fa, fb = np.isfinite(a), np.isfinite(b)
    if not (fa.all() and fb.all()):
        same = (fa == fb) & (fa | (np.isnan(a) & np.isnan(b)) | (a == b))
        if not same.all():
            return float("inf")
        a, b = np.where(fa, a, 0.0), np.where(fb, b, 0.0)
    return relative_error(a, b)


def stage_errors(cfg: ModelConfig, src: np.ndarray, tgt: np.ndarray, ours: Stages,
                 observed: Mapping[str, np.ndarray]) -> dict[str, float]:
    """Relative error of `ours` against `observed` per common stage, in forward order
    (rosetta.diff.dump.stage_order: a softmax before the projection that reads it)."""
    out = {}
    for stage in sorted(set(ours) & set(observed), key=stage_order):
        value = ours[stage]
        seen = np.asarray(observed[stage], dtype=np.float64)
        if seen.shape != value.shape:
            raise InputError(f"observed stage {stage!r} has shape {seen.shape}; the model "
                             f"gives {value.shape} for this src and tgt")
        # The contract positions of rosetta diff's own table (SPEC §2): padded positions hold
        # whatever masking leaves there. Attention weights [B, h, Tq, Tk] at their query rows.
        where = contract_positions(cfg.pad_id, src, tgt, stage)
        if (stage_kind(stage) or "").endswith("_w"):
            a, b = np.moveaxis(value, 1, 2)[where], np.moveaxis(seen, 1, 2)[where]
        else:
            a, b = value[where], seen[where]
        out[stage] = _rel(a, b)
    return out


def _worst(errors: dict[str, float]) -> float:
    return max(errors.values(), default=0.0)


@dataclass
class Diagnosis:
    """The result: where the sides part, and the candidates best first."""

    tolerance: float
    errors: dict[str, float]          # per stage, the correct model against the observation
    candidates: list[Explanation]     # every candidate tried, best first

    @property
    def first_stage(self) -> str | None:
        return next((s for s, rel in self.errors.items() if not rel <= self.tolerance), None)

    @property
    def rel_before(self) -> float:
        return _worst(self.errors)

    @property
    def best(self) -> Explanation | None:
        """The best candidate if it brings every stage within the tolerance, else None."""
        if self.first_stage is None or not self.candidates:
            return None
        top = self.candidates[0]
        return top if top.rel_after <= self.tolerance else None

    def report(self) -> str:
        first = self.first_stage
        if first is None:
            return (f"no difference: every compared stage is within {self.tolerance:.0e} "
                    f"(worst rel {self.rel_before:.1e}); nothing to explain")
        head = f"{first} diverges (rel {self.errors[first]:.1e})"
        if self.best is not None:
            b = self.best
            return (f"{head}; explained by {b.fix} [{' + '.join(b.names)}] "
                    f"(rel after: {b.rel_after:.1e}, worst stage before: {b.rel_before:.1e})")
        lines = [f"{head}; nothing in the catalogue explains the difference "
                 f"(tolerance {self.tolerance:.0e}). Closest:"]
        if all(c.rel_after >= 0.9 * c.rel_before for c in self.candidates[:SHOWN]):
            lines[0] += " (no entry brings the error down by even 10%)"
        for c in self.candidates[:SHOWN]:
            lines.append(f"  {' + '.join(c.names)}: {c.fix} (rel after {c.rel_after:.1e}, "
                         f"before {c.rel_before:.1e})")
        return "\n".join(lines)


def _is_fine(observed: Mapping[str, np.ndarray]) -> bool:
    return any(s.endswith((".self_attn", ".cross_attn", ".ffn", ".weights")) for s in observed)


def diagnose(
    cfg: ModelConfig, params: Mapping[str, np.ndarray], src: np.ndarray, tgt: np.ndarray,
    observed: Mapping[str, np.ndarray], tolerance: float = DEFAULT_TOLERANCE, pairs: bool = True,
) -> Diagnosis:
    """Which catalogue entry, applied to the correct model (cfg, params), reproduces `observed`
    (the other side's stages for the same src and tgt)."""
    if not tolerance > 0:
        raise ConfigError(f"tolerance must be a positive number, got {tolerance!r}")
    src, tgt = np.asarray(src), np.asarray(tgt)
    params64, fine = as_float64(params), _is_fine(observed)
    correct = forward_stages(params64, cfg, src, tgt, fine=fine)
    errors = stage_errors(cfg, src, tgt, correct, observed)
    if not errors:
        raise InputError(f"the observation shares no stage with the model (it has "
                         f"{', '.join(sorted(observed)) or 'none'})")
    diagnosis = Diagnosis(tolerance, errors, [])
    first = diagnosis.first_stage
    if first is None:
        return diagnosis
    # The encoder's stages, reused by every entry that leaves the encoder alone.
    encoder = {s: v for s, v in correct.items() if s == "src_embed" or s.startswith("encoder")}
    before = diagnosis.rel_before

    def candidate(chosen: tuple[Entry, ...]) -> tuple[tuple, Explanation] | None:
        try:
            cfg2, params2, switches = build(chosen, cfg, params64)
        except ConfigError:  # two entries that contradict each other
            return None
        reuse = None if any(e.encoder for e in chosen) else encoder
        with np.errstate(all="ignore"):  # a wrong guess may overflow (silu of 1e7): no matter
            ours = forward_stages(params2, cfg2, src, tgt, switches, fine, reuse)
        remaining = stage_errors(cfg, src, tgt, ours, observed)
        after = _worst(remaining)
        changed = sum(not np.array_equal(ours[s], correct[s], equal_nan=True) for s in errors)
        explanation = Explanation(tuple(e.name for e in chosen),
                                  " and ".join(e.fix for e in chosen), before, after, first)
        # Worst stage first, then the mean over stages (which guess gets closer elsewhere).
        # Errors well inside the tolerance are ties (the observed side's rounding): then one
        # entry before two, fewer stages changed before more, then catalogue order.
        mean = float(np.mean(list(remaining.values())))
        settled = (0.0, 0.0) if after <= tolerance / 10 else (after, mean)
        return (*settled, len(chosen), changed), explanation

    applicable = [e for e in CATALOGUE if e.applies(cfg, src, tgt)]
    scored = [c for c in (candidate((e,)) for e in applicable) if c is not None]
    scored.sort(key=lambda c: c[0])
    if pairs and scored and scored[0][1].rel_after > tolerance / 10:
        # Every pair among the best few, and each of the very best with every other entry: a
        # large mistake can hide a small one that alone improves nothing (a table and an eps).
        ranked = [c[1].names[0] for c in scored]
        tried = dict.fromkeys(itertools.combinations(ranked[:PAIR_POOL], 2))
        for i, lead in enumerate(ranked[:PAIR_LEAD]):
            tried |= dict.fromkeys((lead, other) for other in ranked[i + 1:])
        for a, b in (tuple(BY_NAME[n] for n in pair) for pair in tried):
            if a.config is not None and b.config is not None and \
                    set(a.config(cfg)) & set(b.config(cfg)):
                continue  # two settings of the same field are not a pair
            result = candidate((a, b))
            if result is not None:
                scored.append(result)
        scored.sort(key=lambda c: c[0])
    diagnosis.candidates = [c[1] for c in scored]
    return diagnosis
