"""Checks on token ids and search arguments, shared by every backend so that all refuse the same
input alike, and the parser of token-id text lines that `rosetta generate` and `rosetta translate`
read from stdin.

The rule for numeric arguments (beam size, length margin, alpha): Python and NumPy integers are
integers, NumPy floats are numbers, a bool is neither (`beam_size=True` is a mistake, not 1), and
a number must be finite.
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Any, NamedTuple

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


def check_int(value: object, name: str, minimum: int) -> int:
    """`value` as a Python int if it is an integer (NumPy's included, bool not) >= minimum."""
    # bool subclasses int; np.bool_ is not an Integral, but refuse it by name all the same.
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or value < minimum:
        raise InputError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_real(value: object, name: str, minimum: float) -> float:
    """`value` as a Python float if it is a finite real number (NumPy's included, bool not) >= minimum."""
    if (isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real)
            or not math.isfinite(value) or value < minimum):
        raise InputError(f"{name} must be a number >= {minimum:g} and finite, got {value!r}")
    return float(value)


_TOKEN_ID = re.compile(r"[0-9]+")  # ASCII digits only: int() would also take "1_0" and "٥"
_SEPARATORS = re.compile(r"[ \t\f\v]+")


def parse_id_line(line: str, number: int, vocab_size: int) -> list[int]:
    """The token ids of input line `number` (space-separated, ASCII digits), each checked to lie in
    [0, vocab_size): an InputError naming the line and the token otherwise."""
    ids = []
    for token in _SEPARATORS.split(line.strip(" \t\f\v")):
        if not token:
            continue  # an empty line
        shown = token if len(token) <= 24 else token[:24] + "..."
        if not _TOKEN_ID.fullmatch(token):
            raise InputError(f"input line {number}: {shown!r} is not a token id (ASCII digits 0-9 only)")
        # Compare as text first: a thousand-digit id is out of range, not an int() to compute.
        if len(token.lstrip("0")) > len(str(vocab_size)) or int(token) >= vocab_size:
            raise InputError(f"input line {number}: token id {shown} is outside the source vocabulary "
                             f"[0, {vocab_size})")
        ids.append(int(token))
    return ids


def split_lines(data: bytes | str) -> list[str]:
    """Lines of stdin's contents, split at "\n" only (a trailing "\r" dropped, as universal
    newlines do), bytes decoded as strict UTF-8: bytes that are not UTF-8 are an InputError
    naming the line. A byte-order mark at the start is dropped."""
    newline = b"\n" if isinstance(data, bytes) else "\n"
    lines = data.split(newline)
    if lines and not lines[-1]:
        lines.pop()  # the text ended with a newline: no empty line after it
    out = []
    for number, line in enumerate(lines, 1):
        if isinstance(line, bytes):
            try:
                line = line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputError(f"input line {number} is not valid UTF-8 (byte 0x{line[e.start]:02x} at "
                                 f"byte {e.start + 1} of the line)") from None
        out.append(line.removesuffix("\r"))
    if out:
        out[0] = out[0].removeprefix("\ufeff")
    return out


class Packing(NamedTuple):
    """A packed batch's segment and position arrays (docs/packing.md: several sentence pairs per
    row), the one `packing` argument of every model's `forward`, `encode` and `decode`.

    `src_segments` [B, S], `tgt_segments` [B, T]: the segment id of each token, 1..n within a row
    (a pair's source and target share one), 0 on padding. `src_positions` [B, S],
    `tgt_positions` [B, T]: each token's position, restarting at 0 in every segment. NumPy, torch
    or JAX arrays alike; a NamedTuple is a JAX pytree, so it passes through jit as an argument."""

    src_segments: Any
    tgt_segments: Any
    src_positions: Any
    tgt_positions: Any


def check_packing(src, tgt, packing: Packing | None, check_range: bool = False) -> bool:
    """True for a packed batch (docs/packing.md): a Packing with all four arrays, each shaped like
    its ids. None (or a Packing of four Nones): not packed. Anything else is an InputError.
    `check_range`: also positions in [0, row length) (the NumPy reference; a framework on a
    device would have to wait for it)."""
    if packing is None:
        return False
    if not isinstance(packing, Packing):
        raise InputError(f"packing must be a rosetta.inputs.Packing or None, got {type(packing).__name__}")
    arrays = packing._asdict()
    given = [name for name, a in arrays.items() if a is not None]
    if not given:
        return False
    if len(given) < 4:
        raise InputError(f"packing needs all of src_segments, tgt_segments, src_positions and "
                         f"tgt_positions; got only {', '.join(given)}")
    for name, a in arrays.items():
        ids = src if name.startswith("src") else tgt
        if tuple(a.shape) != tuple(ids.shape):
            raise InputError(f"{name} has shape {tuple(a.shape)}, expected {tuple(ids.shape)} (as the ids)")
        if check_range and name.endswith("positions") and (np.min(a) < 0 or np.max(a) >= ids.shape[1]):
            raise InputError(f"{name} must lie in [0, {ids.shape[1]}): positions restart at 0 per segment")
    return True
