"""The `rosetta` command line.

    rosetta parity --preset tiny            # every installed backend vs the float64 reference
    rosetta parity --checkpoint m.safetensors
    rosetta init --preset tiny --out m.safetensors [--set d_model=64 ...]
    rosetta config --preset base            # the config JSON and its parameter count
    echo "5 6 7 2" | rosetta generate --checkpoint m.safetensors --backend jax --beam 4
"""

from __future__ import annotations

import argparse
import json
import sys

from rosetta.checkpoint import load_checkpoint, save_checkpoint
from rosetta.config import PRESETS, ModelConfig, preset
from rosetta.errors import RosettaError
from rosetta.params import init_params, param_count


def _overrides(pairs: list[str]) -> dict:
    """`field=value` pairs; values parse as JSON (numbers, true/false), else as strings."""
    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise RosettaError(f"--set takes field=value, got {pair!r}")
        key, text = pair.split("=", 1)
        try:
            out[key] = json.loads(text)
        except json.JSONDecodeError:
            out[key] = text
    return out


def _model_source(args: argparse.Namespace) -> tuple[ModelConfig, dict]:
    """(config, canonical params) from --checkpoint, or from --preset with seeded init."""
    if args.checkpoint:
        if args.set:
            raise RosettaError("--set changes a preset; a checkpoint carries its own config")
        ckpt = load_checkpoint(args.checkpoint)
        return ckpt.config, ckpt.params
    cfg = preset(args.preset, **_overrides(args.set))
    return cfg, init_params(cfg, args.seed)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a config field of the preset (repeatable)")
    p.add_argument("--seed", type=int, default=0, help="initializer seed")


def cmd_parity(args: argparse.Namespace) -> int:
    from rosetta.backends import available_backends
    from rosetta.parity import format_report, parity_report

    cfg, params = _model_source(args)
    backends = args.backends or available_backends()
    print(f"backends: {', '.join(backends)}; d_model={cfg.d_model}, layers="
          f"{cfg.num_encoder_layers}+{cfg.num_decoder_layers}, batch {args.batch} x "
          f"src {args.src_len} / tgt {args.tgt_len} with padding, seed {args.seed}")
    rows = parity_report(cfg, params, backends, args.batch, args.src_len, args.tgt_len, args.seed)
    print(format_report(rows))
    return 0 if all(r.finite for r in rows) else 1


def cmd_init(args: argparse.Namespace) -> int:
    cfg = preset(args.preset, **_overrides(args.set))
    path = save_checkpoint(args.out, cfg, init_params(cfg, args.seed), args.dtype)
    print(f"wrote {path} ({param_count(cfg):,} parameters, {args.dtype})")
    return 0


def _read_id_lines(stream) -> list[list[int]]:
    rows = []
    for number, line in enumerate(stream, 1):
        try:
            rows.append([int(tok) for tok in line.split()])
        except ValueError:
            raise RosettaError(
                f"input line {number}: expected space-separated token ids, got {line.strip()!r}") from None
    return rows


def cmd_generate(args: argparse.Namespace) -> int:
    import numpy as np

    from rosetta.backends import load

    model = load(args.checkpoint, args.backend, args.dtype)
    pad = model.config.pad_id
    rows = _read_id_lines(sys.stdin)
    for start in range(0, len(rows), args.batch_size):
        chunk = rows[start: start + args.batch_size]
        if any(not row for row in chunk):
            raise RosettaError(f"input line {start + 1 + [bool(r) for r in chunk].index(False)} is empty")
        src = np.full((len(chunk), max(map(len, chunk))), pad, dtype=np.int64)
        for i, row in enumerate(chunk):
            src[i, : len(row)] = row
        out = model.generate(src, args.beam, args.alpha, args.margin)
        for tokens, score in zip(out.tokens, out.scores, strict=True):
            text = " ".join(map(str, tokens))
            print(f"{text}\t{score:.6f}" if args.scores else text)
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    cfg = preset(args.preset, **_overrides(args.set))
    print(json.dumps(cfg.to_dict(), indent=2))
    print(f"# {param_count(cfg):,} parameters", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rosetta", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    cmds = parser.add_subparsers(dest="command", required=True)

    p = cmds.add_parser("parity", help="compare every installed backend with the float64 reference")
    _add_model_args(p)
    p.add_argument("--checkpoint", help="load this checkpoint instead of a preset")
    p.add_argument("--backends", nargs="+", help="default: every installed backend")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--src-len", type=int, default=11)
    p.add_argument("--tgt-len", type=int, default=9)
    p.set_defaults(func=cmd_parity)

    p = cmds.add_parser("init", help="write a freshly initialised checkpoint")
    _add_model_args(p)
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.set_defaults(func=cmd_init)

    p = cmds.add_parser("generate", help="decode token ids read from stdin (one sentence a line)")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--backend", default="numpy", help="numpy, torch or jax")
    p.add_argument("--dtype", default=None, help="compute dtype (default: the backend's first)")
    p.add_argument("--beam", type=int, default=1, help="beam size; 1 = greedy search")
    p.add_argument("--alpha", type=float, default=0.6, help="length penalty exponent (Wu et al. 2016)")
    p.add_argument("--margin", type=int, default=50, help="max output length = source length + margin")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--scores", action="store_true", help="print each score after a tab")
    p.set_defaults(func=cmd_generate)

    p = cmds.add_parser("config", help="print a preset's config JSON and parameter count")
    _add_model_args(p)
    p.set_defaults(func=cmd_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except RosettaError as e:
        print(f"rosetta: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
