"""`rosetta diff A B --diagnose` on two training traces: which catalogue mistake explains A.

B is the reference and must hold its training settings (our trainers write them). Its steps are
first replayed in float64 as they are (catalogue.py): the replay must
reproduce B, or B cannot be the base of a diagnosis (dropout, another loss). Then every entry
that applies is replayed alone, and if none brings A's difference under the tolerance, each of
the best three paired with every other; each is scored by the worst relative error against A
over the steps stored whole (loss, gradients, weights against the step's update: compare.py's
metrics). Ranked by that error; the fraction explained is 1 − error / error of the correct replay.
When nothing gets under the tolerance, the report says so and lists the closest: never a diagnosis
by elimination. Two entries no replay can match are judged otherwise (checks.py): TF32 by the
size of A's difference, as a hint only; dropout left on at evaluation on the evaluations a trace
records, which are checked whatever the steps say.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import NamedTuple

import numpy as np

from rosetta.diff.training.autodiff import replay_framework
from rosetta.diff.training.catalogue import (
    ENTRIES,
    Entry,
    ReplayStep,
    Settings,
    Variant,
    clip,
    decayed,
    first_step,
    replay,
    schedule_lr,
    with_decay,
)
from rosetta.diff.training.checks import Finding, evaluation_findings, tf32_by_size
from rosetta.diff.training.compare import global_rel, rel, update_rel
from rosetta.diff.training.trace import Trace
from rosetta.errors import InputError, RosettaError

PAIR_LEAD = 3  # pairs are tried between each of this many best single entries and every other
SHOWN = 3


class Candidate(NamedTuple):
    names: tuple[str, ...]
    variant: Variant
    error: float            # worst over the steps and quantities
    worst_step: int | None  # the step of that error (None: no error anywhere)


@dataclass
class TrainingDiagnosis:
    tolerance: float
    steps: int
    clean_error: float
    ranked: list[Candidate]
    refused: str | None = None
    findings: list[Finding] = field(default_factory=list)  # judged by size or on the evaluations
    verdict: str | None = None  # the steps were not replayed: why (they agree, or cannot be compared)

    @property
    def explained(self) -> Candidate | None:
        """The replay that explains A, else the first entry a finding names, else None."""
        best = self.ranked[0] if self.ranked else None
        if best is not None and best.error <= self.tolerance:
            return best
        named = [f.name for f in self.findings if f.name]
        return Candidate((named[0],), Variant(), math.nan, None) if named else None

    def report(self) -> str:
        named = [f.line for f in self.findings if f.name]  # a diagnosis first, hints and unexplained last
        return "\n".join(named + [self._training()] + [f.line for f in self.findings if not f.name])

    def _training(self) -> str:
        if self.verdict:
            return self.verdict
        if self.refused:
            return f"diagnosis: not diagnosed: {self.refused}"
        if self.clean_error <= self.tolerance:
            return "diagnosis: nothing to explain: A agrees with the float64 replay of B's settings"
        lines = []
        best = self.explained
        if best is not None and not best.error <= self.tolerance:
            return "the replays: none matches A's steps; the finding above names the mistake"
        if best is not None:
            lines.append(f"diagnosis: {' + '.join(best.names)} explains the difference over steps "
                         f"1..{self.steps} (error {self.clean_error:.3e} -> {best.error:.3e})")
            for name in best.names:
                entry = _entry(name)
                lines += [f"  mistake: {entry.wrong}{_decay_note(entry, best.variant)}",
                          f"  fix: {entry.fix}"]
        else:
            lines.append(f"diagnosis: not explained: no catalogue entry, alone or in pairs, brings the "
                         f"difference under {self.tolerance:.0e} (error of the correct replay "
                         f"{self.clean_error:.3e}); a difference of its own (the model, the data, dropout "
                         f"masks) or a mistake not catalogued")
        lines.append("closest:" if best is None else "ranked:")
        for c in self.ranked[:SHOWN]:
            share = max(0.0, 1 - c.error / self.clean_error) if self.clean_error else 0.0
            lines.append(f"  {' + '.join(c.names):<34} error {c.error:.3e}  explains {100 * share:.6g}%")
        return "\n".join(lines)


def _entry(name: str) -> Entry:
    return next(e for e in ENTRIES if e.name == name)


def _decay_note(entry: Entry, variant: Variant) -> str:
    if entry.fit == "decay":
        return f" (λ fitted: {variant.decay:.3g})"
    if entry.fit == "lr_scale":
        return f" ({'rate' if variant.schedule == 'constant' else 'factor'} fitted: {variant.lr_scale:.6g})"
    return ""


def error_against(observed: Trace, ours: Iterable[ReplayStep], initial: dict) -> tuple[float, int | None]:
    """The worst relative error of `observed` against a replay over the replay's steps (loss, lr,
    gradients, weights: compare.py's metrics), and the step where it is."""
    return errors_against((observed,), ours, initial)[0]


