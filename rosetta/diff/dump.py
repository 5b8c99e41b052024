"""The activation dump: one forward pass's stages, as an `.npz` any framework can write.

Keys (docs/diff.md): `src` [B, S] and `tgt` [B, T] integer ids (tgt is the decoder input, start
token first), plus any subset of the stage names of `BackendModel.stages(src, tgt, fine=True)`.
Reading is strict, because a dump usually comes from someone else's model and hook code: a
misspelt stage name, a shape that does not fit the batch, or a NaN would otherwise show up
later as a baffling "difference" (or worse, as none). Every refusal is a CheckpointError
naming the key at fault.
"""

from __future__ import annotations

import os
import re
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import numpy as np

from rosetta.errors import CheckpointError

# Stage name -> (pattern, kind). Kinds say which axes the shape must have (see _expected_shape).
_LAYER = r"(encoder|decoder)\.layers\.(\d+)"
STAGE_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"src_embed", "enc"),
    (r"tgt_embed", "dec"),
    (r"encoder", "enc"),
    (r"decoder", "dec"),
    (r"logits", "logits"),
    (r"encoder\.layers\.\d+", "enc"),
    (r"decoder\.layers\.\d+", "dec"),
    (r"encoder\.layers\.\d+\.(self_attn|ffn)", "enc"),
    (r"encoder\.layers\.\d+\.self_attn\.weights", "enc_self_w"),
    (r"decoder\.layers\.\d+\.(self_attn|cross_attn|ffn)", "dec"),
    (r"decoder\.layers\.\d+\.self_attn\.weights", "dec_self_w"),
    (r"decoder\.layers\.\d+\.cross_attn\.weights", "cross_w"),
)


class Dump(NamedTuple):
    src: np.ndarray  # [B, S] int64
    tgt: np.ndarray  # [B, T] int64
    stages: dict[str, np.ndarray]


def stage_kind(name: str) -> str | None:
    """The kind of a stage name ("enc", "dec", "logits", "enc_self_w", "dec_self_w",
    "cross_w"), None when the name is not a stage."""
    for pattern, kind in STAGE_PATTERNS:
        if re.fullmatch(pattern, name):
            return kind
    return None


def stage_order(name: str) -> tuple:
    """A sort key putting stages in forward order: encoder before decoder, layer by layer,
    within a layer its sublayers in the order they run, logits last."""
    if name == "src_embed":
        return (0,)
    if name == "tgt_embed":
        return (2,)
    if name == "encoder":
        return (1, 10**9)
    if name == "decoder":
        return (3, 10**9)
    if name == "logits":
        return (4,)
    m = re.match(_LAYER + r"(.*)$", name)
    if m is None:
        return (5, name)
    within = ("self_attn.weights", "self_attn", "cross_attn.weights", "cross_attn", "ffn", "")
    rest = m.group(3).lstrip(".")
    part = 3 if m.group(1) == "decoder" else 1
    return (part, int(m.group(2)), within.index(rest) if rest in within else len(within))


def _ids(name: str, value: object) -> np.ndarray:
    value = np.asarray(value)
    if value.ndim != 2 or value.size == 0:
        raise CheckpointError(f"dump: {name!r} must be a non-empty [B, length] array of token ids, "
                              f"got shape {value.shape}")
    if not np.issubdtype(value.dtype, np.integer):
        raise CheckpointError(f"dump: {name!r} must hold integer token ids, got dtype {value.dtype}")
    if (value < 0).any():
        raise CheckpointError(f"dump: {name!r} holds negative token ids")
    return value.astype(np.int64)


def _expected_shape(kind: str, value: np.ndarray, B: int, S: int, T: int) -> tuple | None:
    """The shape a stage of `kind` must have for a batch [B, S] -> [B, T]; free sizes (d, h, V)
    are taken from `value` and checked for consistency across stages by the caller."""
    if kind in ("enc", "dec", "logits"):
        return (B, S if kind == "enc" else T, value.shape[-1]) if value.ndim == 3 else None
    if value.ndim != 4:
        return None
    h = value.shape[1]
    return {"enc_self_w": (B, h, S, S), "dec_self_w": (B, h, T, T), "cross_w": (B, h, T, S)}[kind]


