"""The forward diff's commands (docs/diff.md, docs/attention.md): two sides on one batch, stage by
stage (`rosetta diff A B`, handed over by rosetta/diff/commands.py when neither side is a training
trace), and every attention map of one side (`rosetta attention`). Errors are rosetta errors (exit
code 2).
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any, NamedTuple

from rosetta.errors import InputError, RosettaError
from rosetta.files import atomic_write_bytes
from rosetta.inputs import parse_id_line


def cmd_diff_models(args: argparse.Namespace) -> int:
    """Both sides on one batch, stage by stage (docs/diff.md); exit 1 where they differ."""
    from rosetta.diff.forward.sides import check_compatible, pad_id, parse_sides, pick_batch
    from rosetta.diff.shared.metrics import compare_stages, first_over, format_rows

    if args.steps is not None:
        raise InputError("--steps is for two training traces")
    a, b = parse_sides(args.a, args.b)
    check_compatible(a, b)
    if args.batch is not None and (args.src is not None or a.dump is not None or b.dump is not None):
        raise InputError("--batch picks the batch of two models without --src; a dump holds its own")
    if args.src is None:
        if args.tgt is not None or args.ids:
            raise InputError("--tgt and --ids go with --src")
        src, tgt = pick_batch([a, b], args.seed or 0, args.batch or "diagnostic")
    else:
        if a.dump is not None or b.dump is not None:
            raise InputError("a dump holds its own batch: --src and --tgt are for two models")
        src, tgt, tokenizer = _sentence_pair([a, b], args.src, args.tgt, args.ids)
        said = f" = the start token + {tokenizer.decode(tgt[0, 1:])!r}" if tokenizer else ""
        print(f"src ids {src[0].tolist()}; decoder input ids {tgt[0].tolist()}{said}")
    stages_a, stages_b = a.stages(src, tgt), b.stages(src, tgt)
    tolerance = max(a.tolerance, b.tolerance) if args.tolerance is None else args.tolerance
    rows = compare_stages(pad_id([a, b]), src, tgt, stages_a, stages_b, tolerance)
    if not rows:
        raise RosettaError(f"{args.a} and {args.b} have no stage in common to compare")
    first = first_over(rows)
    print(format_rows(rows, tolerance))
    logits = _logit_lines(a, b, src, tgt, stages_a, stages_b)
    print(f"first difference at {first.stage} (relative error {first.rel:.3e} > {tolerance:.0e})"
          if first else f"no difference at any stage (tolerance {tolerance:.0e})")
    if logits.verdict is not None:
        print(logits.verdict_line)
    if args.json:
        _write_diff_json(args, rows, tolerance, first, logits)
    if args.diagnose:
        _diagnose(a, b, src, tgt, stages_a, stages_b, tolerance, first)
    if args.plot:
        from rosetta.diff.shared.plots import plot_diff

        written = plot_diff(args.plot, rows, stages_a, stages_b, first.stage if first else None,
                            tolerance=tolerance, labels=(args.a, args.b), src=src, tgt=tgt,
                            pad_id=pad_id([a, b]))
        print(f"wrote {written}")
    return 1 if first else 0


class _Logits(NamedTuple):
    metrics: Any = None        # rosetta.diff.shared.metrics.LogitMetrics, None without finite logits
    verdict: Any = None        # LowPrecisionVerdict when a side computes in 16 bits, else None
    dtype: str | None = None   # that side's 16-bit type
    verdict_line: str = ""


def _logit_lines(a, b, src, tgt, stages_a, stages_b) -> _Logits:
    """Print the logits' KL and top-k line under the table; the low-precision rule's verdict
    (printed by the caller, after the first-difference line) when either side is 16-bit. The exit
    code stays the relative error's: the verdict is a second opinion on the output distribution."""
    from rosetta.diff.forward.sides import pad_id
    from rosetta.diff.shared.metrics import format_logit_metrics, format_verdict, logit_metrics
    from rosetta.diff.shared.metrics import low_precision_verdict as verdict_of

    if "logits" not in stages_a or "logits" not in stages_b:
        return _Logits()
    pad, za, zb = pad_id([a, b]), stages_a["logits"], stages_b["logits"]
    metrics = logit_metrics(pad, src, tgt, za, zb)
    print(format_logit_metrics(metrics) if metrics else "logits: not finite on a side: no KL or top-k")
    dtype = a.low_precision or b.low_precision
    verdict = None if dtype is None or metrics is None else verdict_of(pad, src, tgt, za, zb)
    return _Logits(metrics, verdict, dtype, format_verdict(verdict, dtype) if verdict else "")


