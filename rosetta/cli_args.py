"""The command line's shared argument types and flag groups: each value's syntax and range,
refused by argparse naming the flag (rosetta/cli.py's `main` prints it as one line). A leaf:
rosetta/cli.py and every command group's parsers (rosetta/harness/commands.py, the benchmarks)
import it, and it imports none of them."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from collections.abc import Callable

from rosetta import json_input
from rosetta.backends import MODEL_BACKENDS, default_decoder
from rosetta.errors import RosettaError
from rosetta.files import check_writable
from rosetta.generation import ALPHA_MAX, LENGTH_RULES

# -- Argument types: the value's syntax and range, refused by argparse with the flag's name ------

_INTEGER = re.compile(r"-?[0-9]+")  # ASCII digits: int() alone would take "1_0" and "٥"
_REAL = re.compile(r"-?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?")  # no nan, inf, "1_0"


def integer_type(minimum: int | None = None, maximum: int | None = None) -> Callable[[str], int]:
    """An integer within [minimum, maximum] (a count a machine can run: threads, rounds)."""
    def parse(text: str) -> int:
        value = int(text) if _INTEGER.fullmatch(text) else None
        if value is None or (minimum is not None and value < minimum) \
                or (maximum is not None and value > maximum):
            bound = "" if minimum is None else f" >= {minimum}"
            bound += "" if maximum is None else f" and <= {maximum}"
            raise argparse.ArgumentTypeError(f"must be an integer{bound}, got {text!r}")
        return value

    return parse


def real_type(minimum: float | None = None, maximum: float | None = None,
              above: float | None = None) -> Callable[[str], float]:
    """A finite number within [minimum, maximum], and more than `above` (a bound it may not equal)."""
    def parse(text: str) -> float:
        value = float(text) if _REAL.fullmatch(text) else math.nan
        if not math.isfinite(value) or (minimum is not None and value < minimum) \
                or (maximum is not None and value > maximum) or (above is not None and value <= above):
            bound = "" if minimum is None else f" >= {minimum:g}"
            bound += "" if above is None else f" > {above:g}"
            bound += "" if maximum is None else f" and <= {maximum:g}"
            raise argparse.ArgumentTypeError(f"must be a finite number{bound}, got {text!r}")
        return value

    return parse


def nonempty_path(text: str) -> str:
    """A file or directory name: "" is refused (Path("") is the current directory, and a test
    `if args.hyps:` would skip the flag without a word)."""
    if not text:
        raise argparse.ArgumentTypeError("must name a file or directory, got ''")
    return text


def output_file(text: str) -> str:
    """A file a command will write: refused here, before any work, if it cannot be one (a
    directory, a file where a parent directory should be: rosetta.files.check_writable,
    which atomic_write applies again when it writes)."""
    try:
        check_writable(nonempty_path(text))
    except RosettaError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def integer_list(text: str) -> tuple[int, ...]:
    """Comma-separated integers ("16,32,64"), each ASCII digits (`train` checks the range)."""
    parts = text.split(",")
    if not all(_INTEGER.fullmatch(part) for part in parts):
        raise argparse.ArgumentTypeError(f"must be comma-separated integers (16,32,64), got {text!r}")
    return tuple(int(part) for part in parts)


def parse_overrides(pairs: list[str]) -> dict:
    """`--set field=value` pairs; values parse as JSON (numbers, true/false), else as strings."""
    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise RosettaError(f"--set takes field=value, got {pair!r}")
        key, text = pair.split("=", 1)
        try:
            out[key] = json_input.loads(text)
        except json_input.JSONRefused as e:  # JSON past the reader's bounds: NaN, 1e400, 401 digits, deep
            raise RosettaError(f"--set {key}: {e}") from None
        except json.JSONDecodeError:
            out[key] = text
    return out


def machine_memory() -> int:
    """This machine's physical memory in bytes (the pages the OS reports times their size)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def machine_cores() -> int:
    """The CPU cores this machine reports (1 where it reports none)."""
    return os.cpu_count() or 1


# The most of any count a benchmark times or repeats (repeats, steps, passes, rounds): the longest
# default is 10, so ten thousand is far past any measurement and still ends (issue 57: 10**30).
MAX_COUNT = 10_000

