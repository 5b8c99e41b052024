"""`rosetta diff --diagnose`: which catalogue entry explains where two implementations part.

We know one side's weights (cfg, params) and observe the other side's stages. Every catalogue
entry that applies is built from the correct model (rosetta.diff.shared.catalogue) and compared with
the observation; if none brings the error under the tolerance, pairs of the best few are tried
(ports make mistakes in twos: a converter that transposes and a loop that forgets the offset).
Candidates rank by the error that remains (the worst stage), ties going to the simpler
explanation: one entry before two, fewer stages changed before more. docs/diagnose.md.

The errors are the table's (rosetta.diff.shared.metrics.stage_error, relative to the table's B), so
the stage `rosetta diff` marks shows the same number in the table and in the diagnosis. Both tools
run it: the forward diff on its two sides, the training diff on a step's forward dump.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from rosetta.config import ModelConfig
from rosetta.diff.shared.catalogue import BY_NAME, CATALOGUE, Entry, as_float64, build, mistaken_stages
from rosetta.diff.shared.dump import stage_order
from rosetta.diff.shared.metrics import counted, stage_error
from rosetta.diff.shared.variant import Stages, forward_stages
from rosetta.errors import ConfigError, InputError

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


def stage_errors(cfg: ModelConfig, src: np.ndarray, tgt: np.ndarray, ours: Stages,
                 observed: Mapping[str, np.ndarray], scale: Mapping[str, np.ndarray] | None = None,
                 ) -> dict[str, float]:
    """Relative error of `ours` against `observed` per common stage, in forward order
    (rosetta.diff.shared.dump.stage_order: a softmax before the projection that reads it), at the
    contract positions of rosetta diff's own table (SPEC §2): rosetta.diff.shared.metrics.stage_error,
    divided by the norm of `scale`'s stage (the table's B; default `observed`). NaN where the other
    side has NaN too is a match: a -inf fill's NaN rows are what the catalogue looks for."""
    out = {}
    for stage in sorted(set(ours) & set(observed), key=stage_order):
        value = ours[stage]
        seen = np.asarray(observed[stage], dtype=np.float64)
        if seen.shape != value.shape:
            raise InputError(f"observed stage {stage!r} has shape {seen.shape}; the model "
                             f"gives {value.shape} for this src and tgt")
        a, b = (counted(cfg.pad_id, src, tgt, stage, x) for x in (value, seen))
        reference = None if scale is None else counted(cfg.pad_id, src, tgt, stage, scale[stage])
        out[stage] = stage_error(a, b, reference, nan_matches=True)
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
    reference: str = "model",
) -> Diagnosis:
    """Which catalogue entry, applied to the correct model (cfg, params), reproduces `observed`
    (the other side's stages for the same src and tgt). `reference` names the side the errors are
    relative to, the table's B (docs/diff.md): "model" when the weights are B's (the correct model's
    norm), "observed" when the observed stages are B's; one fixed norm per stage for every candidate,
    so they rank by their distance to the observation alone."""
    if not tolerance > 0:
        raise ConfigError(f"tolerance must be a positive number, got {tolerance!r}")
    if reference not in ("model", "observed"):
        raise ConfigError(f"reference must be 'model' or 'observed', got {reference!r}")
    src, tgt = np.asarray(src), np.asarray(tgt)
    params64, fine = as_float64(params), _is_fine(observed)
    correct = forward_stages(params64, cfg, src, tgt, fine=fine)
    scale = correct if reference == "model" else observed
    errors = stage_errors(cfg, src, tgt, correct, observed, scale)
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
        remaining = stage_errors(cfg, src, tgt, ours, observed, scale)
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