def _write_diff_json(args: argparse.Namespace, rows: list, tolerance: float, first, logits: _Logits) -> None:
    """--json: the rows and the verdict (schema in docs/diff.md); non-finite errors as null."""
    def number(x: float) -> float | None:
        return x if math.isfinite(x) else None

    record = {"a": args.a, "b": args.b, "tolerance": tolerance, "differ": first is not None,
              "first_difference": first.stage if first else None,
              "rows": [{"stage": r.stage, "rel": number(r.rel), "max_abs": number(r.max_abs), "over": r.over}
                       for r in rows],
              "logits": logits.metrics._asdict() if logits.metrics else None,
              "low_precision": None if logits.verdict is None else
              {"dtype": logits.dtype, **logits.verdict._asdict(), "worst": number(logits.verdict.worst)}}
    # atomic_write: parent directories made, a directory in the way refused in one line.
    atomic_write_bytes(args.json, (json.dumps(record, indent=1) + "\n").encode("utf-8"))


def _diagnose(a, b, src, tgt, stages_a, stages_b, tolerance: float, first) -> None:
    """--diagnose: the catalogue's mistakes replayed on the weights of one side (the one with
    weights; B when both) to explain the other side's stages. Its errors are the table's, relative
    to B: B's weights' model, or B's stages observed when only A has weights."""
    if first is None:
        print("diagnosis: nothing to explain, the sides agree")
        return
    from rosetta.diff.shared.diagnose import diagnose

    reference, observed = (b, stages_a) if b.weights is not None else (a, stages_b)
    if reference.weights is None:
        raise RosettaError("--diagnose needs the weights of one side: two dumps hold only activations")
    cfg, params = reference.weights
    denominator = "model" if reference is b else "observed"
    print(diagnose(cfg, params, src, tgt, observed, tolerance=tolerance, reference=denominator).report())


def cmd_attention(args: argparse.Namespace) -> int:
    """Every attention map of one side on one sentence pair, as one PNG."""
    from rosetta.diff.forward.sides import parse_side
    from rosetta.diff.shared.plots import plot_attention
    from rosetta.parity import random_batch

    side = parse_side(args.side)
    if (args.src is None) != (args.tgt is None):
        raise InputError("give both --src and --tgt, or neither (a random sentence pair)")
    if args.ids and args.src is None:
        raise InputError("--ids goes with --src and --tgt")
    if side.dump is not None:
        if args.src is not None:
            raise InputError("a dump holds its own sentence pair: --src and --tgt are for models")
        src, tgt = side.dump.src[:1], side.dump.tgt[:1]
        stages = {name: value[:1] for name, value in side.dump.stages.items()}
    else:
        cfg = side.config
        if args.src is None:
            src, tgt = random_batch(cfg, batch=1, seed=args.seed)
        else:
            src, tgt, _ = _sentence_pair([side], args.src, args.tgt, args.ids)
        stages = side.stages(src, tgt)
    pad = side.config.pad_id if side.config is not None else 0  # a dump holds no config: pad 0
    print(f"wrote {plot_attention(args.out, stages, src, tgt, pad_id=pad)}")
    return 0


def _sentence_pair(sides: list, src_text: str, tgt_text: str | None, as_ids: bool):
    """(src [1, S], tgt [1, T], the tokenizer or None) of --src and --tgt (docs/diff.md): text when
    a model side's directory holds a tokenizer and --ids is not given, else token ids. Text --tgt
    is the reference translation shifted right behind the start token, `[bos] +
    encode_target(text)[:-1]` (what training feeds; eos is not an input); without --tgt, the start
    token then the greedy translation of the first side that is one of our models."""
    import numpy as np

    from rosetta.diff.forward.sides import side_tokenizer, translated_input

    cfg = next(s.config for s in sides if s.config is not None)
    tokenizer = None if as_ids else side_tokenizer(sides)
    if tokenizer is None:
        hint = "" if as_ids else "; text needs a tokenizer (source.spm + vocab.json, M2M100's " \
                                 "sentencepiece.bpe.model + vocab.json, or tokenizer.json) in a model " \
                                 "side's directory, and none holds one"
        src = np.array([_flag_ids("--src", src_text, cfg.src_vocab_size, "source", hint)])
        tgt = None if tgt_text is None else \
            np.array([_flag_ids("--tgt", tgt_text, cfg.tgt_vocab_size, "target", hint)])
    else:
        src = np.array([tokenizer.encode_source(src_text)])
        tgt = None if tgt_text is None else np.array([[cfg.bos_id, *tokenizer.encode_target(tgt_text)[:-1]]])
    return src, translated_input(sides, src) if tgt is None else tgt, tokenizer


def _flag_ids(flag: str, text: str, vocab_size: int, side: str, hint: str = "") -> list[int]:
    """The token ids of a --src/--tgt value, by stdin's rule (rosetta.inputs.parse_id_line);
    `hint` follows the message when a token is not an id."""
    try:
        ids = parse_id_line(text, 1, vocab_size)
    except InputError as e:
        message = str(e).removeprefix("input line 1: ").replace("source", side)
        raise InputError(f"{flag}: {message}{hint if 'is not a token id' in message else ''}") from None
    if not ids:
        raise InputError(f"{flag}: no token ids given")
    return ids