def errors_against(observed: Sequence[Trace], ours: Iterable[ReplayStep], initial: dict,
                   bound: float = math.inf) -> list[tuple[float, int | None]]:
    """error_against for several traces in one pass of the replay, which is read one step at a
    time (memory: the weights before the step, whatever the number of steps). Once every error is
    over `bound` the replay stops: the error is a maximum over steps, so it can only grow."""
    worst = [(0.0, None) for _ in observed]
    before = initial
    for k, step in enumerate(ours, 1):
        for i, trace in enumerate(observed):
            seen = trace.full(k)
            error = max(rel(trace.steps[k - 1].loss, step.loss), rel(trace.steps[k - 1].lr, step.lr),
                        global_rel(seen.grads, step.grads),
                        update_rel(seen.params, step.params, before, trace.dtype))
            if not error <= worst[i][0]:
                worst[i] = (error, k)
        before = step.params
        if all(w[0] > bound for w in worst):
            break
    return worst


def check_settings(b: Trace) -> None:
    """What --diagnose refuses before the traces are compared (InputError, one line): B's recorded
    settings that cannot be replayed (`accumulate` 0, -1, "2", true; a TrainConfig field). Any
    `accumulate` >= 1 replays: as many micro-batches as rows at most, and those only for the one
    mistake that clips inside the accumulation (catalogue.accumulated). A B without settings (a
    user's loop) is left to the report, which says so."""
    if not b.train_config:
        return
    try:
        Settings.from_trace(b.train_config)
    except RosettaError as e:
        raise InputError(f"{b.path}: train_config: {e}") from None


def diagnose_training(a: Trace, b: Trace, tolerance: float, steps: int,
                      verdict: str | None = None) -> TrainingDiagnosis:
    """Explain A's difference from B with the catalogue (module docstring); the evaluations each
    trace records checked first (rosetta/diff/training/checks.py). `verdict`: the steps are not
    replayed, and this line says why (they agree, or saw different batches)."""
    findings = evaluation_findings(a, "A", tolerance) + evaluation_findings(b, "B", tolerance)
    if verdict is not None:
        return TrainingDiagnosis(tolerance, 0, math.nan, [], findings=findings, verdict=verdict)
    result = _diagnose_steps(a, b, tolerance, steps)
    result.findings = findings + result.findings
    return result


