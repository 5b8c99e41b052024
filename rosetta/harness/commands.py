"""`rosetta average` and `rosetta evaluate` (docs/evaluate.md): checkpoint averaging (paper §6.1)
and sacreBLEU + chrF on a Multi30k split. rosetta/cli.py calls `add_parsers(cmds)` to register
them; errors are rosetta errors (exit code 2).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rosetta.errors import RosettaError


def cmd_average(args: argparse.Namespace) -> int:
    """Average checkpoints (float64, cast back) into one file; print what was averaged."""
    from rosetta.average import resolve_checkpoints, write_average

    resolved = resolve_checkpoints(args.checkpoints, args.last)
    for note in resolved.notes:
        print(f"rosetta: note: {note}", file=sys.stderr)
    written = write_average(resolved.paths, args.out)
    print(f"averaged {len(resolved.paths)} checkpoint(s):")
    for path in resolved.paths:
        print(f"  {path}")
    print(f"wrote {written}")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Decode a Multi30k split, score it (sacreBLEU BLEU and chrF), write the JSON report."""
    from rosetta.backends import load
    from rosetta.harness import evaluate as ev
    from rosetta.harness.data import SPLITS, resolve_data_dir
    from rosetta.harness.tasks import parse_pair
    from rosetta.harness.tokenizer import Tokenizer

    if args.split not in SPLITS:  # before the model loads: a typo should not wait for it
        raise RosettaError(f"unknown Multi30k split {args.split!r}; choose one of {', '.join(SPLITS)}")
    if args.pair is not None:
        parse_pair(args.pair)
    if args.hyps is not None and Path(args.hyps).resolve() == Path(args.out).resolve():
        raise RosettaError(f"--hyps and --out both name {args.out}: the report would replace the hypotheses")
    checkpoint, tokenizer_path, run_record = ev.resolve_model(args.model, args.tokenizer)
    pair = ev.run_pair(run_record, args.pair)
    tokenizer = Tokenizer.load(tokenizer_path)
    model = load(checkpoint, args.backend, args.dtype)
    start = time.perf_counter()
    result = ev.evaluate_split(model, tokenizer, args.split, pair, args.data_dir, args.limit, beam=args.beam,
                            alpha=args.alpha, max_len_margin=args.margin, batch_size=args.batch_size,
                            length_rule=args.length_rule)
    hyps = str(ev.write_hypotheses(args.hyps, result["hypotheses"])) if args.hyps is not None else None
    report = {
        "format": ev.FORMAT, "checkpoint": str(checkpoint), "tokenizer": str(tokenizer_path),
        "split": args.split, "pair": pair, "data_dir": str(resolve_data_dir(args.data_dir)),
        "limit": args.limit,
        "backend": args.backend, "dtype": model.dtype, "beam": args.beam, "alpha": args.alpha,
        "margin": args.margin, "length_rule": args.length_rule, "batch_size": args.batch_size,
        "sentences": result["sentences"], "bleu": result["bleu"], "chrf": result["chrf"],
        "hypotheses": hyps, "time_s": time.perf_counter() - start,
    }
    written = ev.write_report(args.out, report)
    subset = f" (first {result['sentences']})" if args.limit is not None else ""
    print(f"{args.split} {pair}{subset}, {result['sentences']} sentences, beam {args.beam}, "
          f"alpha {args.alpha}, {args.backend}")
    print(f"{result['bleu']['text']}\n  {result['bleu']['signature']}")
    print(f"{result['chrf']['text']}\n  {result['chrf']['signature']}")
    if hyps:
        print(f"wrote {hyps}")
    print(f"wrote {written}")
    return 0


def add_parsers(cmds: argparse._SubParsersAction) -> None:
    """Register `average` and `evaluate` on rosetta/cli.py's subcommands."""
    from rosetta.average import DEFAULT_LAST
    from rosetta.cli_args import add_search_args, nonempty_path, output_file, positive_int

    p = cmds.add_parser("average", help="average checkpoints into one (paper §6.1: the last 5)",
                        epilog="CKPT: a model.safetensors file, a checkpoint directory, a checkpoints/latest "
                               "pointer, or a run directory (its newest --last checkpoints). All must have "
                               "one config and dtype; the mean is taken in float64 (docs/evaluate.md)")
    p.add_argument("checkpoints", type=nonempty_path, nargs="+", metavar="CKPT",
                   help="the checkpoints to average")
    p.add_argument("--out", type=output_file, required=True, metavar="FILE",
                   help="where to write the averaged checkpoint")
    p.add_argument("--last", type=positive_int,
                   help=f"checkpoints taken from each run directory, newest first (default {DEFAULT_LAST})")
    p.set_defaults(func=cmd_average)

    p = cmds.add_parser("evaluate", help="BLEU and chrF (sacreBLEU) of a model on a Multi30k split",
                        epilog="MODEL: a run or checkpoint directory (its newest checkpoint and "
                               "tokenizer.json), or a model.safetensors file with --tokenizer "
                               "(docs/evaluate.md)")
    p.add_argument("model", type=nonempty_path, metavar="MODEL",
                   help="run directory, checkpoint directory or checkpoint file")
    p.add_argument("--tokenizer", type=nonempty_path, help="the tokenizer.json of a checkpoint file")
    p.add_argument("--split", default="test_2016_flickr",
                   help="train, val, test_2016_flickr or test_2017_flickr (default test_2016_flickr)")
    p.add_argument("--pair", help="source-target languages (default: the run's, else de-en)")
    p.add_argument("--data-dir", type=nonempty_path,
                   help="Multi30k directory (default $ROSETTA_DATA_DIR or ../shared/data/multi30k)")
    p.add_argument("--limit", type=positive_int, help="the first N sentences only (default all)")
    add_search_args(p, beam=4)  # the search flags of `generate` and `translate` (paper §6.1: beam 4)
    p.add_argument("--hyps", type=output_file, metavar="FILE", help="also write the hypotheses, one a line")
    p.add_argument("--out", type=output_file, required=True, metavar="FILE.json",
                   help="where to write the JSON report")
    p.set_defaults(func=cmd_evaluate)
