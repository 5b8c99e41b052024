"""Checkpoint averaging (paper §6.1): "For the base models, we used a single model obtained by
averaging the last 5 checkpoints, which were written at 10-minute intervals" (20 for big models).

The average of parameter tensors is taken elementwise in float64 and cast back to the inputs'
dtype once, at the end. Summing in the stored dtype would round after every addition (float16
and bfloat16 keep 11 and 8 significant bits), so the result would depend on the order of the
checkpoints; float64 holds the exact sum of up to 2^29 float32 values, so the only rounding is
the final cast and the average of N identical checkpoints is that checkpoint, bit for bit.

Framework-free (NumPy and the checkpoint contract of rosetta/checkpoint.py). Which files to
average is `resolve_checkpoints`' job: files, checkpoint directories, a `checkpoints/latest`
pointer, or the last N checkpoints of a run (rosetta/harness/run_dir.py layout).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from rosetta.checkpoint import DTYPES, load_checkpoint, read_header, save_checkpoint
from rosetta.config import ModelConfig
from rosetta.errors import CheckpointError
from rosetta.harness.run_dir import (
    check_checkpoint_dir,
    is_checkpoint_name,
    latest_checkpoint,
    list_checkpoints,
)
from rosetta.params import Params

# The paper's count (§6.1, base models); the big models averaged the last 20.
DEFAULT_LAST = 5
MODEL_FILE = "model.safetensors"
LATEST = "latest"  # rosetta/harness/run_dir.py's pointer file


@dataclass(frozen=True)
class Resolved:
    """The checkpoint files to average, in the order given, and notes for the user (a run that
    holds fewer checkpoints than asked for)."""

    paths: list[Path]
    notes: list[str]


def _run_checkpoints(run_dir: Path, last: int) -> tuple[list[Path], str | None]:
    """The newest `last` checkpoints of a run directory, oldest first, each checked to be what
    its name says; a note when the run holds fewer."""
    found = list_checkpoints(run_dir / "checkpoints")
    if not found:
        raise CheckpointError(f"{run_dir}: the run has no checkpoint yet")
    chosen = found[-last:]
    for _, ckpt_dir in chosen:
        check_checkpoint_dir(ckpt_dir)
    note = None
    if len(chosen) < last:
        note = (f"{run_dir}: holds {len(chosen)} checkpoint(s), fewer than the {last} asked for; averaging "
                f"those (train with --keep {last} or more to keep them)")
    return [ckpt_dir / MODEL_FILE for _, ckpt_dir in chosen], note


def _resolve_one(path: Path, last: int) -> tuple[list[Path], str | None, bool]:
    """(files, note, is_run) for one command-line argument."""
    if path.name == LATEST and path.is_file():  # checkpoints/latest: the checkpoint it names
        named = latest_checkpoint(path.parent)
        if named is None:
            raise CheckpointError(f"{path}: names no complete checkpoint")
        return [named / MODEL_FILE], None, False
    if path.is_file():
        return [path], None, False
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint file or directory")
    if (path / MODEL_FILE).is_file():  # one checkpoint directory
        if path.parent.name == "checkpoints" and is_checkpoint_name(path.name):
            check_checkpoint_dir(path)
        return [path / MODEL_FILE], None, False
    if (path / "checkpoints").is_dir() or (path / "run.json").is_file():  # a run directory
        files, note = _run_checkpoints(path, last)
        return files, note, True
    runs = sorted(p for p in path.iterdir() if (p / "run.json").is_file())  # `train --out OUT`
    if len(runs) == 1:
        return _resolve_one(runs[0], last)
    if runs:
        names = ", ".join(p.name for p in runs)
        raise CheckpointError(f"{path}: holds the runs {names} (one per backend); pass {path}/<one of them>")
    raise CheckpointError(f"{path}: neither a checkpoint file, a checkpoint directory nor a training run")


def resolve_checkpoints(inputs: Sequence[str | os.PathLike[str]], last: int | None = None) -> Resolved:
    """The model files that `inputs` name: a checkpoint file, a checkpoint directory (its
    model.safetensors), a `checkpoints/latest` pointer (the checkpoint it names), or a run
    directory (its newest `last` checkpoints, default DEFAULT_LAST). A file named twice is refused:
    it would count twice in the mean."""
    if not inputs:
        raise CheckpointError("no checkpoint to average")
    if last is not None and (isinstance(last, bool) or not isinstance(last, int) or last < 1):
        raise CheckpointError(f"--last must be an integer >= 1, got {last!r}")
    paths, notes, any_run = [], [], False
    for given in inputs:
        files, note, is_run = _resolve_one(Path(given), DEFAULT_LAST if last is None else last)
        paths += files
        any_run |= is_run
        if note:
            notes.append(note)
    if last is not None and not any_run:
        raise CheckpointError("--last counts the checkpoints of a run directory; none was given")
    seen: dict[Path, Path] = {}
    for path in paths:
        key = path.resolve()
        if key in seen:
            raise CheckpointError(f"{path}: named twice (also as {seen[key]}); each checkpoint counts once")
        seen[key] = path
    return Resolved(paths, notes)


def _config_difference(a: ModelConfig, b: ModelConfig) -> str:
    diffs = [f"{f.name} {getattr(a, f.name)!r} vs {getattr(b, f.name)!r}"
             for f in fields(ModelConfig) if getattr(a, f.name) != getattr(b, f.name)]
    return ", ".join(diffs)


def _step(metadata: dict[str, str]) -> int | None:
    step = metadata.get("step")
    return int(step) if step is not None and step.isdigit() else None


def average_checkpoints(paths: Sequence[str | os.PathLike[str]]) -> tuple[ModelConfig, Params]:
    """The elementwise mean of the checkpoints' parameters, computed in float64 and cast to
    their common dtype (paper §6.1). Every checkpoint must have the same config (hence the same
    tensor names and shapes) and the same stored dtype; otherwise a CheckpointError names the
    file and the difference. The headers are all checked before any tensor is read, and only
    one checkpoint is in memory at a time besides the float64 sums."""
    config, _, dtype = _check_compatible(paths)
    total: dict[str, np.ndarray] = {}
    for path in paths:
        ckpt = load_checkpoint(path)
        # load_checkpoint validates again: a file replaced since the header check is caught here.
        if ckpt.config != config or ckpt.dtype != dtype:
            raise CheckpointError(f"{path}: changed while the checkpoints were averaged")
        for name, value in ckpt.params.items():
            value = np.asarray(value, dtype=np.float64)  # exact: every stored type widens losslessly
            if name in total:
                total[name] += value
            else:
                total[name] = value.copy()
    n = float(len(paths))
    return config, {name: (value / n).astype(DTYPES[dtype]) for name, value in total.items()}


def _check_compatible(paths: Sequence[str | os.PathLike[str]]) -> tuple[ModelConfig, list[int | None], str]:
    """(config, steps, dtype) shared by every checkpoint, from the headers alone."""
    if not paths:
        raise CheckpointError("no checkpoint to average")
    first: tuple[Path, ModelConfig, str] | None = None
    steps = []
    for path in map(Path, paths):
        header = read_header(path)
        meta = header.metadata
        try:
            config = ModelConfig.from_json(meta["config"])
        except (KeyError, ValueError) as e:  # ConfigError is a ValueError
            raise CheckpointError(f"{path}: not a rosetta checkpoint (config in metadata: {e})") from None
        dtype = meta.get("dtype", "float32")
        steps.append(_step(meta))
        if first is None:
            first = (path, config, dtype)
            continue
        path0, config0, dtype0 = first
        if config != config0:
            raise CheckpointError(f"{path} and {path0} have different configs "
                                  f"({_config_difference(config, config0)}): only checkpoints of one "
                                  f"model can be averaged")
        if dtype != dtype0:
            raise CheckpointError(f"{path} is stored as {dtype}, {path0} as {dtype0}: convert them to one "
                                  f"dtype first")
    assert first is not None
    return first[1], steps, first[2]


def write_average(paths: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str]) -> Path:
    """Average `paths` and write the result to `out` (atomically, canonical layout, the inputs'
    dtype), with metadata naming the averaged checkpoints and their steps."""
    paths = [Path(p) for p in paths]
    out = Path(out)
    if out.resolve() in {p.resolve() for p in paths}:
        raise CheckpointError(f"--out {out} is one of the checkpoints being averaged; write elsewhere")
    _, steps, dtype = _check_compatible(paths)
    config, params = average_checkpoints(paths)
    metadata = {"averaged_from": json.dumps([str(p) for p in paths]),
                "averaged_steps": json.dumps(steps),
                "averaged_count": str(len(paths))}
    return save_checkpoint(out, config, params, dtype=dtype, metadata=metadata)