positive_int = integer_type(minimum=1)
count = integer_type(1, MAX_COUNT)  # a number of repeats, steps, passes: at least one, at most MAX_COUNT
core_count = integer_type(1, machine_cores())  # threads or processes of this machine: at most its cores
non_negative_int = integer_type(minimum=0)
integer = integer_type()  # `train` checks the range itself (rosetta/harness/run_config.py: check_run)
non_negative_real = real_type(minimum=0.0)
positive_real = real_type(above=0.0)  # a time, a rate, a peak: 0 means nothing, not "no limit"
real = real_type()  # `train` checks the range itself, as for `integer`


# The search without flags and without a model's generation_config.json (the paper's settings,
# §6.1; `generate` defaults to greedy).
SEARCH_DEFAULTS = {"alpha": 0.6, "margin": 50, "length_rule": "wu", "banned": (), "renormalize": False,
                   "max_new_tokens": None, "forced_eos": False, "forced_first": None}
SEARCH_FLAGS = ("beam", "alpha", "margin", "length_rule")


def add_search_args(p: argparse.ArgumentParser, beam: int) -> None:
    """Backend and search flags shared by `generate`, `translate` and `evaluate`. A search flag
    not given leaves the setting to the model's generation_config.json, else SEARCH_DEFAULTS
    (`search_settings`)."""
    p.add_argument("--backend", choices=MODEL_BACKENDS,
                   help="default: a run's own backend, else the fastest installed (torch, then jax), "
                        "both with a cache; numpy is the float64 reference: exact, without a cache, slow "
                        "(seconds a sentence)")
    p.add_argument("--dtype", default=None, help="compute dtype (default: the backend's first)")
    p.add_argument("--beam", type=positive_int,
                   help=f"beam size (the paper's 4), at most the target vocabulary; 1 = greedy search "
                        f"(default: the model's generation_config.json num_beams, else {beam})")
    p.add_argument("--alpha", type=real_type(0.0, ALPHA_MAX),
                   help=f"length penalty exponent (Wu et al. 2016), 0 to {ALPHA_MAX:g} (default: "
                        f"generation_config.json's length_penalty, else 0.6)")
    p.add_argument("--margin", type=non_negative_int,
                   help="max output length = source length + margin (default: the new tokens "
                        "generation_config.json allows, else 50)")
    p.add_argument("--batch-size", type=positive_int, default=32, help="sentences decoded at once")
    p.add_argument("--length-rule", choices=LENGTH_RULES,
                   help="beam score: wu = log P / ((5 + n) / 6)^alpha (Wu et al. 2016); hf = Hugging Face "
                        "generate's beam search, log P / n^alpha (default: hf for a model with a "
                        "generation_config.json, else wu)")
    p.set_defaults(default_beam=beam)


def add_language_args(p: argparse.ArgumentParser) -> None:
    """`translate` and `evaluate` on a model whose tokenizer has language codes (M2M100)."""
    p.add_argument("--src-lang", help="the source language code (M2M100: 'de', NLLB: 'deu_Latn'), written "
                                      "in every source; default: tokenizer_config.json's src_lang, else en "
                                      "(NLLB: eng_Latn)")
    p.add_argument("--tgt-lang", help="the target language code, forced as the first token (generate's "
                                      "forced_bos_token_id; default: generation_config.json's)")


def decoding_backend(args: argparse.Namespace, trained_by: str | None,
                     path: object = None) -> tuple[str, str | None]:
    """(--backend, None), or when it is not given the default (rosetta.backends.default_decoder: the
    run's own, else the fastest installed) and the line that says so: for stderr once the decoding is
    done (a refusal before it stays one line), or with the model file `path`, for before the first
    sentence is decoded (`translate`)."""
    if args.backend is not None:
        return args.backend, None
    name, why = default_decoder(trained_by)
    what = "decoded with" if path is None else f"decoding {path} with"
    return name, f"rosetta: {what} {name} ({why}); --backend numpy decodes with the float64 reference"


def search_settings(args: argparse.Namespace, model_defaults: dict) -> dict:
    """The search to run: SEARCH_DEFAULTS, then the model's generation_config.json
    (rosetta/interop/marian_files.py: search_defaults), then the flags given."""
    settings = {**SEARCH_DEFAULTS, "beam": args.default_beam, **model_defaults}
    settings.update({flag: getattr(args, flag) for flag in SEARCH_FLAGS if getattr(args, flag) is not None})
    return settings
