"""The activation dump: one forward pass's stages, as an `.npz` any framework can write.

Keys (docs/diff.md): `src` [B, S] and `tgt` [B, T] integer ids (tgt is the decoder input, start
token first), plus any subset of the stage names of `BackendModel.stages(src, tgt, fine=True)`.
Reading is strict, because a dump usually comes from someone else's model and hook code: a
misspelt stage name, a shape that does not fit the batch, or a NaN would otherwise show up
later as a baffling "difference" (or worse, as none). Every refusal is a CheckpointError
naming the key at fault.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import zipfile
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import numpy as np

from rosetta.backends import BackendModel
from rosetta.config import ModelConfig
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


def _check_ids(name: str, shape: tuple[int, ...], dtype: np.dtype) -> None:
    if len(shape) != 2 or math.prod(shape) == 0:
        raise CheckpointError(f"dump: {name!r} must be a non-empty [B, length] array of token ids, "
                              f"got shape {shape}")
    if not np.issubdtype(dtype, np.integer):
        raise CheckpointError(f"dump: {name!r} must hold integer token ids, got dtype {dtype}")


def _ids(name: str, value: object) -> np.ndarray:
    value = np.asarray(value)
    _check_ids(name, value.shape, value.dtype)
    if (value < 0).any():
        raise CheckpointError(f"dump: {name!r} holds negative token ids")
    return value.astype(np.int64)


def _expected_shape(kind: str, shape: tuple[int, ...], B: int, S: int, T: int) -> tuple | None:
    """The shape a stage of `kind` must have for a batch [B, S] -> [B, T]; free sizes (d, h, V)
    are taken from `shape` and checked for consistency across stages by the caller."""
    if kind in ("enc", "dec", "logits"):
        return (B, S if kind == "enc" else T, shape[-1]) if len(shape) == 3 else None
    if len(shape) != 4:
        return None
    h = shape[1]
    return {"enc_self_w": (B, h, S, S), "dec_self_w": (B, h, T, T), "cross_w": (B, h, T, S)}[kind]


# The config field each free width must equal when the model is known (rosetta diff's model side).
_WIDTH_FIELDS = {"d": "d_model", "V": "tgt_vocab_size", "h": "num_heads"}


def _check_stage(name: str, dtype: np.dtype, shape: tuple[int, ...], src_shape: tuple[int, int],
                 tgt_shape: tuple[int, int], widths: dict, cfg: ModelConfig | None) -> None:
    """Name, dtype and shape of one stage (from an array or from a .npy header alone, before its
    data is read); `widths` collects each free size's first stage across calls. With `cfg`, the
    free sizes and layer indices must be the model's."""
    kind = stage_kind(name)
    if kind is None:
        raise CheckpointError(f"dump: unknown stage name {name!r} (the names are those of "
                              f"BackendModel.stages(src, tgt, fine=True); see docs/diff.md)")
    layer = re.match(_LAYER, name)
    if cfg is not None and layer and int(layer[2]) >= getattr(cfg, f"num_{layer[1]}_layers"):
        raise CheckpointError(f"dump: stage {name!r}: the model has "
                              f"{getattr(cfg, f'num_{layer[1]}_layers')} {layer[1]} layers")
    if not np.issubdtype(dtype, np.floating):
        raise CheckpointError(f"dump: stage {name!r} must be a float array, got dtype {dtype}")
    (B, S), T = src_shape, tgt_shape[1]
    want = _expected_shape(kind, shape, B, S, T)
    if want is None or shape != want:
        axes = {"enc": "[B, S, d]", "dec": "[B, T, d]", "logits": "[B, T, V]",
                "enc_self_w": "[B, h, S, S]", "dec_self_w": "[B, h, T, T]", "cross_w": "[B, h, T, S]"}[kind]
        raise CheckpointError(f"dump: stage {name!r} has shape {shape}; with src {src_shape} "
                              f"and tgt {tgt_shape} it must be {axes}")
    # d_model is one number across every hidden stage, the head count one across weights.
    width_kind = "V" if kind == "logits" else ("d" if kind in ("enc", "dec") else "h")
    width = shape[-1] if width_kind != "h" else shape[1]
    if cfg is not None and width != getattr(cfg, _WIDTH_FIELDS[width_kind]):
        field = _WIDTH_FIELDS[width_kind]
        raise CheckpointError(f"dump: stage {name!r} has {field} {width}, the model has "
                              f"{getattr(cfg, field)}")
    first = widths.setdefault(width_kind, (name, width))
    if first[1] != width:
        raise CheckpointError(f"dump: stage {name!r} has {width_kind} = {width} but stage "
                              f"{first[0]!r} has {first[1]}: the stages disagree with each other")