def _diagnose_steps(a: Trace, b: Trace, tolerance: float, steps: int) -> TrainingDiagnosis:
    if not b.train_config:
        return TrainingDiagnosis(tolerance, 0, math.nan, [], refused=f"{b.path} holds no training settings "
                                 f"(a trace of our trainers does: `rosetta train --trace N`); give it as B")
    try:
        settings = Settings.from_trace(b.train_config)
    except RosettaError as e:
        return TrainingDiagnosis(tolerance, 0, math.nan, [], refused=f"{b.path}: train_config: {e}")
    try:
        replay_framework(b.writer)  # B's own framework, or whichever is installed (autodiff.py)
    except RosettaError as e:
        return TrainingDiagnosis(tolerance, 0, math.nan, [], refused=str(e))
    n = min(a.full_steps, b.full_steps, steps)
    if n == 0:
        return TrainingDiagnosis(tolerance, 0, math.nan, [], refused="no step is stored whole in both traces "
                                 "(trace with --trace N, N >= 1)")
    cache: dict = {}
    initial = {k: v.astype("float64") for k, v in b.initial().items()}
    (own, _), (clean_error, _) = errors_against((b, a), replay(b, settings, Variant(), n, cache), initial)
    if not own <= tolerance:
        return TrainingDiagnosis(tolerance, n, math.nan, [], refused=(
            f"the float64 replay of B does not reproduce B itself (error {own:.3e}): B trained with dropout, "
            f"or with settings its trace does not record; trace both runs with dropout 0 (`--set dropout=0` "
            f"for rosetta train)"))
    result = TrainingDiagnosis(tolerance, n, clean_error, [])
    if clean_error <= tolerance:
        return result
    singles = [_candidate(a, b, settings, n, cache, initial, (e,)) for e in ENTRIES
               if e.judged == "replay" and e.applies(settings)]
    singles.sort(key=_rank)
    ranked = list(singles)
    if not (singles and singles[0].error <= tolerance):
        lead = [_entry(c.names[0]) for c in singles[:PAIR_LEAD]]
        others = [_entry(c.names[0]) for c in singles]
        best, tried = tolerance, set()
        for x in lead:
            for y in others:
                key = frozenset((x.name, y.name))
                if x is not y and key not in tried and _compatible(x, y, settings):
                    tried.add(key)
                    # A pair answers one question: does it explain A? Its replay stops at the first
                    # step over the tolerance (or over the best pair so far: the error is a maximum
                    # over steps, so it can only grow), and such a pair is not listed.
                    pair = _candidate(a, b, settings, n, cache, initial, (x, y), bound=best)
                    if pair.error <= best:
                        ranked.append(pair)
                        best = pair.error
        ranked.sort(key=_rank)
    result.ranked = ranked
    if result.explained is None and "float32" in (a.dtype, a.compute_dtype):
        size = tf32_by_size(a, b, settings, first_step(b, settings, Variant(), cache), tolerance)
        result.findings += [size] if size else []
    return result


def _rank(c: Candidate) -> tuple[float, int]:
    """By error to three digits, then the simpler explanation (one entry before two: a pair whose
    second entry changes nothing, a decay fitted to ~0, does not outrank the single)."""
    return float(f"{c.error:.2e}"), len(c.names)


def _compatible(x: Entry, y: Entry, settings: Settings) -> bool:
    """Two entries combine when they switch different fields of the Variant."""
    base = Variant()
    fx = {f.name for f in fields(Variant) if getattr(x.variant(settings), f.name) != getattr(base, f.name)}
    fy = {f.name for f in fields(Variant) if getattr(y.variant(settings), f.name) != getattr(base, f.name)}
    return not (fx & fy)


def _candidate(a: Trace, b: Trace, settings: Settings, n: int, cache: dict, initial: dict,
               entries: tuple[Entry, ...], bound: float = math.inf) -> Candidate:
    variant = Variant()
    for entry in entries:
        switched = entry.variant(settings)
        variant = replace(variant, **{f.name: getattr(switched, f.name) for f in fields(Variant)
                                      if getattr(switched, f.name) != getattr(Variant(), f.name)})
    if any(e.fit == "lr_scale" for e in entries):  # first: the decay's fit replays with the rates
        variant = replace(variant, lr_scale=_fit_lr_scale(a, b, settings, variant))
    if any(e.fit == "decay" for e in entries):
        variant = with_decay(variant, _fit_decay(a, b, settings, variant, cache, initial, n, bound))
    ours = replay(b, settings, variant, n, cache)
    error, where = errors_against((a,), ours, initial, bound)[0]
    return Candidate(tuple(e.name for e in entries), variant, error, where)


def _fit_lr_scale(a: Trace, b: Trace, settings: Settings, variant: Variant) -> float:
    """The factor of `schedule_scaled`: A's learning rates over the variant's at λ = 1, least
    squares over every step recorded (the rates are in every step's record)."""
    ours = np.array([schedule_lr(k, b.cfg.d_model, settings.train, replace(variant, lr_scale=1.0))
                     for k in range(1, len(a) + 1)])
    seen = np.array([r.lr for r in a.steps])
    return float(seen @ ours / (ours @ ours)) if ours.any() else 1.0


