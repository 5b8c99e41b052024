"""The harness's commands: `rosetta train` (its flags generated from RunConfig's fields),
`rosetta average` and `rosetta evaluate` (docs/evaluate.md: checkpoint averaging, paper §6.1,
and sacreBLEU + chrF on a Multi30k split), `rosetta example opus-mt DIR` (docs/real-models.md: a
small trained opus-mt-style directory, offline). rosetta/cli.py calls `add_train_parser(cmds)` and
`add_parsers(cmds)` to register them; errors are rosetta errors (exit code 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
import typing
from pathlib import Path
from typing import Any

from rosetta.cli_args import integer, integer_list, nonempty_path, parse_overrides, real
from rosetta.errors import RosettaError
from rosetta.harness.example import DEFAULT_STEPS
from rosetta.harness.run_config import FLAG_GROUPS, RunConfig

# -- rosetta train ----------------------------------------------------------------------------

def add_run_flags(parser: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
    """One flag per RunConfig field (rosetta/harness/run_config.py: its name, help and default),
    read by the field's annotation. No flag has an argparse default: a flag not given is absent
    from the namespace, so that `run_from_args` knows what the command line said (and a recipe
    fills the rest). Returns the groups, by FLAG_GROUPS key."""
    groups: dict[str, argparse._ArgumentGroup] = {"": parser}  # type: ignore[dict-item]
    for key, title in FLAG_GROUPS[1:]:
        groups[key] = parser.add_argument_group(title)
    groups["length"] = groups["length"].add_mutually_exclusive_group()  # type: ignore[assignment]
    hints = typing.get_type_hints(RunConfig)
    for f in dataclasses.fields(RunConfig):
        meta, kind = f.metadata, hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else None
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        said = [] if default in (None, False) else [f"default {shown}"]
        help_text = meta["help"] + (f" ({'; '.join(said + recipe_values(f.name))})" if said or
                                    recipe_values(f.name) else "")
        flag = _flag(f)
        kwargs: dict = dict(dest=f.name, default=argparse.SUPPRESS, help=help_text)
        if kind not in (bool, bool | None):
            kwargs["metavar"] = meta["metavar"] or flag[2:].upper().replace("-", "_")
        if kind is bool:
            kwargs["action"] = "store_true"
        elif kind == bool | None:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif kind == tuple[str, ...]:
            kwargs["nargs"] = "+"
        elif kind == dict[str, typing.Any]:
            kwargs["action"] = "append"  # FIELD=VALUE pairs (rosetta.cli_args.parse_overrides)
        else:
            base = typing.get_args(kind)[0] if typing.get_origin(kind) is not None else kind
            kwargs["type"] = {int: integer, float: real, tuple: integer_list}.get(
                typing.get_origin(base) or base, nonempty_path if meta["path"] else str)
        groups[meta["group"]].add_argument(flag, **kwargs)
    return groups


def _flag(f: dataclasses.Field) -> str:
    return "--" + (f.metadata["flag"] or f.name).replace("_", "-")


def _shown(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def recipe_flags(name: str) -> str:
    """What recipe `name` sets, as the flags that would set it (rosetta/harness/recipes.py is the one
    place the values live): `--task multi30k --pair de-en ... --set dropout=0.1 ...`."""
    from rosetta.harness.recipes import RECIPES

    flags = []
    for f in dataclasses.fields(RunConfig):
        if f.name not in RECIPES[name]:
            continue
        value = RECIPES[name][f.name]
        if isinstance(value, dict):
            flags += [f"--set {key}={item}" for key, item in value.items()]
        elif value is True:
            flags.append(_flag(f))
        else:
            flags.append(f"{_flag(f)} {_shown(value)}")
    return " ".join(flags)


def recipe_values(field: str) -> list[str]:
    """What each recipe sets `field` to, for the flag's help: ["--recipe multi30k: 2048"]; --steps
    names the --epochs a recipe sets instead."""
    from rosetta.harness.recipes import RECIPES

    said = []
    for name, settings in RECIPES.items():
        if field in settings:
            value = settings[field]
            shown = (", ".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict)
                     else _shown(value))
            said.append(f"--recipe {name}: {shown}")
        elif field == "steps" and settings.get("epochs") is not None:
            said.append(f"--recipe {name}: --epochs {settings['epochs']} instead")
    return said


def run_from_args(args: argparse.Namespace) -> RunConfig:
    """The RunConfig of the flags given: RunConfig's defaults, replaced by the --recipe's settings
    if one is named (rosetta/harness/recipes.py), replaced by each flag on the command line."""
    from rosetta.harness.recipes import recipe

    names = {f.name for f in dataclasses.fields(RunConfig)}
    given = {name: getattr(args, name) for name in names if hasattr(args, name)}
    if "backends" in given:
        given["backends"] = tuple(given["backends"])
    run = RunConfig()
    if args.recipe:
        settings = recipe(args.recipe)
        if "steps" in given:
            settings.pop("epochs", None)  # --steps on the command line sets the length instead
        run = dataclasses.replace(run, **settings)
    # --set on the command line after the recipe's overrides: the command line wins.
    given["overrides"] = {**run.overrides, **parse_overrides(given.get("overrides", []))}
    return dataclasses.replace(run, **given)


class _StderrHandler(logging.Handler):
    """Progress messages to whatever sys.stderr is at the time (pytest swaps it per test)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), file=sys.stderr)