def check_stages(src: np.ndarray, tgt: np.ndarray, stages: Mapping[str, object]) -> dict[str, np.ndarray]:
    """The stages as float arrays, after checking each name, shape and value (CheckpointError)."""
    (B, S), T = src.shape, tgt.shape[1]
    if tgt.shape[0] != B:
        raise CheckpointError(f"dump: 'src' has {B} rows but 'tgt' has {tgt.shape[0]}")
    out, widths = {}, {}
    for name, value in stages.items():
        kind = stage_kind(name)
        if kind is None:
            raise CheckpointError(f"dump: unknown stage name {name!r} (the names are those of "
                                  f"BackendModel.stages(src, tgt, fine=True); see docs/diff.md)")
        value = np.asarray(value)
        if not np.issubdtype(value.dtype, np.floating):
            raise CheckpointError(f"dump: stage {name!r} must be a float array, got dtype {value.dtype}")
        want = _expected_shape(kind, value, B, S, T)
        if want is None or value.shape != want:
            axes = {"enc": "[B, S, d]", "dec": "[B, T, d]", "logits": "[B, T, V]",
                    "enc_self_w": "[B, h, S, S]", "dec_self_w": "[B, h, T, T]",
                    "cross_w": "[B, h, T, S]"}[kind]
            raise CheckpointError(f"dump: stage {name!r} has shape {value.shape}; with src {src.shape} "
                                  f"and tgt {tgt.shape} it must be {axes}")
        # d_model is one number across every hidden stage, the head count one across weights.
        width_kind = "V" if kind == "logits" else ("d" if kind in ("enc", "dec") else "h")
        width = value.shape[-1] if width_kind != "h" else value.shape[1]
        first = widths.setdefault(width_kind, (name, width))
        if first[1] != width:
            raise CheckpointError(f"dump: stage {name!r} has {width_kind} = {width} but stage "
                                  f"{first[0]!r} has {first[1]}: the stages disagree with each other")
        if not np.isfinite(value).all():
            raise CheckpointError(f"dump: stage {name!r} holds NaN or infinity")
        out[name] = value
    return dict(sorted(out.items(), key=lambda item: stage_order(item[0])))


def write_dump(path: str | os.PathLike, src: object, tgt: object,
               stages: Mapping[str, object]) -> Path:
    """Check and write a dump; returns its path (np.savez adds `.npz` when missing)."""
    src, tgt = _ids("src", src), _ids("tgt", tgt)
    checked = check_stages(src, tgt, {k: np.asarray(v) for k, v in stages.items()})
    path = Path(path)
    if path.suffix != ".npz":
        path = path.with_name(path.name + ".npz")
    try:
        np.savez(path, src=src, tgt=tgt, **checked)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot write the dump ({e.strerror or e})") from None
    return path


def read_dump(path: str | os.PathLike) -> Dump:
    """Read and check a dump (CheckpointError naming the problem). Pickled objects are refused:
    a dump may come from anywhere."""
    path = Path(path)
    try:
        data = np.load(path, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):  # a lone .npy array under an .npz name
            raise ValueError("a single array, not a zip of named arrays")
        with data:
            arrays = {key: data[key] for key in data.files}
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such dump file") from None
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise CheckpointError(f"{path}: not a readable .npz dump ({e})") from None
    for key in ("src", "tgt"):
        if key not in arrays:
            raise CheckpointError(f"{path}: the dump has no {key!r} array (token ids [B, length]); "
                                  f"every dump must hold the batch it was computed on")
    src, tgt = _ids("src", arrays.pop("src")), _ids("tgt", arrays.pop("tgt"))
    try:
        return Dump(src, tgt, check_stages(src, tgt, arrays))
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
