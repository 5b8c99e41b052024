"""The files that go with a model's weights: its tokenizer and its search settings, where they
live, and how they travel through `rosetta convert`.

Where they are:
- a Marian (opus-mt) directory holds them itself: `source.spm`, `target.spm`, `vocab.json`,
  `target_vocab.json` (separate vocabularies only), `tokenizer_config.json`,
  `generation_config.json`; a model trained here and written with `--to marian` holds
  `tokenizer.json` (our BPE, Hugging Face's fast format) instead of the SentencePiece files;
- a checkpoint file `X.safetensors` (or `X.msgpack`) written by `rosetta convert` keeps them in
  the folder `X.tokenizer/` beside it, the sidecar; `rosetta translate --checkpoint X.safetensors`
  finds it there (`--tokenizer` names another);
- a training run keeps `tokenizer.json` beside its checkpoints (rosetta/harness/translate.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rosetta.config import ModelConfig, read_json_object
from rosetta.errors import CheckpointError, ConfigError
from rosetta.files import atomic_write_bytes
from rosetta.tokenizer import MARIAN_TOKENIZER_FILES, find_tokenizer, is_marian_tokenizer_dir

GENERATION_CONFIG = "generation_config.json"
BPE_FILE = "tokenizer.json"
SIDECAR_SUFFIX = ".tokenizer"
# Every file a sidecar may hold: a new one replaces them all (no stale target_vocab.json stays).
COMPANION_FILES = (*MARIAN_TOKENIZER_FILES, BPE_FILE, GENERATION_CONFIG)


def sidecar(checkpoint: str | os.PathLike) -> Path:
    """A checkpoint file's tokenizer folder, its tokenizer: `de-en.safetensors` -> `de-en.tokenizer/`."""
    return Path(checkpoint).with_suffix(SIDECAR_SUFFIX)


def companion_dir(model: str | os.PathLike) -> Path | None:
    """Where the tokenizer and generation config of a model path are: a directory itself (a Marian
    model, a checkpoint directory), a checkpoint file's sidecar; None when there is none."""
    model = Path(model)
    if model.is_dir():
        return model
    return sidecar(model) if sidecar(model).is_dir() else None


def copy_companions(source: str | os.PathLike | None, cfg: ModelConfig, dest: str | os.PathLike,
                    to_format: str) -> list[Path]:
    """Carry the tokenizer (and generation config) of `source` (a directory holding them, or a
    `tokenizer.json`; None: no tokenizer) to the model written at `dest`: into the Marian
    directory `dest` itself, else into `dest`'s sidecar, whose files of an earlier model go. The
    tokenizer must fit `cfg` (check_companions, before the model is written). Returns the files
    written."""
    dest = Path(dest)
    source = Path(source) if source is not None else None
    if source is None:
        files = {}
    elif source.is_file():  # a run's tokenizer.json
        files = {BPE_FILE: source}
    else:
        files = {name: source / name for name in COMPANION_FILES if (source / name).is_file()}
    if not files and to_format == "marian":
        return []
    if to_format == "marian":
        written = []
        if BPE_FILE in files and not is_marian_tokenizer_dir(source if source.is_dir() else source.parent):
            written.append(write_tokenizer(files.pop(BPE_FILE), dest, cfg))
            files.pop("tokenizer_config.json", None)  # write_tokenizer wrote the fast tokenizer's
        for name, path in files.items():  # the original generation_config.json replaces write_marian's
            atomic_write_bytes(dest / name, path.read_bytes())
            written.append(dest / name)
        return written
    folder = sidecar(dest)
    if folder.exists() and not folder.is_dir():
        raise CheckpointError(f"{folder}: exists and is not a folder; the tokenizer goes there")
    for name in COMPANION_FILES:
        if name not in files and (folder / name).is_file():
            (folder / name).unlink()  # another model's file
    for name, path in files.items():
        atomic_write_bytes(folder / name, path.read_bytes())
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
    return [folder / name for name in files]


def check_companions(source: str | os.PathLike, cfg: ModelConfig) -> None:
    """Refuse, naming the file, a tokenizer that is broken or not the model's, and a
    generation_config.json that is not JSON: before anything is written."""
    source = Path(source)
    if source.is_dir():
        tokenizer = find_tokenizer(source)
        if tokenizer is not None:
            tokenizer.check_fits(cfg)
        read_generation_config(source)
    else:
        from rosetta.tokenizer import Tokenizer

        Tokenizer.load(source).check_fits(cfg)


# -- generation_config.json -> our search ------------------------------------------------------

# Fields of Hugging Face's GenerationConfig our search does not do, with the value that means "off".
_UNSUPPORTED = {"do_sample": False, "early_stopping": False, "num_beam_groups": 1, "no_repeat_ngram_size": 0,
                "repetition_penalty": 1.0, "min_length": 0, "min_new_tokens": None, "diversity_penalty": 0.0,
                "num_return_sequences": 1, "encoder_no_repeat_ngram_size": 0, "temperature": 1.0}


def read_generation_config(directory: str | os.PathLike) -> dict[str, Any]:
    """The JSON object of `directory`'s generation_config.json ({} when there is none)."""
    path = Path(directory) / GENERATION_CONFIG
    if not path.is_file():
        return {}
    return read_json_object(path, "the generation config")