def check_stages(src: np.ndarray, tgt: np.ndarray, stages: Mapping[str, object],
                 cfg: ModelConfig | None = None) -> dict[str, np.ndarray]:
    """The stages as float arrays, after checking each name, shape and value (CheckpointError);
    with `cfg`, against that model's widths and layer counts too."""
    if tgt.shape[0] != src.shape[0]:
        raise CheckpointError(f"dump: 'src' has {src.shape[0]} rows but 'tgt' has {tgt.shape[0]}")
    out, widths = {}, {}
    for name, value in stages.items():
        value = np.asarray(value)
        _check_stage(name, value.dtype, value.shape, src.shape, tgt.shape, widths, cfg)
        if not np.isfinite(value).all():
            raise CheckpointError(f"dump: stage {name!r} holds NaN or infinity")
        out[name] = value
    return dict(sorted(out.items(), key=lambda item: stage_order(item[0])))


def dump_model(model: BackendModel, path: str | os.PathLike, src: object, tgt: object,
               fine: bool = True) -> Path:
    """Write a backend model's stages of (src, tgt) as a dump, fine ones by default (docs/diff.md);
    returns its path. The model's own input checks come first (BackendModel.stages)."""
    return write_dump(path, src, tgt, model.stages(src, tgt, fine=fine))


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


# Reading a member allocates what its .npy header claims. Every claim is checked before any
# data is read: the header's size must be exactly the member's uncompressed size (ZipInfo), and
# the shape what the stage must be for the batch (and the model, when known). A member may still
# claim a large size honestly by compressing well: deflate reaches ~1000:1 on zeros, so a 4 MB
# file can unpack to 4 GB. Real activations are noisy floats that compress little (np.savez does
# not compress at all), so an .npz that unpacks to more than this many times its size on disk,
# past a floor any small model's dump stays under, is refused as a compression bomb.
MAX_EXPANSION = 50
EXPANSION_FLOOR = 256 * 2**20  # bytes


class _Member(NamedTuple):
    info: zipfile.ZipInfo
    shape: tuple[int, ...]
    dtype: np.dtype


