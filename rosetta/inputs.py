"""Checks on token ids, shared by every backend so that all refuse the same input alike."""

from __future__ import annotations

import numpy as np

from rosetta.config import ModelConfig
from rosetta.errors import InputError


def check_ids(ids: object, vocab_size: int, max_len: int, name: str) -> np.ndarray:
    """`ids` as an int64 array `[batch, length]`, or an InputError naming the problem."""
    if hasattr(ids, "detach") or type(ids).__module__.startswith(("jax", "jaxlib")):
        ids = np.asarray(ids.detach().cpu() if hasattr(ids, "detach") else ids)
    try:
        arr = np.asarray(ids)
    except ValueError:  # ragged nested lists
        arr = np.empty(0, dtype=object)
    if arr.dtype == object:
        raise InputError(f"{name} must be a rectangular array of integer token ids")
    if arr.dtype.kind not in "iu":
        raise InputError(f"{name} must hold integer token ids, got dtype {arr.dtype}")
    if arr.ndim != 2:
        raise InputError(f"{name} must have shape [batch, length], got shape {arr.shape}")
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise InputError(f"{name} is empty (shape {arr.shape}); give at least one token")
    if arr.shape[1] > max_len:
        raise InputError(
            f"{name} has length {arr.shape[1]}, longer than max_len {max_len} "
            "(longer input is an error, never silently cut)"
        )
    low, high = int(arr.min()), int(arr.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise InputError(f"{name} holds token id {bad}, outside the vocabulary [0, {vocab_size})")
    return arr.astype(np.int64)


def check_src(cfg: ModelConfig, src: object) -> np.ndarray:
    return check_ids(src, cfg.src_vocab_size, cfg.max_len, "src")


def check_tgt(cfg: ModelConfig, tgt: object, batch: int | None = None) -> np.ndarray:
    tgt = check_ids(tgt, cfg.tgt_vocab_size, cfg.max_len, "tgt")
    if batch is not None and tgt.shape[0] != batch:
        raise InputError(f"src has batch size {batch} but tgt has {tgt.shape[0]}")
    return tgt
