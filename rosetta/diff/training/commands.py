"""`rosetta diff TRACE_A TRACE_B`: the command-line side of the training diff (docs/training_diff.md).
rosetta/diff/commands.py hands an invocation over when either side is a trace (or a run directory
holding one); errors are rosetta errors (exit code 2). Inside the first step that differs, a trace's
forward dump of that step (rosetta/diff/training/trace_files.py) is compared with the float64
reference on that trace's own weights, and explained by the shared forward catalogue: forward_check.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any, NamedTuple

from rosetta.diff.training.trace import Trace, find_trace, read_trace
from rosetta.errors import CheckpointError, InputError
from rosetta.files import atomic_write_bytes


def is_training_diff(a: str, b: str) -> bool:
    """Whether `rosetta diff A B` compares training traces; one trace against a model is refused."""
    found = [find_trace(side) is not None for side in (a, b)]
    if any(found) and not all(found):
        trace, other = (a, b) if found[0] else (b, a)
        raise InputError(f"{trace} is a training trace and {other} is not: `rosetta diff` compares two "
                         f"traces (or two models)")
    return all(found)


def cmd_diff_traces(args: argparse.Namespace) -> int:
    """Both traces step by step; exit 1 where they differ (docs/training_diff.md)."""
    from rosetta.diff.shared.metrics import ROUNDINGS
    from rosetta.diff.training.compare import (
        TOLERANCES,
        check_comparable,
        compare_traces,
        config_notes,
        first_over,
        format_rows,
        initial_difference,
        localize,
        low_precision_loss_rule,
    )

    for flag in ("src", "tgt", "ids", "batch", "seed"):  # refused, never ignored
        if getattr(args, flag, None) not in (None, False):
            raise InputError(f"--{flag} chooses the batch of a forward diff: a trace holds its own batches")
    a, b = read_trace(args.a), read_trace(args.b)
    steps = check_comparable(a, b, getattr(args, "steps", None))
    if args.diagnose:  # what the diagnosis would refuse, before the comparison
        from rosetta.diff.training.diagnose import check_settings

        check_settings(b)
    coarse = "float32" if "float32" in (a.dtype, b.dtype) else "float64"
    low = [f"{side} computed in {t.compute_dtype}" for side, t in (("A", a), ("B", b))
           if t.compute_dtype in ("bfloat16", "float16")]
    tolerance = TOLERANCES["bfloat16" if low else coarse] if args.tolerance is None else args.tolerance
    print(f"A: {a.path} ({a.writer or 'unnamed writer'}, {a.dtype}, {len(a)} steps, {a.full_steps} whole)")
    print(f"B: {b.path} ({b.writer or 'unnamed writer'}, {b.dtype}, {len(b)} steps, {b.full_steps} whole)")
    notes = config_notes(a, b)
    if low:
        notes.append(f"{' and '.join(low)}: compared at {tolerance:.0e}, 16-bit rounding's tolerance "
                     f"(rosetta.parity.TOLERANCES); the KL and top-k of the models' outputs below say "
                     f"whether the runs still predict alike")
    for note in notes:
        print(f"note: {note}")
    start = initial_difference(a, b, tolerance)
    rows = [] if start else compare_traces(a, b, tolerance, steps)
    first = first_over(rows)
    if start:
        print(f"the runs start from different weights: first tensor {start[0]} (relative error "
              f"{start[1]:.3e}); start both from the same checkpoint (rosetta.init_params, or one file)")
    else:
        print(format_rows(rows, tolerance))
        if first is None:
            print(f"no difference at any of {steps} steps (tolerance {tolerance:.0e})")
    rule = low_precision_loss_rule(a, b) if low and not start else None
    if rule is not None:
        print(f"16-bit rule, step 1 (the same weights, one forward pass in 16 bits): the losses differ by "
              f"{rule.difference:.3e}, {'within' if rule.accepted else 'OVER'} 2·{ROUNDINGS}u·max|z| = "
              f"{rule.budget:.3e}: {'accepted' if rule.accepted else 'REJECTED'} (later steps have no such "
              f"bound: the outputs line below says whether the runs still predict alike)")
    checks = [] if first is None else _forward_checks(a, b, first, args.diagnose)
    if first is not None:
        where = localize(a, b, first, tolerance, tuple(c.side for c in checks))
        print(f"first difference at step {first.step}: " + "; ".join(where))
        for check in checks:
            print(forward_report(check, first.over))
    outputs = None if start else _outputs(a, b, rows, first)
    diagnosis = None
    if args.diagnose:
        diagnosis = _diagnose(a, b, rows, first, tolerance, steps, bool(start))
    if args.json:
        _write_json(args, a, b, rows, tolerance, first, start, diagnosis, outputs, checks, rule)
    if args.plot:
        from rosetta.diff.shared.plots import plot_training_diff

        print(f"wrote {plot_training_diff(args.plot, a, b, rows, first.step if first else None, steps)}")
    return 1 if (first or start) else 0


def _forward_checks(a: Trace, b: Trace, first, diagnose: bool) -> list[ForwardCheck]:
    """Where the loss or the gradients part first: each side's forward dump of that step (when it
    holds one) against the float64 reference on that side's weights before the step."""
    if not {"loss", "grads"} & set(first.over):
        return []
    checks = (forward_check(trace, first.step, side, diagnose) for side, trace in (("A", a), ("B", b)))
    return [check for check in checks if check is not None]