def _fit_decay(a: Trace, b: Trace, settings: Settings, variant: Variant, cache: dict, initial: dict,
               n: int, bound: float = math.inf) -> float:
    """λ of a decay entry, from step 1, where the gradients are the reference's (cached).
    Decoupled: θ1 = θ1(λ = 0) − lr1·λ·θ0 on the decayed tensors, a linear least-squares fit.
    L2 through Adam (eps outside the root, bias-corrected): update1 = lr1·ĝ/(|ĝ| + ε) for
    ĝ = g + λθ0, inverted element by element, ĝ = sign(r)·ε|r|/(1 − |r|) with r the update over
    lr1, then λ fitted by least squares weighted by each inversion's conditioning. Any other
    combination: a grid over log10 λ in [-7, 0], then golden-section search (`_search_decay`)."""
    seen = a.full(1).params
    base = first_step(b, settings, with_decay(variant, 0.0), cache)
    masked = [k for k, v in initial.items() if decayed(k, v, variant)]
    theta = np.concatenate([initial[k].ravel() for k in masked])
    if not base.lr:  # a schedule whose first rate is 0: step 1 does not move with λ
        return _search_decay(a, b, settings, variant, cache, initial, n, bound)
    if variant.decoupled:
        drift = np.concatenate([(seen[k] - base.params[k]).ravel() for k in masked])
        return max(float(-(drift @ theta) / (base.lr * (theta @ theta))), 0.0)
    if not variant.bias_correction or variant.eps_inside_sqrt:
        return _search_decay(a, b, settings, variant, cache, initial, n, bound)
    eps = variant.eps if variant.eps is not None else settings.train.adam_eps
    clipped = clip(base.grads, settings.train.clip_norm, variant)
    r = np.concatenate([((initial[k] - seen[k]) / base.lr).ravel() for k in masked])
    g = np.concatenate([clipped[k].ravel() for k in masked])
    ok = np.abs(r) < 1
    g_hat = np.sign(r[ok]) * eps * np.abs(r[ok]) / (1 - np.abs(r[ok]))
    weight = ((1 - np.abs(r[ok])) / (np.abs(g_hat) + eps)) ** 2  # inverse variance of each inversion
    scale = float((weight * theta[ok]) @ theta[ok])
    if not scale > 0:  # no coordinate moved less than lr1 (a larger rate in A): no λ fits, 0 rather than NaN
        return 0.0
    return max(float((weight * (g_hat - g[ok])) @ theta[ok]) / scale, 0.0)


def _search_decay(a: Trace, b: Trace, settings: Settings, variant: Variant, cache: dict, initial: dict,
                  n: int, bound: float = math.inf) -> float:
    """λ by search: the best of a grid over log10 λ in [-7, 0] in quarters on step 1, then
    golden-section search within a quarter of it on steps 1-2. With a `bound` (a pair's), the
    golden-section search on step 1 alone comes first, at no model evaluation (step 1's gradients
    are cached): if step 1 at its best λ is over the bound, so is the pair at any λ of that bracket
    (its error is a maximum over steps, step 1's among them), and that λ is returned as it is."""
    def error(log_decay: float, steps: int = 1) -> float:
        ours = replay(b, settings, with_decay(variant, 10.0**log_decay), steps, cache)
        return error_against_one(a, ours, initial)

    start = min((x / 4 for x in range(-28, 1)), key=error)

    def golden(steps: int) -> float:
        lo, hi = start - 0.25, start + 0.25
        ratio = (math.sqrt(5) - 1) / 2
        x1, x2 = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        f1, f2 = error(x1, steps), error(x2, steps)
        for _ in range(50):  # the bracket shrinks to 0.5 * 0.618^50: 2e-11 in log10 λ
            if f1 <= f2:
                hi, x2, f2 = x2, x1, f1
                x1 = hi - ratio * (hi - lo)
                f1 = error(x1, steps)
            else:
                lo, x1, f1 = x1, x2, f2
                x2 = lo + ratio * (hi - lo)
                f2 = error(x2, steps)
        return (lo + hi) / 2

    if bound < math.inf:
        first = golden(1)
        if error(first) > bound:
            return 10.0**first
    return 10.0 ** golden(min(2, n))


def error_against_one(a: Trace, ours: Iterable[ReplayStep], initial: dict) -> float:
    return error_against(a, ours, initial)[0]