def _npy_header(path: Path, archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> _Member:
    """Shape and dtype of one member from its .npy header alone (numpy.lib.format), after
    checking that they account for the member's uncompressed size exactly."""
    where = f"{path}: member {info.filename!r}"
    fmt = np.lib.format
    try:
        with archive.open(info) as fp:
            version = fmt.read_magic(fp)
            if version not in ((1, 0), (2, 0)):
                raise ValueError(f".npy format version {version[0]}.{version[1]}, not 1.0 or 2.0")
            read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
            shape, _, dtype = read(fp)
            header_size = fp.tell()
    except (ValueError, EOFError, OSError, zipfile.BadZipFile, zlib.error, NotImplementedError) as e:
        raise CheckpointError(f"{where}: not a readable .npy array ({e})") from None
    if dtype.hasobject:  # numpy would need a pickle: a dump may come from anywhere
        raise CheckpointError(f"{where}: holds Python objects ({dtype}); only numeric arrays are read")
    claimed = math.prod(shape) * dtype.itemsize  # Python ints: 10^10 floats do not overflow
    if header_size + claimed != info.file_size:
        raise CheckpointError(f"{where}: its header claims shape {shape} of {dtype} ({claimed:,} bytes) "
                              f"but the member holds {info.file_size - header_size:,} bytes of data")
    return _Member(info, shape, dtype)


def _members(path: Path, archive: zipfile.ZipFile) -> dict[str, _Member]:
    """Array name -> its member's header, every claim checked; no array data is read."""
    members: dict[str, _Member] = {}
    for info in archive.infolist():
        key = info.filename.removesuffix(".npy")
        if key == info.filename or info.is_dir():
            raise CheckpointError(f"{path}: member {info.filename!r} is not a .npy array "
                                  f"(np.savez names each array NAME.npy)")
        if key in members:
            raise CheckpointError(f"{path}: member {info.filename!r} appears twice")
        members[key] = _npy_header(path, archive, info)
    return members


def _check_expansion(path: Path, members: Mapping[str, _Member]) -> None:
    """Refuse an .npz that unpacks to far more than its size on disk (see MAX_EXPANSION)."""
    unpacked = sum(m.info.file_size for m in members.values())
    on_disk = path.stat().st_size
    if unpacked > max(EXPANSION_FLOOR, MAX_EXPANSION * on_disk):
        worst = max(members.values(), key=lambda m: m.info.file_size / max(m.info.compress_size, 1))
        raise CheckpointError(f"{path}: member {worst.info.filename!r} unpacks to {worst.info.file_size:,} "
                              f"bytes from {worst.info.compress_size:,}; the .npz unpacks to "
                              f"{unpacked:,} bytes, more than {MAX_EXPANSION} times its {on_disk:,} on disk "
                              f"(a compression bomb, not activations)")


def _read_member(path: Path, archive: zipfile.ZipFile, member: _Member) -> np.ndarray:
    try:
        with archive.open(member.info) as fp:
            value = np.lib.format.read_array(fp, allow_pickle=False)
    except (ValueError, EOFError, OSError, zipfile.BadZipFile, zlib.error) as e:
        raise CheckpointError(f"{path}: member {member.info.filename!r}: not a readable .npy array "
                              f"({e})") from None
    if value.shape != member.shape or value.dtype != member.dtype:
        raise CheckpointError(f"{path}: the file changed while it was being read")
    return value


def read_dump(path: str | os.PathLike, cfg: ModelConfig | None = None) -> Dump:
    """Read and check a dump (CheckpointError naming the problem). With `cfg` (the model it is
    compared with), stage widths and layer indices must be that model's. Every member's header
    is checked against the batch (src, tgt) and the stage it names before its data is read, so a
    file cannot make the reader allocate more than the dump it claims to be. Pickled objects are
    refused: a dump may come from anywhere."""
    path = Path(path)
    if path.exists() and not path.is_file():  # a folder, a FIFO (opening one would block): never opened
        kind = "a directory" if path.is_dir() else "not a regular file"
        raise CheckpointError(f"{path}: {kind}, not an .npz dump file")
    try:
        with zipfile.ZipFile(path) as archive:
            return _read_checked(path, archive, cfg)
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such dump file") from None
    except (OSError, zipfile.BadZipFile, ValueError) as e:
        reason = str(e)
        with contextlib.suppress(OSError), open(path, "rb") as f:
            if f.read(6) == b"\x93NUMPY":  # a lone .npy array under an .npz name
                reason = "a single array, not a zip of named arrays"
        raise CheckpointError(f"{path}: not a readable .npz dump ({reason})") from None


def _read_checked(path: Path, archive: zipfile.ZipFile, cfg: ModelConfig | None) -> Dump:
    members = _members(path, archive)
    for key in ("src", "tgt"):
        if key not in members:
            raise CheckpointError(f"{path}: the dump has no {key!r} array (token ids [B, length]); "
                                  f"every dump must hold the batch it was computed on")
    ids = {key: members.pop(key) for key in ("src", "tgt")}
    src_shape, tgt_shape = ids["src"].shape, ids["tgt"].shape
    try:
        # Every header first: the ids' (2-D integer, within the model's max_len), then each
        # stage's against the batch they declare; only then is any data read.
        for key, member in ids.items():
            _check_ids(key, member.shape, member.dtype)
            if cfg is not None and member.shape[1] > cfg.max_len:
                raise CheckpointError(f"dump: {key!r} has shape {member.shape}: {member.shape[1]} "
                                      f"positions, more than the model's max_len {cfg.max_len}")
        if tgt_shape[0] != src_shape[0]:
            raise CheckpointError(f"dump: 'src' has {src_shape[0]} rows but 'tgt' has {tgt_shape[0]}")
        widths: dict = {}
        for name, member in members.items():
            _check_stage(name, member.dtype, member.shape, src_shape, tgt_shape, widths, cfg)
        _check_expansion(path, {**ids, **members})
        src, tgt = (_ids(key, _read_member(path, archive, member)) for key, member in ids.items())
        arrays = {name: _read_member(path, archive, member) for name, member in members.items()}
        return Dump(src, tgt, check_stages(src, tgt, arrays, cfg))
    except CheckpointError as e:
        if str(e).startswith(str(path)):
            raise
        raise CheckpointError(f"{path}: {e}") from None