class ForwardCheck(NamedTuple):
    step: int
    side: str            # "A" or "B"
    tolerance: float     # the forward diff's for the dump's dtype (and the trace's compute dtype)
    rows: list           # rosetta.diff.shared.metrics.StageRow, in forward order
    first: Any           # the first StageRow over the tolerance, None when the forward passes agree
    diagnosis: Any       # rosetta.diff.shared.diagnose.Diagnosis, with --diagnose and a difference


def forward_check(trace: Trace, k: int, side: str, diagnose: bool = False) -> ForwardCheck | None:
    """Step k's forward dump (None without one) against the float64 reference (numpy_ref, as
    `rosetta diff MODEL DUMP` runs it) on this trace's weights before update k and the dump's batch,
    stage by stage; with `diagnose`, the forward catalogue (rosetta.diff.shared.diagnose) on a
    difference, its errors relative to the reference as the table's."""
    from rosetta.backends import get_backend
    from rosetta.diff.shared.catalogue import as_float64
    from rosetta.diff.shared.metrics import (
        DUMP_TOLERANCES,
        FLOAT64_TOLERANCE,
        LOW_PRECISION,
        compare_stages,
        dump_tolerance,
        first_over,
    )
    from rosetta.diff.training.compare import TOLERANCES

    dump = trace.forward(k)
    if dump is None:
        return None
    params = as_float64(trace.initial() if k == 1 else trace.full(k - 1).params)
    reference = get_backend("numpy")(trace.cfg, params, "float64").stages(dump.src, dump.tgt, fine=True)
    tolerance = max(dump_tolerance(dump), FLOAT64_TOLERANCE)
    if trace.compute_dtype in LOW_PRECISION:  # a 16-bit forward dumped as float32 arrays: its own tolerance
        tolerance = max(tolerance, DUMP_TOLERANCES.get(trace.compute_dtype, TOLERANCES["bfloat16"]))
    rows = compare_stages(trace.cfg.pad_id, dump.src, dump.tgt, dump.stages, reference, tolerance)
    if not rows:
        raise CheckpointError(f"{trace.path}: step {k}'s forward dump has no stage in common with the model")
    first, diagnosis = first_over(rows), None
    if diagnose and first is not None:
        from rosetta.diff.shared.diagnose import diagnose as run_catalogue

        # The table's B is the reference on these weights: the diagnosis divides by it too.
        diagnosis = run_catalogue(trace.cfg, params, dump.src, dump.tgt, dump.stages, tolerance=tolerance,
                                  reference="model")
    return ForwardCheck(k, side, tolerance, rows, first, diagnosis)


def forward_report(check: ForwardCheck, over: tuple[str, ...]) -> str:
    """The lines `rosetta diff` prints for a ForwardCheck; `over`: what differs at that step."""
    from rosetta.diff.shared.metrics import format_rows

    k, side = check.step, check.side
    lines = [f"inside step {k}: {side}'s forward dump against the float64 reference on {side}'s weights "
             f"before step {k}", format_rows(check.rows, check.tolerance)]
    if check.first is not None:
        lines.append(f"first difference at {check.first.stage} (relative error {check.first.rel:.3e} > "
                     f"{check.tolerance:.0e}): {side}'s forward pass parts from the reference there")
        if check.diagnosis is not None:
            lines.append(f"forward diagnosis: {check.diagnosis.report()}")
    elif not any(r.stage == "logits" for r in check.rows):
        lines.append("the captured stages agree, but the dump holds no 'logits': the output layer, the loss "
                     "and the backward are not covered (map 'logits' to the output layer)")
    else:
        after = ("the losses differ on logits that agree, so the loss's definition (--diagnose replays the "
                 "loss variants)" if "loss" in over else "the losses agree and the gradients do not, so the "
                 "backward (a detached, rescaled or missing term)")
        lines.append(f"the forward passes agree: the difference is after the forward (the loss, the backward "
                     f"or the optimizer): {after}")
    return "\n".join(lines)


