"""The two catalogue entries of `rosetta diff --diagnose` that a replay cannot match bit for bit,
judged another way (docs/training_diff.md, "Judged by size, judged on the evaluations").

- `tf32_matmuls`, by size, as a hint only. TF32 rounds every matmul operand to 11 significant
  bits, and that rounding is discontinuous: two TF32 runs whose inputs differ by float32's rounding
  round some operands to neighbouring TF32 values, and their step-1 gradients differ from the exact
  ones by amounts that vary tenfold (1.4e-3 or 1.4e-2 on the tests' tiny model, from 1e-7
  perturbations of its weights). No replay reproduces a TF32 run to a float32 tolerance, and a size
  alone cannot tell TF32 from another mistake of that size (a LayerNorm ε, say), so A's step-1
  gradient difference is only compared with the spread of DRAWS TF32 replays of B (tf32.py) from
  weights perturbed at float32's rounding: within [min / SIZE_LOW, SIZE_HIGH × max] and far above
  float32's own difference, the report says that the size fits TF32, never that TF32 explains it.
  The emulation runs on PyTorch: without it the report says the size was not weighed.
- `dropout_at_evaluation`, on the evaluations a trace records (TraceWriter.evaluation: the mean
  token cross entropy without label smoothing, the model in evaluation mode). Each record at a step
  whose weights are stored is recomputed in float64 without dropout (the NumPy reference; the draws
  with dropout by a framework's model, autodiff.py). A deterministic evaluation
  gives that value to the tolerance; one that does not, from a model with dropout in its config,
  and inside the range of 4·DRAWS recomputations with that dropout left on (widened by SIGMAS
  standard deviations: one draw can fall anywhere in it, so the range, not the mean, decides) is
  named. One evaluation on a small batch cannot tell "dropout on" from "dropout on, and a lucky
  draw": the check asks only that the value be one dropout could give, the difference from the
  deterministic value being the evidence.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from numpy_ref.model import forward
from rosetta.config import ModelConfig
from rosetta.diff.training.autodiff import Float64Model, replay_framework
from rosetta.diff.training.catalogue import BY_NAME, ReplayStep, Settings, Variant, first_step, loss_value
from rosetta.diff.training.compare import global_rel
from rosetta.diff.training.trace import Trace
from rosetta.errors import RosettaError
from rosetta.params import Params

DRAWS = 4             # TF32 replays, and dropout recomputations of an evaluation (twice as many)
# A's gradient difference within [min / 16, 4 max] of the TF32 replays': below, the tenfold spread
# between TF32 runs seen above (the replays may all land high) with a 1.6x margin; above, a 4x one.
SIZE_LOW, SIZE_HIGH = 16.0, 4.0
FLOAT32_FLOOR = 30.0  # and at least 30 x the tolerance (float32's own difference is below it)
SIGMAS = 4.0          # dropout draws: their range widened by 4 standard deviations


class Finding(NamedTuple):
    name: str | None  # the catalogue entry named, or None: a difference nothing explains
    line: str


def tf32_by_size(a: Trace, b: Trace, settings: Settings, clean: ReplayStep,
                 tolerance: float) -> Finding | None:
    """`tf32_matmuls` when A's step-1 gradients differ from the float64 replay of B by TF32's
    amount (module docstring); None when they do not."""
    observed = global_rel(a.full(1).grads, clean.grads)
    if not observed > FLOAT32_FLOOR * tolerance:
        return None
    try:
        replay_framework(b.writer, tf32=True)
    except RosettaError as e:
        return Finding(None, f"hint: A's step-1 gradients differ from the float64 replay of B by "
                             f"{observed:.3e}; whether that is TF32's size is not weighed here: {e}")
    initial = b.initial()
    rng = np.random.default_rng(0)
    spread = []
    for draw in range(DRAWS):  # the first draw from B's own weights, the others perturbed at 2^-24
        nudged = initial if draw == 0 else {n: v * (1 + 2.0**-24 * rng.standard_normal(v.shape))
                                            for n, v in initial.items()}
        step = first_step(b, settings, Variant(tf32=True), initial=nudged)
        spread.append(global_rel(step.grads, clean.grads))
    low, high = min(spread) / SIZE_LOW, max(spread) * SIZE_HIGH
    if not low <= observed <= high:
        return None
    entry = BY_NAME["tf32_matmuls"]
    return Finding(None, f"hint: the size fits tf32_matmuls: A's step-1 gradients differ from the float64 "
                         f"replay of B by {observed:.3e}, {DRAWS} replays with TF32 matmuls by "
                         f"{min(spread):.3e} to {max(spread):.3e}, float32 alone by under {tolerance:.0e}. "
                         f"A size is not a diagnosis (TF32 is not reproducible bit for bit): if A ran on an "
                         f"NVIDIA GPU, {entry.fix}, and compare again")


def evaluation_loss(cfg: ModelConfig, params: Params, src: np.ndarray, tgt_in: np.ndarray, labels: np.ndarray,
                    dropout_seed: int | None = None, framework: str | None = None) -> float:
    """The evaluation loss a trace records (module docstring), in float64: without dropout, by the
    NumPy reference; or with the config's dropout left on, drawn from `dropout_seed` by `framework`'s
    model (autodiff.py; the NumPy reference has no dropout)."""
    if dropout_seed is None:
        logits = forward(params, cfg, src, tgt_in)
    else:
        logits = Float64Model(framework or replay_framework(), cfg, params).logits(src, tgt_in, dropout_seed)
    return loss_value(logits, labels, cfg.pad_id, 0.0, "ours")[0]


def evaluation_findings(trace: Trace, side: str, tolerance: float) -> list[Finding]:
    """Each evaluation `trace` records at a step whose weights it stores, against its own weights'
    loss (module docstring); one finding per evaluation that differs."""
    findings = []
    for record in getattr(trace, "evaluations", []):
        k = record.step
        if k > trace.full_steps:
            continue
        params = trace.initial() if k == 0 else trace.full(k).params
        params = {n: v.astype(np.float64) for n, v in params.items()}
        ids = trace.evaluation_batch(k)
        plain = evaluation_loss(trace.cfg, params, *ids)
        if abs(record.loss - plain) <= tolerance * abs(plain):
            continue
        where = f"{side}'s evaluation after step {k}: loss {record.loss:.8g}, its weights give {plain:.8g} " \
                f"without dropout"
        rates = (trace.cfg.dropout, trace.cfg.attention_dropout, trace.cfg.activation_dropout_rate)
        if not any(rates):
            findings.append(Finding(None, f"{where}, and its config has no dropout: the evaluation's model "
                                          f"or loss differ from the trace's (not explained)"))
            continue
        try:
            framework = replay_framework(trace.writer)
        except RosettaError as e:
            findings.append(Finding(None, f"{where}; with its dropout left on: not weighed: {e}"))
            continue
        draws = np.array([evaluation_loss(trace.cfg, params, *ids, dropout_seed=s, framework=framework)
                          for s in range(4 * DRAWS)])
        mean, spread = float(draws.mean()), float(draws.std(ddof=1))
        if draws.min() - SIGMAS * spread <= record.loss <= draws.max() + SIGMAS * spread:
            entry = BY_NAME["dropout_at_evaluation"]
            findings.append(Finding(entry.name, f"diagnosis: dropout_at_evaluation: {where}, and "
                                                f"{mean:.6g} ± {spread:.2g} with its dropout "
                                                f"({max(rates):g}) left on\n  mistake: {entry.wrong}\n"
                                                f"  fix: {entry.fix}"))
        else:
            findings.append(Finding(None, f"{where} and {mean:.6g} ± {spread:.2g} with dropout on: neither "
                                          f"(not explained)"))
    return findings

