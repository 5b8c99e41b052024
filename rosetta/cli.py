"""The `rosetta` command line.

    rosetta parity --preset tiny            # every installed backend vs the float64 reference
    rosetta parity --checkpoint m.safetensors
    rosetta init --preset tiny --out m.safetensors [--set d_model=64 ...]
    rosetta config --preset base            # the config JSON and its parameter count
    echo "5 6 7 2" | rosetta generate --checkpoint m.safetensors --backend jax --beam 4
    rosetta train --backend torch jax --task copy --steps 300 --out runs/copy
    rosetta train --backend torch --task multi30k --pair de-en --vocab-size 8000 --epochs 10 --out runs/de-en
    echo "Ein Hund läuft." | rosetta translate --run runs/de-en/torch --beam 4   # decodes with torch
    rosetta convert opus-mt-de-en/ de-en.safetensors            # Hugging Face Marian -> ours
    rosetta convert runs/de-en/torch/checkpoints/latest hf-de-en/ --to marian   # and tokenizer.json
    rosetta diff m.safetensors@torch mine.npz --diagnose   # where two implementations part, and why
    rosetta attention m.safetensors@jax --out attention.png --src "5 6 7 2" --tgt "1 8 9"
    rosetta example opus-mt opus-mt-example/    # a small trained opus-mt-style directory, offline

Exit codes (every command):
    0  success; for `parity`: every backend and dtype within its tolerance (rosetta.parity.TOLERANCES)
    1  `parity`: some backend or dtype over its tolerance, or non-finite logits (the report
       marks the row FAIL; stderr names it); `diff`: the two sides differ at some stage
    2  bad input or usage (a flag, a file, stdin, a diverged training run): one line on stderr

Arguments: every count is ASCII digits (no "1_0", no "٥"): sizes and lengths >= 1, seeds, margins
and cadences >= 0; every real number is a plain finite decimal ("0.6", "1e-3"; no nan or inf).
stdin (generate, translate) is read as strict UTF-8, a sentence a line; lines of token ids hold
ASCII-digit ids inside the source vocabulary. A line that breaks a rule is refused by number.
Paths are never empty; a file a command writes (--out, --hyps, --json, --plot) may not be a
directory or lie under a file, refused before any work (docs/cli.md: Paths).
"""

from __future__ import annotations

import argparse
import json
import sys

from rosetta.checkpoint import load_checkpoint, save_checkpoint
from rosetta.cli_args import (
    add_language_args,
    add_search_args,
    decoding_backend,
    non_negative_int,
    nonempty_path,
    output_file,
    parse_overrides,
    positive_int,
    search_settings,
)
from rosetta.config import PRESETS, ModelConfig, preset
from rosetta.device import collect_less
from rosetta.diff import commands as diff_commands
from rosetta.errors import RosettaError
from rosetta.harness import commands as harness_commands
from rosetta.inputs import parse_id_line, split_lines
from rosetta.interop.convert import FORMATS, READ_FORMATS
from rosetta.params import init_params, param_count


class UsageError(RosettaError):
    """A command line argparse refuses (unknown flag, bad value): exit code 2 like every error."""