def _number(x: float) -> float | None:
    return x if math.isfinite(x) else None


def forward_json(check: ForwardCheck) -> dict[str, Any]:
    """--json's "forward" (docs/training_diff.md); non-finite errors as null."""
    diagnosis = check.diagnosis
    return {"step": check.step, "side": check.side, "tolerance": check.tolerance,
            "first_stage": check.first.stage if check.first else None,
            "rows": [{"stage": r.stage, "rel": _number(r.rel), "max_abs": _number(r.max_abs), "over": r.over}
                     for r in check.rows],
            "diagnosis": None if diagnosis is None else
            {"explained_by": list(diagnosis.best.names) if diagnosis.best else None,
             "ranked": [{"names": list(c.names), "rel_after": _number(c.rel_after)}
                        for c in diagnosis.candidates[:3]]}}


def _outputs(a: Trace, b: Trace, rows: list, first):
    """The two runs' models after one whole step (the first that differs, else the last whole
    one), run by the float64 reference on that step's batch: KL and top-1/top-5 agreement of their
    logits (rosetta.diff.shared.metrics.logit_metrics, B as the reference), printed; (step, metrics)."""
    import numpy as np

    from numpy_ref.model import forward
    from rosetta.diff.shared.metrics import format_logit_metrics, logit_metrics

    whole = [r.step for r in rows if r.whole and r.same_batch]
    if not whole:
        return None
    k = first.step if first is not None and first.step in whole else whole[-1]
    fa, fb = a.full(k), b.full(k)

    def logits(trace: Trace, params: dict) -> np.ndarray:
        return forward({n: v.astype(np.float64) for n, v in params.items()}, trace.cfg, fb.src, fb.tgt_in)

    metrics = logit_metrics(b.cfg.pad_id, fb.src, fb.tgt_in, logits(a, fa.params), logits(b, fb.params))
    if metrics is not None:
        print(f"the models after step {k}, on its batch: {format_logit_metrics(metrics)}")
    return k, metrics


def _diagnose(a: Trace, b: Trace, rows: list, first, tolerance: float, steps: int, start: bool):
    from rosetta.diff.training.diagnose import diagnose_training

    verdict = ("diagnosis: not diagnosed: the runs start from different weights" if start else
               "diagnosis: nothing to explain, the traces agree" if first is None else
               "diagnosis: not diagnosed: the runs saw different batches: no mistake of a loop can be named"
               if first.over == ("batch",) else None)  # the evaluations are checked all the same
    diagnosis = diagnose_training(a, b, tolerance, steps, verdict)
    print(diagnosis.report())
    return diagnosis  # --json's "diagnosis" for every verdict, those that replay nothing too


def _write_json(args: argparse.Namespace, a: Trace, b: Trace, rows: list, tolerance: float, first, start,
                diagnosis, outputs, checks: list, rule) -> None:
    """--json: the rows, the verdict and the diagnosis (schema in docs/training_diff.md)."""
    record = {"kind": "training", "a": str(a.path), "b": str(b.path), "tolerance": tolerance,
              "differ": bool(first or start), "initial_difference": start[0] if start else None,
              "first_difference": first.step if first else None,
              "rows": [{"step": r.step, "same_batch": r.same_batch, "loss": _number(r.loss),
                        "lr": _number(r.lr), "grads": _number(r.grads), "params": _number(r.params),
                        "whole": r.whole, "over": list(r.over)} for r in rows],
              "outputs": None if not outputs or outputs[1] is None else
              {"step": outputs[0], **outputs[1]._asdict()},
              "forward": forward_json(checks[0]) if checks else None,  # A's when both sides hold a dump
              "low_precision_rule": rule._asdict() if rule else None}
    if diagnosis is not None:
        best = diagnosis.explained
        record["diagnosis"] = {"verdict": diagnosis.verdict, "refused": diagnosis.refused,
                               "explained_by": list(best.names) if best else None,
                               "ranked": [{"names": list(c.names), "error": _number(c.error)}
                                          for c in diagnosis.ranked]}
    atomic_write_bytes(args.json, (json.dumps(record, indent=1) + "\n").encode("utf-8"))
