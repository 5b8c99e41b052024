"""`rosetta diff` and `rosetta attention` (docs/diff.md, docs/training_diff.md, docs/attention.md):
the one command over both diff tools. `add_parsers` registers the flags on rosetta/cli.py's
subcommands; `cmd_diff` hands an invocation to the training diff when the sides are training traces
(or run directories holding one), else to the forward diff. Each refuses the other's flags in one
line, never ignores them. Errors are rosetta errors (exit code 2).
"""

from __future__ import annotations

import argparse


def cmd_diff(args: argparse.Namespace) -> int:
    """Two traces step by step (rosetta/diff/training), or two models or dumps stage by stage
    (rosetta/diff/forward); exit 1 where they differ."""
    from rosetta.diff.training.commands import cmd_diff_traces, is_training_diff

    if is_training_diff(args.a, args.b):
        return cmd_diff_traces(args)
    from rosetta.diff.forward.commands import cmd_diff_models

    return cmd_diff_models(args)


def cmd_attention(args: argparse.Namespace) -> int:
    from rosetta.diff.forward.commands import cmd_attention as attention

    return attention(args)


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
