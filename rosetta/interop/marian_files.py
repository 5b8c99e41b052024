"""The files that go with a model's weights: its tokenizer and its search settings, where they
live, and how they travel through `rosetta convert`.

Where they are:
- a Marian (opus-mt) directory holds them itself: `source.spm`, `target.spm`, `vocab.json`,
  `target_vocab.json` (separate vocabularies only), `tokenizer_config.json`,
  `generation_config.json`; a model trained here and written with `--to marian` holds
  `tokenizer.json` (our BPE, Hugging Face's fast format) instead of the SentencePiece files;
- an M2M100 directory holds `sentencepiece.bpe.model`, `vocab.json` and `tokenizer_config.json`
  (rosetta/interop/m2m100_tokenizer.py);
- an FSMT directory holds `vocab-src.json`, `vocab-tgt.json`, `merges.txt` and
  `tokenizer_config.json`: they travel (checked against the model's vocabularies) but are never run,
  as their Moses step needs `sacremoses` (rosetta/tokenizer.py: fsmt_refusal);
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
from rosetta.errors import CheckpointError
from rosetta.files import atomic_write_bytes
from rosetta.generation import GenerationSettings, check_generation_config
from rosetta.interop.m2m100_tokenizer import SPM_FILE, find_text_tokenizer, is_m2m100_tokenizer_dir
from rosetta.interop.nllb_tokenizer import SPECIAL_TOKENS_MAP
from rosetta.tokenizer import (
    FSMT_TOKENIZER_FILES,
    MARIAN_TOKENIZER_FILES,
    check_fsmt_vocabularies,
    is_fsmt_tokenizer_dir,
    is_marian_tokenizer_dir,
)

GENERATION_CONFIG = "generation_config.json"
BPE_FILE = "tokenizer.json"
SIDECAR_SUFFIX = ".tokenizer"
DIRECTORY_FORMATS = ("marian", "fsmt", "m2m100")  # Hugging Face directories: the tokenizer goes inside
# Every file a sidecar may hold: a new one replaces them all (no stale target_vocab.json stays).
# SPECIAL_TOKENS_MAP: an NLLB-200 download's list of codes where its tokenizer_config.json has none.
COMPANION_FILES = (*MARIAN_TOKENIZER_FILES, *FSMT_TOKENIZER_FILES, SPM_FILE, BPE_FILE, SPECIAL_TOKENS_MAP,
                   GENERATION_CONFIG)


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
    if not files and to_format in DIRECTORY_FORMATS:
        return []
    if to_format in DIRECTORY_FORMATS:
        written = []
        folder = source if source.is_dir() else source.parent
        if BPE_FILE in files and not (is_marian_tokenizer_dir(folder) or is_m2m100_tokenizer_dir(folder)):
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


def check_companions(source: str | os.PathLike, cfg: ModelConfig) -> GenerationSettings | None:
    """Refuse, naming the file, a tokenizer that is broken or not the model's, and a
    generation_config.json that `translate` would refuse (rosetta.generation's one check): before
    anything is written. Returns the generation settings (None without a generation_config.json)."""
    source = Path(source)
    if not source.is_dir():
        from rosetta.tokenizer import Tokenizer

        Tokenizer.load(source).check_fits(cfg)
        return None
    if is_fsmt_tokenizer_dir(source):  # FSMT's Moses + BPE files: checked, never run (rosetta/tokenizer.py)
        check_fsmt_vocabularies(source, cfg)
    elif (tokenizer := find_text_tokenizer(source)) is not None:
        tokenizer.check_fits(cfg)
    return read_generation_settings(source, cfg)


def has_tokenizer(source: str | os.PathLike | None) -> bool:
    """Whether `source` (what copy_companions takes) holds a tokenizer."""
    if source is None:
        return False
    source = Path(source)
    return source.is_file() or is_fsmt_tokenizer_dir(source) or find_text_tokenizer(source) is not None


# -- generation_config.json -> our search ------------------------------------------------------

def read_generation_config(directory: str | os.PathLike) -> dict[str, Any]:
    """The JSON object of `directory`'s generation_config.json ({} when there is none)."""
    path = Path(directory) / GENERATION_CONFIG
    if not path.is_file():
        return {}
    return read_json_object(path, "the generation config")


def read_generation_settings(directory: str | os.PathLike, cfg: ModelConfig) -> GenerationSettings | None:
    """`directory`'s generation_config.json, checked for the model `cfg`
    (rosetta.generation.check_generation_config); None when there is none."""
    path = Path(directory) / GENERATION_CONFIG
    if not path.is_file():
        return None
    return check_generation_config(read_generation_config(directory), cfg, path)


def search_defaults(directory: str | os.PathLike, cfg: ModelConfig) -> tuple[dict[str, Any], list[str]]:
    """Our search settings from `directory`'s generation_config.json, as Hugging Face's generate
    reads it, and the notes on what it asks that our search does not do; ({}, []) without one.
    Keys: rosetta.generation.GenerationSettings.search."""
    settings = read_generation_settings(directory, cfg)
    return ({}, []) if settings is None else (settings.search(), list(settings.notes))


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

