"""Translation with a model: find its weights, tokenizer and search settings, encode sentences,
decode with any backend (`model.generate`: greedy or beam search), detokenise.

`open_model` takes what `--checkpoint` names: a checkpoint file (its tokenizer in the sidecar
`NAME.tokenizer/` that `rosetta convert` writes: rosetta/interop/marian_files.py), a Hugging Face
Marian (opus-mt) directory, converted in memory with its SentencePiece tokenizer and its
generation_config.json, or a training run. A run directory (`rosetta train --out OUT`) resolves
to its newest checkpoint:
`OUT/<backend>/checkpoints/<latest>/model.safetensors` and the `tokenizer.json` beside it; a
checkpoint that is not what its name says (a symlink out of the run, another step's files) is
refused (rosetta/harness/run_dir.py: check_checkpoint_dir).
Runs of the synthetic tasks have no tokenizer: their input lines are space-separated ids.
As in training (rosetta/harness/batching.py), every source gets eos appended.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rosetta.backends import BackendModel, check_search
from rosetta.config import ModelConfig
from rosetta.errors import InputError, RosettaError
from rosetta.harness.report import RUN_SCHEMA, read_json
from rosetta.harness.run_dir import LATEST, check_checkpoint_dir, is_checkpoint_name, latest_checkpoint
from rosetta.inputs import check_int, parse_id_line
from rosetta.params import Params
from rosetta.tokenizer import TextTokenizer, load_tokenizer


def resolve_run(path: str | os.PathLike[str]) -> tuple[Path, Path | None]:
    """(model.safetensors, tokenizer.json or None) of a run directory, a backend's run directory,
    a checkpoint directory, or a checkpoints/latest pointer file."""
    path = Path(path)
    if path.name == LATEST and path.is_file():  # checkpoints/latest, the pointer file: what it names
        named = latest_checkpoint(path.parent)
        if named is None:
            raise RosettaError(f"--run {path}: names no complete checkpoint")
        return resolve_run(named)
    if not path.is_dir():
        raise RosettaError(f"--run {path}: no such directory")
    if (path / "model.safetensors").is_file():
        ckpt_dir, run_dir = path, path.parent.parent
        if path.parent.name == "checkpoints" and is_checkpoint_name(path.name):
            check_checkpoint_dir(path)  # a run's own checkpoint: it must be what its name says
    elif (path / "checkpoints").is_dir() or (path / "run.json").is_file():
        ckpt_dir = latest_checkpoint(path / "checkpoints")
        if ckpt_dir is None:
            raise RosettaError(f"--run {path}: the run has no checkpoint yet")
        run_dir = path
    else:
        runs = sorted(p for p in path.iterdir() if (p / "run.json").is_file())
        if not runs:
            raise RosettaError(f"--run {path}: not a training run or checkpoint directory")
        if len(runs) > 1:
            names = ", ".join(p.name for p in runs)
            raise RosettaError(f"--run {path}: holds the runs {names}; pass --run {path}/<one of them>")
        return resolve_run(runs[0])
    candidates = (ckpt_dir / "tokenizer.json", run_dir / "tokenizer.json")
    tokenizer = next((p for p in candidates if p.is_file()), None)
    return ckpt_dir / "model.safetensors", tokenizer


@dataclass
class OpenedModel:
    """A model as `open_model` found it: weights, tokenizer (None: lines are ids), the search
    settings of its generation_config.json ({} without one), notes on what it asks that our
    search does not do, and the decoder's start token it names."""

    path: Path  # the checkpoint file or model directory read
    config: ModelConfig
    params: Params
    tokenizer: TextTokenizer | None
    search: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    run_dir: Path | None = None  # the training run it belongs to, if any
    decoder_start: int | None = None  # generation_config.json's decoder start token, if it has one

    @property
    def trained_by(self) -> str | None:
        """The backend whose training run wrote these weights (its run.json), None for another model."""
        if self.run_dir is None or not (self.run_dir / "run.json").is_file():
            return None
        return read_json(self.run_dir / "run.json", RUN_SCHEMA).get("backend")

    @property
    def decoding_config(self) -> ModelConfig:
        """The config to build the model that searches: Hugging Face's generate starts the decoder
        from generation_config.json's decoder_start_token_id, which may not be config.json's."""
        if self.decoder_start is None or self.decoder_start == self.config.bos_id:
            return self.config
        return dataclasses.replace(self.config, bos_id=self.decoder_start)


def no_model_at(path: Path) -> RosettaError:
    """The refusal of a model path that is neither a file nor a directory: a missing one, or a device,
    FIFO or socket, from which no model is read (opening a FIFO would wait for a writer forever)."""
    if path.exists():
        return RosettaError(f"{path}: not a regular file or a directory (a checkpoint file or model "
                            "directory is needed)")
    return RosettaError(f"{path}: no such checkpoint file or model directory")


