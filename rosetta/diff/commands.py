"""`rosetta diff` and `rosetta attention` (docs/diff.md, docs/attention.md): the command-line side
of rosetta.diff; `add_parsers` registers their flags on rosetta/cli.py's subcommands. Errors are
rosetta errors (exit code 2).
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any, NamedTuple

from rosetta.errors import InputError, RosettaError
from rosetta.files import atomic_write_bytes
from rosetta.inputs import parse_id_line


def cmd_diff(args: argparse.Namespace) -> int:
    """Both sides on one batch, stage by stage (docs/diff.md); exit 1 where they differ. Two
    training traces (or run directories holding one) go to the training diff (docs/training_diff.md)."""
    from rosetta.diff.compare import compare_stages, first_over, format_rows
    from rosetta.diff.sides import check_compatible, pad_id, parse_sides, pick_batch
    from rosetta.diff.train_commands import cmd_diff_traces, is_training_diff

    if is_training_diff(args.a, args.b):
        return cmd_diff_traces(args)
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
        from rosetta.diff.plots import plot_diff

        written = plot_diff(args.plot, rows, stages_a, stages_b, first.stage if first else None,
                            tolerance=tolerance, labels=(args.a, args.b), src=src, tgt=tgt,
                            pad_id=pad_id([a, b]))
        print(f"wrote {written}")
    return 1 if first else 0


class _Logits(NamedTuple):
    metrics: Any = None        # rosetta.diff.compare.LogitMetrics, None without finite logits
    verdict: Any = None        # LowPrecisionVerdict when a side computes in 16 bits, else None
    dtype: str | None = None   # that side's 16-bit type
    verdict_line: str = ""


def _logit_lines(a, b, src, tgt, stages_a, stages_b) -> _Logits:
    """Print the logits' KL and top-k line under the table; the low-precision rule's verdict
    (printed by the caller, after the first-difference line) when either side is 16-bit. The exit
    code stays the relative error's: the verdict is a second opinion on the output distribution."""
    from rosetta.diff.compare import format_logit_metrics, format_verdict, logit_metrics
    from rosetta.diff.compare import low_precision_verdict as verdict_of
    from rosetta.diff.sides import pad_id

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
    weights; B when both) to explain the other side's stages."""
    if first is None:
        print("diagnosis: nothing to explain, the sides agree")
        return
    from rosetta.diff.diagnose import diagnose

    reference, observed = (b, stages_a) if b.weights is not None else (a, stages_b)
    if reference.weights is None:
        raise RosettaError("--diagnose needs the weights of one side: two dumps hold only activations")
    cfg, params = reference.weights
    print(diagnose(cfg, params, src, tgt, observed, tolerance=tolerance).report())


def cmd_attention(args: argparse.Namespace) -> int:
    """Every attention map of one side on one sentence pair, as one PNG."""
    from rosetta.diff.plots import plot_attention
    from rosetta.diff.sides import parse_side
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

    from rosetta.diff.sides import side_tokenizer, translated_input

    cfg = next(s.config for s in sides if s.config is not None)
    tokenizer = None if as_ids else side_tokenizer(sides)
    if tokenizer is None:
        hint = "" if as_ids else "; text needs a tokenizer (source.spm + vocab.json, or tokenizer.json) " \
                                 "in a model side's directory, and none holds one"
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


def add_parsers(cmds: argparse._SubParsersAction) -> None:
    """Register `diff` and `attention` on rosetta/cli.py's subcommands."""
    from rosetta.cli_args import non_negative_int, non_negative_real, output_file, positive_int

    sides = ("SIDE: a model file or directory (rosetta checkpoint, marian, flax-wmt) as "
             "PATH[@BACKEND[:DTYPE]] (default numpy at its first dtype), a Marian directory run by "
             "Hugging Face's own MarianMTModel as DIR@transformers, or an activation dump PATH.npz "
             "(docs/diff.md)")
    text = ("text when a model side's directory holds a tokenizer (an opus-mt directory, a run "
            "directory's tokenizer.json), else token ids")
    p = cmds.add_parser("diff", help="find the first stage where two implementations part, and why",
                        epilog=sides + ". Exit code 0: every shared stage within the tolerance; 1: they "
                               "differ (the first stage over is marked); 2: bad input or usage. A 16-bit "
                               "side also gets the low-precision rule's verdict (KL and top-1 of the "
                               "logits), which leaves the exit code alone")
    p.add_argument("a", help="the side under test")
    p.add_argument("b", help="the side it is compared with (the reference: ||a - b|| / ||b||)")
    p.add_argument("--tolerance", type=non_negative_real,
                   help="largest relative error that still agrees (default: the larger of the sides' "
                        "rosetta.parity.TOLERANCES entries; 1e-10 for float64 vs float64)")
    p.add_argument("--json", type=output_file, metavar="FILE",
                   help="also write the rows and the verdict as JSON")
    p.add_argument("--diagnose", action="store_true",
                   help="name the porting mistake that explains the difference (the catalogue)")
    p.add_argument("--plot", type=output_file, metavar="FILE",
                   help="PNG: the error per stage and the attention where they part")
    p.add_argument("--src", help=f"compare on this one source sentence, {text}: e.g. "
                                 f"\"Ein Hund läuft.\" or \"5 6 7 2\" (default: --batch)")
    p.add_argument("--tgt", help="its decoder input: a reference translation as text (fed as training "
                                 "does: the start token, then its tokens), or ids starting with the start "
                                 "token (default: the start token and the greedy translation of the first "
                                 "side run in one of our backends)")
    p.add_argument("--ids", action="store_true", help="read --src and --tgt as token ids even where a "
                                                       "tokenizer is found")
    p.add_argument("--batch", choices=("diagnostic", "random"),
                   help="the batch two models run on without --src: diagnostic (the default: padded "
                        "rows, an all-padding source, lengths that differ; every --diagnose entry can "
                        "show) or random (rosetta.parity.random_batch)")
    p.add_argument("--seed", type=non_negative_int,
                   help="the token ids of --batch (when no side is a dump and --src is not given; default 0)")
    p.add_argument("--steps", type=positive_int, metavar="N",
                   help="two training traces: compare their first N steps (default: all; they must have "
                        "as many)")
    p.set_defaults(func=cmd_diff)

    p = cmds.add_parser("attention", help="plot every attention map of one side on one sentence pair",
                        epilog=sides)
    p.add_argument("side", help="the model (or dump) to plot")
    p.add_argument("--out", type=output_file, required=True, metavar="FILE.png",
                   help="where to write the PNG")
    p.add_argument("--src", help=f'the source sentence, {text}: e.g. "5 6 7 2" (default: a random '
                                 f'sentence pair)')
    p.add_argument("--tgt", help='its decoder input: a reference translation as text (the start token, '
                                 'then its tokens), or ids starting with the start token, e.g. "1 8 9"')
    p.add_argument("--ids", action="store_true", help="read --src and --tgt as token ids even where a "
                                                       "tokenizer is found")
    p.add_argument("--seed", type=non_negative_int, default=0, help="the random sentence pair")
    p.set_defaults(func=cmd_attention)
