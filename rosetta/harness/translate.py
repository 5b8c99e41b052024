"""Translation with a trained checkpoint: find the checkpoint and tokenizer of a run, encode
sentences, decode with any backend (`model.generate`: greedy or beam search), detokenise.

A run directory (`rosetta train --out OUT`) resolves to its newest checkpoint:
`OUT/<backend>/checkpoints/<latest>/model.safetensors` and the `tokenizer.json` beside it; a
checkpoint that is not what its name says (a symlink out of the run, another step's files) is
refused (rosetta/harness/run_dir.py: check_checkpoint_dir).
Runs of the synthetic tasks have no tokenizer: their input lines are space-separated ids.
As in training (rosetta/harness/batching.py), every source gets eos appended.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from rosetta.backends import BackendModel
from rosetta.config import ModelConfig
from rosetta.errors import InputError, RosettaError
from rosetta.harness.run_dir import LATEST, check_checkpoint_dir, is_checkpoint_name, latest_checkpoint
from rosetta.harness.tokenizer import Tokenizer
from rosetta.inputs import check_int, parse_id_line


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


def encode_line(line: str, number: int, tokenizer: Tokenizer | None, cfg: ModelConfig) -> list[int]:
    """Source ids of one input line, eos appended: BPE for text, or the ids themselves (ASCII
    digits inside the source vocabulary: rosetta.inputs.parse_id_line)."""
    if tokenizer is not None:
        return tokenizer.encode(line) + [cfg.eos_id]
    try:
        return parse_id_line(line, number, cfg.src_vocab_size) + [cfg.eos_id]
    except InputError as e:
        raise InputError(f"{e} (without a tokenizer, as for the synthetic tasks, lines are space-separated "
                         f"token ids)") from None


def translate_lines(model: BackendModel, tokenizer: Tokenizer | None, lines: Sequence[str], beam: int = 4,
                    alpha: float = 0.6, max_len_margin: int = 50, batch_size: int = 32,
                    length_rule: str = "wu") -> list[str]:
    """One output per input line (an empty line gives an empty output), in input order."""
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
    for start in range(0, len(todo), batch_size):
        chunk = todo[start:start + batch_size]
        src = np.full((len(chunk), max(len(ids) for _, ids in chunk)), cfg.pad_id, dtype=np.int64)
        for row, (_, ids) in enumerate(chunk):
            src[row, :len(ids)] = ids
        generated = model.generate(src, beam, alpha, max_len_margin, length_rule).tokens
        for (index, _), tokens in zip(chunk, generated, strict=True):
            outputs[index] = (tokenizer.decode(tokens) if tokenizer is not None
                              else " ".join(str(t) for t in tokens))
    return outputs
