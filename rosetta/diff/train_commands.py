"""`rosetta diff TRACE_A TRACE_B`: the command-line side of the training diff (docs/training_diff.md).
rosetta/diff/commands.py hands an invocation over when either side is a trace (or a run directory
holding one); errors are rosetta errors (exit code 2).
"""

from __future__ import annotations

import argparse
import json
import math

from rosetta.diff.trace import Trace, find_trace, read_trace
from rosetta.errors import InputError
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
    from rosetta.diff.train_compare import (
        TOLERANCES,
        check_comparable,
        compare_traces,
        config_notes,
        first_over,
        format_rows,
        initial_difference,
        localize,
    )

    for flag in ("src", "tgt", "ids", "batch", "seed"):  # refused, never ignored
        if getattr(args, flag, None) not in (None, False):
            raise InputError(f"--{flag} chooses the batch of a forward diff: a trace holds its own batches")
    a, b = read_trace(args.a), read_trace(args.b)
    steps = check_comparable(a, b, getattr(args, "steps", None))
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
        else:
            print(f"first difference at step {first.step}: " + "; ".join(localize(a, b, first, tolerance)))
    outputs = None if start else _outputs(a, b, rows, first)
    diagnosis = None
    if args.diagnose:
        diagnosis = _diagnose(a, b, rows, first, tolerance, steps, bool(start))
    if args.json:
        _write_json(args, a, b, rows, tolerance, first, start, diagnosis, outputs)
    if args.plot:
        from rosetta.diff.plots import plot_training_diff

        print(f"wrote {plot_training_diff(args.plot, a, b, rows, first.step if first else None, steps)}")
    return 1 if (first or start) else 0


def _outputs(a: Trace, b: Trace, rows: list, first):
    """The two runs' models after one whole step (the first that differs, else the last whole
    one), run by the float64 reference on that step's batch: KL and top-1/top-5 agreement of their
    logits (rosetta.diff.compare.logit_metrics, B as the reference), printed; (step, metrics)."""
    import numpy as np

    from numpy_ref.model import forward
    from rosetta.diff.compare import format_logit_metrics, logit_metrics

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
    from rosetta.diff.train_diagnose import diagnose_training

    if start:
        print("diagnosis: not diagnosed: the runs start from different weights")
        return None
    if first is None:
        print("diagnosis: nothing to explain, the traces agree")
        return None
    if first.over == ("batch",):
        print("diagnosis: not diagnosed: the runs saw different batches: no mistake of a loop can be named")
        return None
    diagnosis = diagnose_training(a, b, tolerance, steps)
    print(diagnosis.report())
    return diagnosis


def _write_json(args: argparse.Namespace, a: Trace, b: Trace, rows: list, tolerance: float, first, start,
                diagnosis, outputs) -> None:
    """--json: the rows, the verdict and the diagnosis (schema in docs/training_diff.md)."""
    def number(x: float) -> float | None:
        return x if math.isfinite(x) else None

    record = {"kind": "training", "a": str(a.path), "b": str(b.path), "tolerance": tolerance,
              "differ": bool(first or start), "initial_difference": start[0] if start else None,
              "first_difference": first.step if first else None,
              "rows": [{"step": r.step, "same_batch": r.same_batch, "loss": number(r.loss),
                        "lr": number(r.lr), "grads": number(r.grads), "params": number(r.params),
                        "whole": r.whole, "over": list(r.over)} for r in rows],
              "outputs": None if not outputs or outputs[1] is None else
              {"step": outputs[0], **outputs[1]._asdict()}}
    if diagnosis is not None:
        best = diagnosis.explained
        record["diagnosis"] = {"refused": diagnosis.refused,
                               "explained_by": list(best.names) if best else None,
                               "ranked": [{"names": list(c.names), "error": number(c.error)}
                                          for c in diagnosis.ranked]}
    atomic_write_bytes(args.json, (json.dumps(record, indent=1) + "\n").encode("utf-8"))