def search_defaults(directory: str | os.PathLike, cfg: ModelConfig) -> tuple[dict[str, Any], list[str]]:
    """Our search settings from `directory`'s generation_config.json, as Hugging Face's translation
    pipeline reads it (GenerationConfig's defaults for absent fields: greedy, length_penalty 1.0,
    max_length 20), and notes on what it asks that our search does not do. ({}, []) without one.

    Keys: beam, alpha, length_rule ("hf": Hugging Face's beam rule), margin and max_new_tokens
    (max_length counts the start token: at most max_length - 1 new tokens), banned (single-token
    bad_words_ids other than pad), renormalize (renormalize_logits), forced_eos (forced_eos_token_id
    equal to eos)."""
    where = Path(directory) / GENERATION_CONFIG
    if not where.is_file():
        return {}, []
    gen = read_generation_config(directory)

    def integer(field: str, default: int, minimum: int) -> int:
        value = gen.get(field, default)
        value = default if value is None else value
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{where}: {field} must be an integer >= {minimum}, got {value!r}")
        return value

    beam, max_length = integer("num_beams", 1, 1), integer("max_length", 20, 2)
    alpha = gen.get("length_penalty", 1.0)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ConfigError(f"{where}: length_penalty must be a number, got {alpha!r}")
    banned = []
    for words in gen.get("bad_words_ids") or []:
        if not (isinstance(words, list) and len(words) == 1 and isinstance(words[0], int)
                and not isinstance(words[0], bool) and 0 <= words[0] < cfg.tgt_vocab_size):
            raise ConfigError(f"{where}: bad_words_ids entry {words!r}: only single token ids inside the "
                              f"target vocabulary ({cfg.tgt_vocab_size}) are banned by rosetta's search")
        if words[0] not in (cfg.pad_id, cfg.eos_id):  # pad is never emitted; HF drops [eos] as we do
            banned.append(words[0])
    forced = gen.get("forced_eos_token_id")
    notes = [f"{where}: {field}={gen[field]!r} is not part of rosetta's search; ignored"
             for field, off in _UNSUPPORTED.items() if field in gen and gen[field] not in (off, None)]
    if forced not in (None, cfg.eos_id):
        notes.append(f"{where}: forced_eos_token_id={forced!r} is not eos ({cfg.eos_id}); ignored")
    settings = {"beam": beam, "alpha": float(alpha), "length_rule": "hf", "margin": max_length,
                "max_new_tokens": max_length - 1, "banned": tuple(banned),
                "renormalize": bool(gen.get("renormalize_logits", False)), "forced_eos": forced == cfg.eos_id}
    return settings, notes


# -- our BPE tokenizer -> Hugging Face's fast tokenizer ----------------------------------------

def write_tokenizer(tokenizer_file: str | os.PathLike, directory: str | os.PathLike,
                    cfg: ModelConfig) -> Path:
    """Our BPE tokenizer (a `tokenizers` JSON file) as `tokenizer.json` + `tokenizer_config.json`
    that `PreTrainedTokenizerFast(tokenizer_file=...)` and `AutoTokenizer` load, encoding and
    decoding as `rosetta translate` does: eos appended to every source (our data convention), and
    the leading space of the byte-level pre-tokenizer's `add_prefix_space` dropped on decoding."""
    try:
        import tokenizers
        from tokenizers import decoders, processors
    except ImportError:
        raise CheckpointError("exporting the tokenizer needs the `tokenizers` package "
                              "(the train extra)") from None
    try:
        tok = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    except Exception as e:  # noqa: BLE001 - the Rust side raises plain Exception on bad JSON
        raise CheckpointError(f"{tokenizer_file}: not a readable tokenizer file: {e}") from None
    names = {role: tok.id_to_token(getattr(cfg, f"{role}_id")) for role in ("pad", "bos", "eos")}
    if any(name is None for name in names.values()) or tok.get_vocab_size() > cfg.src_vocab_size:
        raise CheckpointError(f"{tokenizer_file}: does not fit the model (special ids "
                              f"{cfg.pad_id}/{cfg.bos_id}/{cfg.eos_id}, vocabulary {cfg.src_vocab_size})")
    tok.post_processor = processors.TemplateProcessing(single=f"$A {names['eos']}",
                                                       special_tokens=[(names["eos"], cfg.eos_id)])
    decoder = json.loads(tok.to_str()).get("decoder") or {}
    already = decoder.get("type") == "Sequence" and any(d.get("type") == "Strip" for d in decoder["decoders"])
    if tok.decoder is not None and not already:  # not a tokenizer this function wrote before
        tok.decoder = decoders.Sequence([tok.decoder, decoders.Strip(" ", 1, 0)])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": names["pad"],
              "bos_token": names["bos"], "eos_token": names["eos"], "model_max_length": cfg.max_len,
              "clean_up_tokenization_spaces": False}
    directory = Path(directory)
    atomic_write_bytes(directory / BPE_FILE, tok.to_str().encode("utf-8"))
    atomic_write_bytes(directory / "tokenizer_config.json", (json.dumps(config, indent=2) + "\n").encode())
    return directory / BPE_FILE