def open_model(path: str | os.PathLike[str], tokenizer: str | os.PathLike[str] | None = None) -> OpenedModel:
    """The model `path` names: a checkpoint file (tokenizer from its sidecar), a Marian directory
    (weights converted in memory; its tokenizer and generation_config.json), or a run or checkpoint
    directory (resolve_run). `tokenizer` (a tokenizer.json or a folder of Marian's files) replaces
    the one found; it must fit the model either way."""
    from rosetta.interop import m2m100
    from rosetta.interop.convert import is_marian_like, read_model
    from rosetta.interop.m2m100_tokenizer import find_text_tokenizer, is_m2m100_tokenizer_dir
    from rosetta.interop.marian_files import companion_dir, read_generation_settings

    path, run_dir = Path(path), None
    if is_marian_like(path):
        weights, companions = path, path
    elif path.is_dir() or path.name == LATEST:
        weights, companions = resolve_run(path)
        run_dir = weights.parent.parent.parent if weights.parent.parent.name == "checkpoints" else None
    elif path.is_file():
        weights, companions = path, companion_dir(path)
    else:
        raise no_model_at(path)
    cfg, params = read_model(weights)
    if tokenizer is not None:
        m2m = is_m2m100_tokenizer_dir(tokenizer)
        found = find_text_tokenizer(tokenizer) if m2m else load_tokenizer(tokenizer)
    elif companions is None:
        found = None
    else:  # an M2M100 directory's tokenizer files must be there (find_text_tokenizer names the missing one)
        found = (load_tokenizer(companions) if companions.is_file()
                 else find_text_tokenizer(companions, m2m100=is_marian_like(path) and m2m100.is_m2m100(path)))
    if found is not None:
        found.check_fits(cfg)
    settings = read_generation_settings(companions, cfg) if companions is not None else None
    if settings is None:
        return OpenedModel(weights, cfg, params, found, run_dir=run_dir)
    return OpenedModel(weights, cfg, params, found, settings.search(), list(settings.notes), run_dir,
                       settings.decoder_start)


def apply_languages(opened: OpenedModel, src_lang: str | None, tgt_lang: str | None) -> dict[str, Any]:
    """--src-lang and --tgt-lang on a tokenizer with language codes (M2M100's: the source's code goes
    first in every source, the target's is forced first, as generate's forced_bos_token_id): the
    search settings they change ({"forced_first": id}, or {}). Refused in one line for a code the
    tokenizer does not have, or a tokenizer without codes."""
    if src_lang is None and tgt_lang is None:
        return {}
    tokenizer = opened.tokenizer
    if not hasattr(tokenizer, "lang_id"):
        flag = "--src-lang" if src_lang is not None else "--tgt-lang"
        raise RosettaError(f"{flag}: the tokenizer of {opened.path} has no language codes (M2M100 "
                           f"directories have them; an opus-mt model reads >>xx<< at the start of a line)")
    if src_lang is not None:
        tokenizer.lang_id(src_lang, "--src-lang")
        tokenizer.src_lang = src_lang
    return {} if tgt_lang is None else {"forced_first": tokenizer.lang_id(tgt_lang, "--tgt-lang")}


def encode_line(line: str, number: int, tokenizer: TextTokenizer | None, cfg: ModelConfig) -> list[int]:
    """Source ids of one input line, eos appended: the tokenizer's for text, or the ids themselves
    (ASCII digits inside the source vocabulary: rosetta.inputs.parse_id_line)."""
    if tokenizer is not None:
        return tokenizer.encode_source(line)
    try:
        return parse_id_line(line, number, cfg.src_vocab_size) + [cfg.eos_id]
    except InputError as e:
        raise InputError(f"{e} (without a tokenizer, as for the synthetic tasks, lines are space-separated "
                         f"token ids)") from None


def translate_lines(model: BackendModel, tokenizer: TextTokenizer | None, lines: Sequence[str], beam: int = 4,
                    alpha: float = 0.6, max_len_margin: int = 50, batch_size: int = 32,
                    length_rule: str = "wu", before_decoding: Callable[[], None] | None = None,
                    **constraints: Any) -> list[str]:
    """One output per input line (an empty line gives an empty output), in input order.
    `constraints` are `model.generate`'s keywords (banned, renormalize, max_new_tokens, forced_eos,
    forced_first). `before_decoding` is called once every line and the search settings have passed
    their checks, before the first sentence is decoded (`rosetta translate` says what it decodes with)."""
    cfg = model.config
    batch_size = check_int(batch_size, "batch_size", minimum=1)
    outputs = [""] * len(lines)
    todo = []
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text:
            continue
        ids = encode_line(text, number, tokenizer, cfg)
        if len(ids) > cfg.max_len:
            raise RosettaError(f"input line {number} is {len(ids)} tokens long with eos, more than the "
                               f"model's max_len {cfg.max_len}")
        todo.append((number - 1, ids))
    check_search(cfg, beam, alpha, max_len_margin, length_rule, **constraints)  # refusals come first
    if before_decoding is not None:
        before_decoding()
    for start in range(0, len(todo), batch_size):
        chunk = todo[start:start + batch_size]
        src = np.full((len(chunk), max(len(ids) for _, ids in chunk)), cfg.pad_id, dtype=np.int64)
        for row, (_, ids) in enumerate(chunk):
            src[row, :len(ids)] = ids
        generated = model.generate(src, beam, alpha, max_len_margin, length_rule, **constraints).tokens
        for (index, _), tokens in zip(chunk, generated, strict=True):
            outputs[index] = (tokenizer.decode(tokens) if tokenizer is not None
                              else " ".join(str(t) for t in tokens))
    return outputs