def cmd_train(args: argparse.Namespace) -> int:
    from rosetta.distributed import TIMEOUT_VARIABLE, launch_env
    from rosetta.harness.loop import train
    from rosetta.harness.run_config import check_run

    run = run_from_args(args)
    check_run(run)
    os.environ[TIMEOUT_VARIABLE] = repr(run.dist_timeout)  # the trainers' collectives read it
    env = launch_env()
    if run.nproc > 1 and not env.distributed:  # relaunch this very command as N processes
        from rosetta.harness.launch import launch

        launch(args.argv, run.nproc)
        summary = Path(run.out) / "summary.md"
        if summary.is_file():
            print(summary.read_text(encoding="utf-8"), end="")
        return 0
    logger = logging.getLogger("rosetta.harness")  # ours only: not every library's INFO lines
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("rosetta: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    if args.download and run.task == "multi30k":
        from rosetta.harness.data import default_data_dir, download_multi30k

        download_multi30k(run.data_dir or default_data_dir(), splits=("train", run.eval_split),
                          langs=run.pair.split("-"))
    train(run)
    summary = Path(run.out) / "summary.md"
    if env.is_main and summary.is_file():
        print(summary.read_text(encoding="utf-8"), end="")
    return 0


def add_train_parser(cmds: argparse._SubParsersAction) -> None:
    """Register `train` on rosetta/cli.py's subcommands."""
    p = cmds.add_parser("train", help="train torch and/or jax on the same data (synthetic copy by default)")
    from rosetta.harness.recipes import RECIPES

    sets = "; ".join(f"{name} sets {recipe_flags(name)}" for name in RECIPES)
    p.add_argument("--recipe",
                   help=f"start from a named recipe's settings; a flag given overrides its value ({sets})")
    groups = add_run_flags(p)
    groups["data"].add_argument("--download", action="store_true",
                                help="fetch missing Multi30k files (network)")
    p.set_defaults(func=cmd_train)


# -- rosetta average, rosetta evaluate --------------------------------------------------------


def cmd_average(args: argparse.Namespace) -> int:
    """Average checkpoints (float64, cast back) into one file; print what was averaged."""
    from rosetta.harness.average import resolve_checkpoints, write_average

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
    from rosetta.backends import from_params
    from rosetta.harness import evaluate as ev
    from rosetta.harness.data import SPLITS, resolve_data_dir
    from rosetta.harness.tasks import parse_pair

    if args.split not in SPLITS:  # before the model loads: a typo should not wait for it
        raise RosettaError(f"unknown Multi30k split {args.split!r}; choose one of {', '.join(SPLITS)}")
    if args.pair is not None:
        parse_pair(args.pair)
    if args.hyps is not None and Path(args.hyps).resolve() == Path(args.out).resolve():
        raise RosettaError(f"--hyps and --out both name {args.out}: the report would replace the hypotheses")
    from rosetta.cli_args import decoding_backend, search_settings
    from rosetta.harness.translate import apply_languages, open_model
    from rosetta.interop.convert import is_marian_like
    from rosetta.interop.marian_files import companion_dir

    model_path = Path(args.model)
    if is_marian_like(model_path) or (model_path.is_file() and companion_dir(model_path) is not None):
        # A Hugging Face Marian directory, or a converted checkpoint with its tokenizer beside it.
        opened, run_record = open_model(model_path, args.tokenizer), None
        if opened.tokenizer is None:
            raise RosettaError(f"{model_path}: no tokenizer found with the model (give --tokenizer)")
        tokenizer_path = getattr(opened.tokenizer, "directory", args.tokenizer or companion_dir(model_path))
    else:
        checkpoint, tokenizer_path, run_record = ev.resolve_model(args.model, args.tokenizer)
        opened = open_model(checkpoint, tokenizer_path)
    for note in opened.notes:
        print(f"rosetta: note: {note}", file=sys.stderr)
    pair = ev.run_pair(run_record, args.pair)
    backend, said = decoding_backend(args, (run_record or {}).get("backend") or opened.trained_by)
    model = from_params(opened.decoding_config, opened.params, backend, args.dtype)
    search = {**search_settings(args, opened.search), **apply_languages(opened, args.src_lang, args.tgt_lang)}
    start = time.perf_counter()
    result = ev.evaluate_split(model, opened.tokenizer, args.split, pair, args.data_dir, args.limit,
                               batch_size=args.batch_size, beam=search.pop("beam"),
                               max_len_margin=search.pop("margin"), **search)
    hyps = str(ev.write_hypotheses(args.hyps, result["hypotheses"])) if args.hyps is not None else None
    report = {
        "format": ev.FORMAT, "checkpoint": str(opened.path), "tokenizer": str(tokenizer_path),
        "split": args.split, "pair": pair, "data_dir": str(resolve_data_dir(args.data_dir)),
        "limit": args.limit,
        "backend": backend, "dtype": model.dtype, "beam": result["search"]["beam"],
        "alpha": result["search"]["alpha"], "margin": result["search"]["max_len_margin"],
        "length_rule": result["search"]["length_rule"], "batch_size": args.batch_size,
        "sentences": result["sentences"], "bleu": result["bleu"], "chrf": result["chrf"],
        "hypotheses": hyps, "time_s": time.perf_counter() - start,
    }
    written = ev.write_report(args.out, report)
    subset = f" (first {result['sentences']})" if args.limit is not None else ""
    print(f"{args.split} {pair}{subset}, {result['sentences']} sentences, beam {report['beam']}, "
          f"alpha {report['alpha']}, {backend}")
    print(f"{result['bleu']['text']}\n  {result['bleu']['signature']}")
    print(f"{result['chrf']['text']}\n  {result['chrf']['signature']}")
    if hyps:
        print(f"wrote {hyps}")
    print(f"wrote {written}")
    if said is not None:
        print(said, file=sys.stderr)
    return 0


def cmd_example(args: argparse.Namespace) -> int:
    """Build the example model directory (rosetta/harness/example.py); say what was written."""
    from rosetta.harness.example import build_opus_mt_dir, check_example_args

    check_example_args(args.dir, args.steps)  # before the data is read: a used DIR should not wait
    if args.name == "nllb":
        from rosetta.harness.example_nllb import build_nllb_dir

        if args.separate:
            raise RosettaError("--separate is opus-mt's: the nllb example has one vocabulary")
        out = build_nllb_dir(args.dir, steps=args.steps, seed=args.seed, data_dir=args.data_dir)
        print(f"wrote {out} (an M2M100ForConditionalGeneration trained {args.steps} steps on Multi30k, "
              f"de-en and en-de); try:")
        print(f'  echo "Ein Hund läuft." | rosetta translate --checkpoint {out} --tgt-lang en')
        return 0
    out = build_opus_mt_dir(args.dir, separate=args.separate, steps=args.steps, seed=args.seed,
                            data_dir=args.data_dir)
    vocab = "separate vocabularies" if args.separate else "joint vocabulary"
    print(f"wrote {out} (a MarianMTModel trained {args.steps} steps on Multi30k de-en, {vocab}); try:")
    print(f'  echo "Ein Hund läuft." | rosetta translate --checkpoint {out}')
    return 0


def add_parsers(cmds: argparse._SubParsersAction) -> None:
    """Register `average`, `evaluate` and `example` on rosetta/cli.py's subcommands."""
    from rosetta.cli_args import (
        add_language_args,
        add_search_args,
        non_negative_int,
        nonempty_path,
        output_file,
        positive_int,
    )
    from rosetta.harness.average import DEFAULT_LAST

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
                   help="Multi30k directory (default $ROSETTA_DATA_DIR, else the package's bundled copy)")
    p.add_argument("--limit", type=positive_int, help="the first N sentences only (default all)")
    add_search_args(p, beam=4)  # the search flags of `generate` and `translate` (paper §6.1: beam 4)
    add_language_args(p)
    p.add_argument("--hyps", type=output_file, metavar="FILE", help="also write the hypotheses, one a line")
    p.add_argument("--out", type=output_file, required=True, metavar="FILE.json",
                   help="where to write the JSON report")
    p.set_defaults(func=cmd_evaluate)

    p = cmds.add_parser("example", help="build a small trained opus-mt or M2M100 directory, offline",
                        epilog="needs torch, transformers and sentencepiece. DIR must be new or an empty "
                               "folder; it appears only once complete (docs/real-models.md)")
    p.add_argument("name", choices=["opus-mt", "nllb"],
                   help="the example: opus-mt (Hugging Face MarianMTModel, SentencePiece tokenizers, German "
                        "to English) or nllb (M2M100ForConditionalGeneration + M2M100Tokenizer, language "
                        "codes, German <-> English)")
    p.add_argument("dir", type=nonempty_path, metavar="DIR", help="the folder to write")
    p.add_argument("--separate", action="store_true",
                   help="separate source and target vocabularies (target_vocab.json) instead of a joint one")
    p.add_argument("--steps", type=positive_int, default=DEFAULT_STEPS,
                   help=f"training steps (default {DEFAULT_STEPS}: under a minute on 2 CPU cores)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="init and batch seed (default 0)")
    p.add_argument("--data-dir", type=nonempty_path,
                   help="Multi30k directory (default $ROSETTA_DATA_DIR, else the package's bundled copy)")
    p.set_defaults(func=cmd_example)
