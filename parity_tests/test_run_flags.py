"""`rosetta train`'s flags are generated from RunConfig's fields (rosetta/harness/run_config.py,
rosetta/harness/commands.py): one flag per field, its default the field's, and the command line
the same as when the flags were written by hand (the list below is that command line)."""

from __future__ import annotations

import dataclasses

import pytest

from rosetta.cli import build_parser, main
from rosetta.harness.commands import run_from_args
from rosetta.harness.recipes import RECIPES
from rosetta.harness.run_config import RunConfig

# Every flag of `rosetta train` before the flags were generated (rosetta/cli.py at b43eaea), and
# those added since (--trace: issue 28; --compile, --compile-cache: issue 36).
HAND_WRITTEN = {
    "--recipe", "--backend", "--preset", "--set", "--seed", "--out", "--resume", "--overwrite", "--task",
    "--pair", "--data-dir", "--download", "--vocab-size", "--train-size", "--eval-size", "--eval-split",
    "--synthetic-max-len", "--max-tokens", "--buckets", "--batching", "--steps", "--epochs", "--warmup",
    "--lr-factor", "--label-smoothing", "--clip-norm", "--loss", "--dtype", "--device", "--eval-every",
    "--beam", "--alpha", "--margin", "--bleu-samples", "--checkpoint-every", "--keep", "--log-every",
    "--peak-tflops", "--progress", "--no-progress", "--time-budget", "--target-bleu", "--average-last",
    "--nproc", "--accumulate", "--shard", "--devices", "--dist-timeout", "--baseline", "--trace",
    "--compile", "--compile-cache",
}


def _train_parser():
    subparsers = next(a for a in build_parser()._actions if a.dest == "command")
    return subparsers.choices["train"]


def test_the_flags_are_the_hand_written_ones_one_per_field():
    actions = [a for a in _train_parser()._actions if a.option_strings and a.dest != "help"]
    assert {s for a in actions for s in a.option_strings} == HAND_WRITTEN
    fields = [f.name for f in dataclasses.fields(RunConfig)]
    dests = [a.dest for a in actions if a.dest not in ("recipe", "download")]
    assert sorted(dests) == sorted(fields)  # one flag per field, none missing, none twice


def test_each_help_shows_the_fields_default():
    for action in _train_parser()._actions:
        field = next((f for f in dataclasses.fields(RunConfig) if f.name == action.dest), None)
        if field is None or field.default in (None, False, dataclasses.MISSING):
            continue
        shown = ",".join(map(str, field.default)) if isinstance(field.default, tuple) else field.default
        said = (f"(default {shown})", f"(default {shown}; --recipe ")
        assert any(s in action.help for s in said), action.help


def test_the_recipe_help_says_what_it_sets_and_each_flag_what_the_recipe_makes_it(capsys):
    """Issue 57: --recipe did not say what it sets, and each flag showed a default the recipe overrides.
    The --recipe help lists the recipe as flags: given instead of --recipe, they make the same run; each
    flag the recipe sets shows both values (--steps: the recipe's --epochs instead)."""
    import re

    helps = {a.dest: " ".join(a.help.split()) for a in _train_parser()._actions if a.help}
    said = re.search(r"multi30k sets (.*?)\)$", helps["recipe"])[1]
    parse = build_parser().parse_args
    recipe = run_from_args(parse(["train", "--recipe", "multi30k"]))
    assert run_from_args(parse(["train", *said.split()])) == recipe
    assert "(default 4096; --recipe multi30k: 2048)" in helps["max_tokens"]
    assert "(default 4000; --recipe multi30k: 300)" in helps["warmup"]
    assert "(default 500; --recipe multi30k: 300)" in helps["eval_every"]
    assert "(--recipe multi30k: dropout=0.1)" in helps["overrides"]
    assert "(--recipe multi30k: --epochs 30 instead)" in helps["steps"]
    assert "(--recipe multi30k: 5)" in helps["average_last"]
    # What --max-tokens counts (rosetta/harness/batching.py: src and tgt_in are each rows x L; the
    # global batch, split over devices and micro-batches: rosetta/distributed.py).
    assert "counted on each side" in helps["max_tokens"] and "padding included" in helps["max_tokens"]
    assert "not per device" in helps["max_tokens"]


def test_no_flag_gives_runconfigs_defaults_and_flags_set_their_field():
    parse = build_parser().parse_args
    assert run_from_args(parse(["train"])) == RunConfig()
    run = run_from_args(parse([
        "train", "--backend", "torch", "jax", "--margin", "7", "--set", "dropout=0", "--set", "d_ff=32",
        "--buckets", "16,32", "--no-progress", "--shard", "--clip-norm", "1.5", "--out", "o",
        "--epochs", "2"]))
    assert run == RunConfig(backends=("torch", "jax"), max_len_margin=7, overrides={"dropout": 0, "d_ff": 32},
                            buckets=(16, 32), progress=False, shard=True, clip_norm=1.5, out="o", epochs=2)


def test_a_recipe_replaces_the_defaults_and_the_command_line_replaces_the_recipe():
    parse = build_parser().parse_args
    recipe = RECIPES["multi30k"]
    assert run_from_args(parse(["train", "--recipe", "multi30k"])) == RunConfig(**recipe)
    run = run_from_args(parse(["train", "--recipe", "multi30k", "--set", "dropout=0.3", "--set", "d_ff=64",
                               "--steps", "5", "--keep", "6"]))
    assert run == RunConfig(**{**recipe, "overrides": {"dropout": 0.3, "d_ff": 64}, "steps": 5,
                               "epochs": None, "keep": 6})


@pytest.mark.parametrize("argv, message", [
    (["--buckets", "16,x"], "argument --buckets: must be comma-separated integers (16,32,64), got '16,x'"),
    (["--steps", "3", "--epochs", "2"], "argument --epochs: not allowed with argument --steps"),
    (["--margin", "1.5"], "argument --margin: must be an integer, got '1.5'"),
])
def test_bad_flags_are_one_line(argv, message, capsys):
    assert main(["train", *argv]) == 2
    assert capsys.readouterr().err == f"rosetta: error: {message}\n"