class _Parser(argparse.ArgumentParser):
    """argparse, but its errors are one line through main()'s handler instead of usage + exit."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def _model_source(args: argparse.Namespace) -> tuple[ModelConfig, dict]:
    """(config, canonical params) from --checkpoint, or from --preset with seeded init."""
    if args.checkpoint:
        if args.set:
            raise RosettaError("--set changes a preset; a checkpoint carries its own config")
        ckpt = load_checkpoint(args.checkpoint)
        return ckpt.config, ckpt.params
    cfg = preset(args.preset, **parse_overrides(args.set))
    return cfg, init_params(cfg, args.seed)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a config field of the preset (repeatable)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="initializer seed")


def cmd_parity(args: argparse.Namespace) -> int:
    from rosetta.backends import available_backends
    from rosetta.parity import failures, format_report, integrity_line, parity_report

    cfg, params = _model_source(args)
    if args.checkpoint:
        print(integrity_line(args.checkpoint))
    for flag, length in (("--src-len", args.src_len), ("--tgt-len", args.tgt_len)):
        if length > cfg.max_len:
            raise RosettaError(f"{flag} {length} is longer than the model's max_len {cfg.max_len}")
    backends = args.backends or available_backends()
    if len(set(backends)) != len(backends):  # the same refusal as `train --backend torch torch`
        raise RosettaError(f"--backends lists a backend twice: {' '.join(backends)}")
    print(f"backends: {', '.join(backends)}; d_model={cfg.d_model}, layers="
          f"{cfg.num_encoder_layers}+{cfg.num_decoder_layers}, batch {args.batch} x "
          f"src {args.src_len} / tgt {args.tgt_len} with padding, seed {args.seed}")
    rows = parity_report(cfg, params, backends, args.batch, args.src_len, args.tgt_len, args.seed)
    print(format_report(rows))
    failed = failures(rows) if rows else ["nothing was compared (no backend offered a dtype here)"]
    for line in failed:
        print(f"rosetta: parity FAIL: {line}", file=sys.stderr)
    return 1 if failed else 0


def cmd_init(args: argparse.Namespace) -> int:
    cfg = preset(args.preset, **parse_overrides(args.set))
    path = save_checkpoint(args.out, cfg, init_params(cfg, args.seed), args.dtype)
    print(f"wrote {path} ({param_count(cfg):,} parameters, {args.dtype})")
    return 0


def _stdin_lines() -> list[str]:
    """stdin's lines, its bytes decoded as strict UTF-8 (rosetta.inputs.split_lines); a text
    stream without bytes underneath (a test's io.StringIO) is already decoded."""
    buffer = getattr(sys.stdin, "buffer", None)
    return split_lines(buffer.read() if buffer is not None else sys.stdin.read())


def cmd_generate(args: argparse.Namespace) -> int:
    import numpy as np

    from rosetta.backends import from_params

    opened = _open(args.checkpoint)
    backend, said = decoding_backend(args, opened.trained_by)
    model = from_params(opened.decoding_config, opened.params, backend, args.dtype)
    search = _generate_kwargs(search_settings(args, opened.search))
    beam = search.pop("beam")
    cfg = model.config
    pad = cfg.pad_id
    rows = []
    for number, line in enumerate(_stdin_lines(), 1):
        row = parse_id_line(line, number, cfg.src_vocab_size)
        if not row:
            raise RosettaError(f"input line {number} is empty")
        if len(row) > cfg.max_len:
            raise RosettaError(f"input line {number} has {len(row)} tokens, more than the model's max_len "
                               f"{cfg.max_len}")
        rows.append(row)
    for start in range(0, len(rows), args.batch_size):
        chunk = rows[start: start + args.batch_size]
        src = np.full((len(chunk), max(map(len, chunk))), pad, dtype=np.int64)
        for i, row in enumerate(chunk):
            src[i, : len(row)] = row
        out = model.generate(src, beam, **search)
        for tokens, score in zip(out.tokens, out.scores, strict=True):
            text = " ".join(map(str, tokens))
            print(f"{text}\t{score:.6f}" if args.scores else text)
    _say(said)
    return 0


def _say(line: str | None) -> None:
    """A note for stderr (decoding_backend's), if there is one."""
    if line is not None:
        print(line, file=sys.stderr)


def cmd_config(args: argparse.Namespace) -> int:
    cfg = preset(args.preset, **parse_overrides(args.set))
    print(json.dumps(cfg.to_dict(), indent=2))
    print(f"# {param_count(cfg):,} parameters", file=sys.stderr)
    return 0


def _open(path, tokenizer=None):
    """rosetta/harness/translate.py's open_model, its notes on the generation config on stderr."""
    from rosetta.harness.translate import open_model

    opened = open_model(path, tokenizer)
    for note in opened.notes:
        print(f"rosetta: note: {note}", file=sys.stderr)
    return opened


def cmd_translate(args: argparse.Namespace) -> int:
    from rosetta.backends import from_params
    from rosetta.harness.translate import apply_languages, translate_lines

    if bool(args.run) == bool(args.checkpoint):
        raise RosettaError("give --run DIR, or --checkpoint FILE|DIR (a Marian directory, or a checkpoint "
                           "file with its tokenizer)")
    if args.run and args.tokenizer:
        raise RosettaError("--tokenizer goes with --checkpoint; a run directory holds its own")
    opened = _open(args.run or args.checkpoint, args.tokenizer)
    backend, said = decoding_backend(args, opened.trained_by, opened.path)
    model = from_params(opened.decoding_config, opened.params, backend, args.dtype)
    search = {**search_settings(args, opened.search), **apply_languages(opened, args.src_lang, args.tgt_lang)}
    lines = _stdin_lines()
    # Said once every check has passed, before the first sentence is decoded (a slow backend is seen).
    for line in translate_lines(model, opened.tokenizer, lines, batch_size=args.batch_size,
                                before_decoding=lambda: _say(said), **_generate_kwargs(search)):
        print(line)
    return 0


def _generate_kwargs(search: dict) -> dict:
    """search_settings' dict as translate_lines' and model.generate's keywords."""
    names = {"margin": "max_len_margin", "beam": "beam"}
    return {names.get(key, key): value for key, value in search.items()}


def cmd_convert(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rosetta.harness.run_dir import LATEST
    from rosetta.interop.convert import convert, is_marian_like

    src, tokenizer, fmt_in = Path(args.src), None, args.from_format
    is_run = src.is_dir() or (src.name == LATEST and src.is_file())
    if is_run and fmt_in in (None, "rosetta") and not is_marian_like(src):
        # A run or checkpoint directory of `rosetta train` (or its checkpoints/latest pointer): its
        # checkpoint, and its tokenizer.
        from rosetta.harness.translate import resolve_run

        src, tokenizer = resolve_run(src)
        fmt_in = "rosetta"
    done = convert(src, args.dst, fmt_in, args.to_format, parse_overrides(args.set), overwrite=args.overwrite,
                   tokenizer=tokenizer)
    for note in done.notes:  # what the written model does not carry: said, as `translate` says it
        print(f"rosetta: note: {note}", file=sys.stderr)
    print(f"wrote {done.path} ({done.to_format}) from {src} ({done.from_format})")
    if done.companions:
        names = ", ".join(sorted(p.name for p in done.companions))
        print(f"wrote {names} in {done.companions[0].parent} (the tokenizer and search settings)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rosetta", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    cmds = parser.add_subparsers(dest="command", required=True)

    p = cmds.add_parser("parity", help="compare every installed backend with the float64 reference",
                        epilog="exit code 0: every backend and dtype within its tolerance; 1: some row over "
                               "its tolerance or not finite (marked FAIL); 2: bad input or usage")
    _add_model_args(p)
    p.add_argument("--checkpoint", type=nonempty_path, help="load this checkpoint instead of a preset")
    p.add_argument("--backends", nargs="+", help="default: every installed backend")
    p.add_argument("--batch", type=positive_int, default=4, help="sentences in the random batch")
    p.add_argument("--src-len", type=positive_int, default=11, help="source length (row 0; others padded)")
    p.add_argument("--tgt-len", type=positive_int, default=9, help="target length (row 0; others padded)")
    p.set_defaults(func=cmd_parity)

    p = cmds.add_parser("init", help="write a freshly initialised checkpoint")
    _add_model_args(p)
    p.add_argument("--out", type=output_file, required=True, metavar="FILE", help="where to write it")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.set_defaults(func=cmd_init)

    p = cmds.add_parser("generate", help="decode token ids read from stdin (one sentence a line)")
    p.add_argument("--checkpoint", type=nonempty_path, required=True,
                   help="a checkpoint file or a Hugging Face Marian (opus-mt) directory")
    add_search_args(p, beam=1)
    p.add_argument("--scores", action="store_true", help="print each score after a tab")
    p.set_defaults(func=cmd_generate)

    p = cmds.add_parser("config", help="print a preset's config JSON and parameter count")
    _add_model_args(p)
    p.set_defaults(func=cmd_config)

    harness_commands.add_train_parser(cmds)

    p = cmds.add_parser("translate", help="translate stdin (a sentence a line) with a trained run")
    p.add_argument("--run", type=nonempty_path,
                   help="a `rosetta train` output directory (its newest checkpoint)")
    p.add_argument("--checkpoint", type=nonempty_path,
                   help="or: a checkpoint file (its tokenizer from the NAME.tokenizer/ folder beside it), "
                        "or a Hugging Face Marian (opus-mt) directory")
    p.add_argument("--tokenizer", type=nonempty_path,
                   help="the tokenizer to use instead: a tokenizer.json, or a folder of Marian's source.spm, "
                        "target.spm, vocab.json (none found: lines are token ids)")
    add_search_args(p, beam=4)
    add_language_args(p)
    p.set_defaults(func=cmd_translate)

    p = cmds.add_parser("convert", help="convert a model: rosetta, marian, flax-wmt, ctranslate2",
                        epilog="formats: rosetta (a checkpoint file, checkpoint or run directory), "
                               "marian (a Hugging Face MarianMTModel directory), flax-wmt (Flax "
                               "examples/wmt params, msgpack), ctranslate2 (output only: a CTranslate2 "
                               "model directory, through CTranslate2's own converter; pip install "
                               "ctranslate2), fsmt (a Hugging Face FSMTForConditionalGeneration "
                               "directory: fairseq's WMT19 models; --to fsmt), m2m100 (a Hugging Face "
                               "M2M100ForConditionalGeneration directory: M2M100 and NLLB-200; --to "
                               "m2m100). Output format from DST's "
                               "name: .safetensors, .msgpack, else a directory (marian). The tokenizer "
                               "travels with the weights: into a marian or fsmt directory, or the folder "
                               "NAME.tokenizer/ beside a file (docs/real-models.md).")
    p.add_argument("src", type=nonempty_path, help="the model to read")
    p.add_argument("dst", type=nonempty_path, help="where to write it")
    p.add_argument("--from", dest="from_format", choices=READ_FORMATS,
                   help="input format (default: detected)")
    p.add_argument("--to", dest="to_format", choices=FORMATS, help="output format (default: from DST)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="a config field the input cannot say (max_len, eos_id, ...; repeatable)")
    p.add_argument("--overwrite", action="store_true",
                   help="marian, fsmt or ctranslate2 output: write into a folder that is not empty (its "
                        "config.json, model.safetensors or model.bin, ... are replaced; other files stay)")
    p.set_defaults(func=cmd_convert)

    diff_commands.add_parsers(cmds)  # diff, attention
    harness_commands.add_parsers(cmds)  # average, evaluate, example
    return parser


def _process() -> str:
    """" [process R of N]" inside a launch of several processes, so that an error names its rank."""
    from rosetta.distributed import launch_env

    try:
        env = launch_env()
    except RosettaError:
        return ""
    return f" [process {env.rank} of {env.num_processes}]" if env.distributed else ""


def main(argv: list[str] | None = None) -> int:
    collect_less()  # before the command imports its framework (rosetta/device.py: GC_THRESHOLDS)
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser().parse_args(argv)
        args.argv = argv
        return args.func(args)
    except RosettaError as e:
        print(f"rosetta: error{_process()}: {e}", file=sys.stderr)
        return 2
    except MemoryError:  # e.g. parity --batch 1000000: a bad size, not a bug
        print("rosetta: error: out of memory; ask for a smaller batch or model", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
