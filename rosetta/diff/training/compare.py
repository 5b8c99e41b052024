"""Two training traces side by side: did they see the same batches, at which step do they first
part, and where inside that step (docs/training_diff.md).

Per step: the loss and the learning rate (relative error), the gradients before clipping
(‖g_a − g_b‖ / ‖g_b‖ over every tensor) and the weights after the update. The weights are
compared against the step's own update, ‖θ_a − θ_b‖ / ‖θ_b(k) − θ_b(k−1)‖, less the rounding of
storing them (2u‖θ_b‖, u the unit roundoff of float64): relative to ‖θ‖ an optimizer mistake
would vanish, since one update moves a weight by ~lr. That holds in float64 only: float32 weights
are compared relative to ‖θ‖ (update_rel says why), so optimizer mistakes need float64 traces.
Past the steps stored whole, the per-tensor norms stand in for the tensors. B is the reference.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from rosetta.diff.training.trace import Trace
from rosetta.errors import InputError
from rosetta.params import Params
from rosetta.parity import TOLERANCES as PARITY_TOLERANCES
from rosetta.parity import relative_error

# The default tolerance by the traces' dtype (the coarser side's): float64 loops part only by
# summation order (~1e-15 per operation, grown by a few steps of Adam); float32 as a forward pass.
# A run whose forward pass computed in bfloat16 (its trace's compute_dtype): rosetta.parity's entry.
TOLERANCES = {"float64": 1e-9, "float32": 1e-5, "bfloat16": PARITY_TOLERANCES[("torch", "bfloat16")]}
UNIT_ROUNDOFF = 2.0**-53  # float64's
SHAPE_FIELDS = ("src_vocab_size", "tgt_vocab_size", "d_model", "num_heads", "num_encoder_layers",
                "num_decoder_layers", "d_ff", "share_embeddings")


def compared(names) -> list[str]:
    """The tensors compared: all but the key projections' biases, whose gradient is 0 in exact
    arithmetic (a constant added to a row of scores cancels in the softmax), so that Adam turns
    rounding noise into updates of either sign (PITFALLS 14); they change no output."""
    return [n for n in names if not n.endswith(".k.bias")]


class StepRow(NamedTuple):
    step: int
    same_batch: bool
    loss: float
    lr: float
    grads: float
    params: float
    whole: bool                 # compared tensor by tensor (else by per-tensor norms)
    over: tuple[str, ...]       # which of loss, lr, grads, params exceed the tolerance


def rel(a: float, b: float) -> float:
    return 0.0 if a == b else abs(a - b) / abs(b) if b else math.inf


def global_rel(a: Params, b: Params) -> float:
    """‖a − b‖ / ‖b‖ over every tensor at once."""
    num = math.sqrt(sum(float(((a[n].astype(np.float64) - b[n]) ** 2).sum()) for n in compared(b)))
    den = math.sqrt(sum(float((b[n].astype(np.float64) ** 2).sum()) for n in compared(b)))
    return 0.0 if num == 0 else num / den if den else math.inf


def update_rel(after_a: Params, after_b: Params, before_b: Params, dtype_a: str) -> float:
    """‖θ_a − θ_b‖ / ‖θ_b − θ_b(before)‖ less the rounding of stored weights (module docstring);
    for float32 weights ‖θ_a − θ_b‖ / ‖θ_b‖ (Adam maps the rounding of a small gradient to a
    whole update, parity_tests/dp_case.py: no float32 bound on the update would still catch a bug)."""
    if dtype_a != "float64":
        return global_rel(after_a, after_b)
    names = compared(after_b)
    diff = math.sqrt(sum(float(((after_a[n].astype(np.float64) - after_b[n]) ** 2).sum()) for n in names))
    moved = math.sqrt(sum(float(((after_b[n].astype(np.float64) - before_b[n]) ** 2).sum()) for n in names))
    size = math.sqrt(sum(float((after_b[n].astype(np.float64) ** 2).sum()) for n in names))
    floor = 2 * UNIT_ROUNDOFF * size
    excess = max(0.0, diff - floor)
    return 0.0 if excess == 0 else excess / moved if moved else math.inf


def norms_rel(a: Mapping[str, float], b: Mapping[str, float]) -> float:
    num = math.sqrt(sum((a[n] - b[n]) ** 2 for n in compared(b)))
    den = math.sqrt(sum(b[n] ** 2 for n in compared(b)))
    return 0.0 if num == 0 else num / den if den else math.inf


def per_tensor(a: Params, b: Params) -> dict[str, float]:
    return {n: relative_error(a[n].astype(np.float64), b[n].astype(np.float64)) if np.any(b[n]) else
            (0.0 if not np.any(a[n]) else math.inf) for n in compared(b)}


def check_comparable(a: Trace, b: Trace, steps: int | None) -> int:
    """The number of steps to compare; a one-line refusal for traces of different models or lengths."""
    ca, cb = a.cfg.to_dict(), b.cfg.to_dict()
    for name in SHAPE_FIELDS:
        if ca[name] != cb[name]:
            raise InputError(f"the traces are of different models: {name} {ca[name]} in {a.path}, "
                             f"{cb[name]} in {b.path}")
    if steps is not None:
        if steps > min(len(a), len(b)):
            raise InputError(f"--steps {steps}: {a.path} has {len(a)} steps, {b.path} {len(b)}")
        return steps
    if len(a) != len(b):
        raise InputError(f"the traces have different lengths: {len(a)} steps in {a.path}, {len(b)} in "
                         f"{b.path}: give --steps N to compare the first N")
    return len(a)


def config_notes(a: Trace, b: Trace) -> list[str]:
    """What differs in the model configs beyond the shapes (dropout above all: two runs with
    dropout draw different masks and cannot agree step by step)."""
    ca, cb = a.cfg.to_dict(), b.cfg.to_dict()
    notes = [f"model config {k}: A {ca[k]!r}, B {cb[k]!r}" for k in ca if ca[k] != cb.get(k)]
    for side, trace in (("A", a), ("B", b)):
        rates = [trace.cfg.dropout, trace.cfg.activation_dropout_rate, trace.cfg.attention_dropout]
        if any(rates):
            notes.append(f"{side} trains with dropout {max(rates):g}: two runs' masks differ, so their steps "
                         f"can agree only without dropout (trace both with dropout 0: `--set dropout=0` for "
                         f"rosetta train, the model's dropout rates at 0 in a loop of your own)")
    return notes


def compare_traces(a: Trace, b: Trace, tolerance: float, steps: int) -> list[StepRow]:
    """One row per step until (and including) the first step whose batches differ."""
    rows = []
    for k in range(1, steps + 1):
        ra, rb = a.steps[k - 1], b.steps[k - 1]
        same = ra.batch_sha256 == rb.batch_sha256
        whole = k <= min(a.full_steps, b.full_steps)
        if whole:
            fa, fb = a.full(k), b.full(k)
            before = b.full(k - 1).params if k > 1 else b.initial()
            coarse = "float64" if a.dtype == b.dtype == "float64" else "float32"
            grads, params = global_rel(fa.grads, fb.grads), update_rel(fa.params, fb.params, before, coarse)
        else:
            grads, params = norms_rel(ra.grad_norms, rb.grad_norms), norms_rel(ra.param_norms, rb.param_norms)
        values = {"loss": rel(ra.loss, rb.loss), "lr": rel(ra.lr, rb.lr), "grads": grads, "params": params}
        over = tuple(name for name, v in values.items() if not v <= tolerance)
        rows.append(StepRow(k, same, *values.values(), whole, over if same else ("batch",)))
        if not same:
            break
    return rows


def first_over(rows: list[StepRow]) -> StepRow | None:
    return next((r for r in rows if r.over), None)


def initial_difference(a: Trace, b: Trace, tolerance: float) -> tuple[str, float] | None:
    """The first initial weight tensor that differs (canonical order), with its relative error."""
    errors = per_tensor(a.initial(), b.initial())
    return next(((n, e) for n, e in errors.items() if not e <= tolerance), None)


def localize(a: Trace, b: Trace, row: StepRow, tolerance: float, dumped: tuple[str, ...] = ()) -> list[str]:
    """Inside the first step that differs: which part of the step parts first. `dumped`: the sides
    ("A", "B") whose forward dump of this step is compared below (commands.forward_check)."""
    k = row.step
    ra, rb = a.steps[k - 1], b.steps[k - 1]
    if row.over == ("batch",):
        return [f"the runs saw different batches from step {k} (their batch hashes differ): the data order, "
                f"the batching or the seed differ, and nothing after that can be compared step by step"]
    lines = []
    if "lr" in row.over:
        lines.append(f"the learning rate: A {ra.lr:.6e}, B {rb.lr:.6e} (× {ra.lr / rb.lr:.4g}): the schedule"
                     if rb.lr else f"the learning rate: A {ra.lr:.6e}, B 0")
    if "loss" in row.over:
        where = (f"the stage table below compares {' and '.join(dumped)}'s forward pass" if dumped else
                 f"a forward dump of this step compares the forward pass stage by stage: "
                 f"TraceWriter.forward({k}, stages) with capture_torch or capture_nnx on its src and tgt_in, "
                 f"before the update")
        lines.append(f"the loss, on the same weights and batch: A {ra.loss:.10g}, B {rb.loss:.10g}: the "
                     f"forward pass or the loss's definition (--diagnose replays the loss variants; {where})")
    if not row.whole:
        if row.over and not lines:
            whole = min(a.full_steps, b.full_steps)
            lines.append(f"step {k} is past the steps stored whole ({whole}): only norms compared; trace "
                         f"with --trace {k} or more to localize it")
        return lines
    fa, fb = a.full(k), b.full(k)
    if "grads" in row.over:
        errors = per_tensor(fa.grads, fb.grads)
        first = next(n for n, e in errors.items() if not e <= tolerance)
        worst = max(errors, key=lambda n: errors[n])
        lines.append(f"the gradients: first tensor over the tolerance {first} ({errors[first]:.3e}), the "
                     f"worst {worst} ({errors[worst]:.3e})")
    if "params" in row.over and "grads" not in row.over and "lr" not in row.over:
        before = b.full(k - 1).params if k > 1 else b.initial()
        lines.append("the update, with the same gradients and learning rate: the optimizer. " +
                     _update_shape(fa.params, fb.params, before))
    return lines


def _update_shape(after_a: Params, after_b: Params, before: Params) -> str:
    """How A's update relates to B's: a scale (learning rate), a pull toward 0 (decay), or neither."""
    names = compared(before)
    da = np.concatenate([(after_a[n].astype(np.float64) - before[n]).ravel() for n in names])
    db = np.concatenate([(after_b[n].astype(np.float64) - before[n]).ravel() for n in names])
    theta = np.concatenate([before[n].astype(np.float64).ravel() for n in names])
    scale = float(da @ db / (db @ db)) if db.any() else math.nan
    rest = np.linalg.norm(da - scale * db) / max(np.linalg.norm(da - db), 1e-300)
    decay = float(-(da - db) @ theta / (theta @ theta))
    rest_decay = np.linalg.norm(da - db + decay * theta) / max(np.linalg.norm(da - db), 1e-300)
    if rest < 0.05:
        return f"A's update is {scale:.4g} × B's: the learning rate or a step-size factor (bias correction?)"
    if rest_decay < 0.05:
        return f"A's update differs by -{decay:.3g}·θ: weight decay (decoupled, lr·λ = {decay:.3g})"
    return ("neither a scale of B's update nor a decay: the optimizer's moments (β1, β2, ε), clipping or "
            "another rule of the update (--diagnose replays the catalogued ones)")


def format_rows(rows: list[StepRow], tolerance: float) -> str:
    first = first_over(rows)
    head = f"{'step':>5}  {'batch':<5}  {'loss':>10}  {'lr':>10}  {'grads':>10}  {'params':>10}"
    lines = [f"{head}  over {tolerance:.0e}?"]
    for r in rows:
        mark = "  <- first difference" if r is first else ""
        verdict = "ok" if not r.over else "OVER " + ",".join(r.over)
        norms = "" if r.whole else " (norms)"
        lines.append(f"{r.step:>5}  {'same' if r.same_batch else 'DIFF':<5}  {r.loss:10.3e}  {r.lr:10.3e}  "
                     f"{r.grads:10.3e}  {r.params:10.3e}  {verdict}{norms}{mark}")
    return "\n".join(lines)


class LossRule(NamedTuple):
    accepted: bool
    difference: float  # |loss_a − loss_b| at step 1
    budget: float      # 2 · mean over the loss's tokens of ROUNDINGS · u · max_j |z_j|


def low_precision_loss_rule(a: Trace, b: Trace) -> LossRule | None:
    """The 16-bit rule for training (docs/training_diff.md), on step 1, whose weights both runs
    share: one 16-bit forward moves each logit by at most delta = ROUNDINGS·u·max_j |z_j| (the
    forward diff's rule, rosetta.diff.shared.metrics), and a token's cross entropy, whose gradient in
    the logits p − q has L1 norm <= 2 (label smoothing or not), by at most 2·delta; so the losses
    may differ by 2·mean(delta) over the loss's tokens. z: the float64 reference's logits on B's
    initial weights. None when step 1 is not stored whole in B. Later steps have no such bound:
    Adam passes rounding on as whole updates (update_rel)."""
    from numpy_ref.model import forward
    from rosetta.diff.shared.metrics import BFLOAT16_U, ROUNDINGS

    if b.full_steps < 1:
        return None
    step = b.full(1)
    z = forward({n: v.astype(np.float64) for n, v in b.initial().items()}, b.cfg, step.src, step.tgt_in)
    counted = step.labels != b.cfg.pad_id
    delta = ROUNDINGS * BFLOAT16_U * np.abs(z).max(axis=-1)[counted]
    budget = 2 * float(delta.mean()) if delta.size else 0.0
    difference = abs(a.steps[0].loss - b.steps[0].loss)
    return LossRule(difference <= budget, difference, budget)
