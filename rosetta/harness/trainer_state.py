"""The trainer-state file: what an exact resume needs besides the weights (optimizer moments,
step, schedule counters, dropout-generator state), as flat NumPy arrays in one safetensors
file. Framework-free: each `Trainer.state_dict()` (torch_impl/train.py, jax_impl/train.py)
returns the arrays, the harness writes them; the keys are the framework's own. Like a checkpoint,
the file carries the integrity record `sha256` (rosetta/checkpoint.py), checked on load.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from rosetta.checkpoint import read_safetensors, write_safetensors
from rosetta.errors import CheckpointError

FORMAT = "rosetta-trainer-state/1"


def save_trainer_state(path: str | os.PathLike, state: Mapping[str, np.ndarray], framework: str) -> Path:
    """Write `state` atomically (temporary file, fsync, rename), tagged with its framework and
    with the integrity record."""
    tensors = {key: np.array(value, order="C") for key, value in state.items()}  # keeps 0-d arrays 0-d
    path = Path(path)
    write_safetensors(path, tensors, {"format": FORMAT, "framework": framework})
    return path


def load_trainer_state(path: str | os.PathLike, framework: str) -> dict[str, np.ndarray]:
    """Read a trainer-state file written for `framework`; refuse another framework's, and a
    corrupted one (when it carries the integrity record)."""
    path = Path(path)
    metadata, state = read_safetensors(path, "trainer-state")
    if metadata.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {metadata.get('format')!r}, expected {FORMAT!r}")
    if metadata.get("framework") != framework:
        raise CheckpointError(f"{path}: trainer state of framework {metadata.get('framework')!r}, "
                              f"cannot resume it in {framework!r}")
    return state
