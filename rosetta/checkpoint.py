"""The checkpoint file (SPEC §3): one safetensors file, config JSON in its metadata.

Loading treats the file as untrusted and is strict. The header is parsed here, not by the
safetensors library, and checked before a single tensor is read: header length within the
file, known tensor types, offsets that tile the data section exactly, a bounded config, and
names, shapes and types that match that config. Only then are the tensors read (and, when the
file carries the integrity record `sha256`, hashed), so no file makes the reader allocate much
more than the file's own size. Whatever is wrong is refused with a message that names it.

Saving is atomic (rosetta/files.py): the bytes go to a temporary file beside the target, are
fsynced, and only then renamed over the final name, so a crash never leaves a half-written
checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import ml_dtypes
import numpy as np
import safetensors

from rosetta.config import ModelConfig, strict_json_loads
from rosetta.errors import CheckpointError, ConfigError
from rosetta.files import atomic_write
from rosetta.params import Params, checkpoint_size, param_shapes

FORMAT = "rosetta-transformer/1"
# The `dtype` metadata values and the NumPy types that store them (bfloat16 via ml_dtypes).
DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}
# The integrity record (SPEC §3 allows extra metadata keys): the hex SHA-256 of the data
# section, the bytes after the header exactly as stored. Written on save, checked on load.
INTEGRITY_KEY = "sha256"

# The safetensors tensor types rosetta reads, as NumPy types (checkpoints use the three
# float ones, trainer-state files any). Others (F8_E5M2, F4, ...) are refused by name.
SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    code: np.dtype(t) for code, t in [
        ("BOOL", np.bool_), ("U8", np.uint8), ("I8", np.int8), ("U16", np.uint16),
        ("I16", np.int16), ("U32", np.uint32), ("I32", np.int32), ("U64", np.uint64),
        ("I64", np.int64), ("F16", np.float16), ("BF16", ml_dtypes.bfloat16),
        ("F32", np.float32), ("F64", np.float64),
    ]
}
_DTYPE_CODES = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}
# The safetensors library's own cap on the JSON header; rosetta's headers need about 150 bytes
# per tensor plus the config, a few hundred kilobytes for the largest model LIMITS admits.
MAX_HEADER_BYTES = 100_000_000
# Checkpoint tensors are 1-D or 2-D, trainer-state arrays at most 2-D; a long shape list is
# garbage, and bounding it bounds the work of multiplying it out.
MAX_NDIM = 8
# A refusal lists at most this many tensor names; the count says how many more there are.
MAX_NAMES_SHOWN = 8


@dataclass(frozen=True)
class Checkpoint:
    config: ModelConfig
    params: Params
    dtype: str
    metadata: dict[str, str]


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a safetensors header declares it; offsets count from the data section."""

    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    """A validated safetensors header: `tensors` in file order tile the data section exactly."""

    metadata: dict[str, str]
    tensors: dict[str, TensorInfo]
    data_size: int


# -- checking tensors against a config ----------------------------------------------------------

def _names(names: Iterable[str]) -> str:
    names = list(names)
    shown = ", ".join(names[:MAX_NAMES_SHOWN])
    more = len(names) - MAX_NAMES_SHOWN
    return f"{shown} and {more:,} more" if more > 0 else shown


def check_shapes(cfg: ModelConfig, shapes: Mapping[str, tuple[int, ...]], source: str = "params") -> None:
    """Refuse tensors that do not match `cfg` exactly: every name, every shape."""
    expected = param_shapes(cfg)
    missing = [name for name in expected if name not in shapes]
    if missing:
        raise CheckpointError(f"{source}: missing tensor(s) {_names(missing)}")
    extra = sorted(name for name in shapes if name not in expected)
    if extra:
        raise CheckpointError(
            f"{source}: unexpected tensor(s) {_names(extra)} (not in the config's layout: "
            f"share_embeddings={cfg.share_embeddings!r}, final_norm={cfg.has_final_norm}, "
            f"attention_bias={cfg.attention_bias}, ffn_bias={cfg.ffn_bias}, "
            f"output_bias={cfg.output_bias})"
        )
    for name, shape in expected.items():
        found = tuple(shapes[name])
        if found != shape:
            raise CheckpointError(
                f"{source}: tensor {name} has shape {found}, the config expects {shape}"
            )


def check_params(cfg: ModelConfig, params: Mapping[str, np.ndarray], source: str = "params") -> None:
    """Refuse parameters that do not match `cfg` exactly: every name, every shape."""
    check_shapes(cfg, {name: np.shape(value) for name, value in params.items()}, source)


# -- writing ------------------------------------------------------------------------------------

def save_checkpoint(
    path: str | os.PathLike,
    cfg: ModelConfig,
    params: Mapping[str, np.ndarray],
    dtype: str = "float32",
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write `params` (canonical names, math layout) as `dtype`, atomically, with the
    integrity record."""
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    check_params(cfg, params)
    tensors = {}
    for name in param_shapes(cfg):
        value = np.asarray(params[name])
        if not np.all(np.isfinite(value)):
            raise CheckpointError(f"refusing to save: tensor {name} holds NaN or infinity")
        tensors[name] = np.ascontiguousarray(value.astype(DTYPES[dtype]))
    meta = {**(metadata or {}), "format": FORMAT, "config": cfg.to_json(), "dtype": dtype}
    path = Path(path)
    write_safetensors(path, tensors, meta)
    return path


def _raw(value: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous array as a flat uint8 view (no copy). safetensors is
    little-endian, as is every platform PyTorch and JAX ship for."""
    return value.reshape(-1).view(np.uint8)


def write_safetensors(path: Path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> None:
    """Write a safetensors file atomically, tensors in the given order, with the integrity
    record `sha256` added to `metadata`. Written here rather than by the safetensors library
    because the digest, which goes in the header, must be known before the header is written;
    nothing is copied: the tensors are hashed, then written, straight from their memory."""
    arrays = {name: np.asarray(value, order="C") for name, value in tensors.items()}  # 0-d stays 0-d
    unknown = [f"{name} ({a.dtype})" for name, a in arrays.items() if a.dtype not in _DTYPE_CODES]
    if unknown:
        raise CheckpointError(f"cannot store tensor(s) of these types: {_names(unknown)}")
    not_text = [key for key, value in metadata.items() if not isinstance(value, str)]
    if not_text:  # safetensors metadata maps names to strings; readers refuse anything else
        raise CheckpointError(f"metadata values must be strings: {', '.join(map(str, not_text))}")
    digest = hashlib.sha256()
    for value in arrays.values():
        digest.update(_raw(value))
    header: dict[str, object] = {"__metadata__": {**metadata, INTEGRITY_KEY: digest.hexdigest()}}
    offset = 0
    for name, value in arrays.items():
        header[name] = {"dtype": _DTYPE_CODES[value.dtype], "shape": list(value.shape),
                        "data_offsets": [offset, offset + value.nbytes]}
        offset += value.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # pad as the safetensors library does: data starts 8-aligned

    def write(f: BinaryIO) -> None:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for value in arrays.values():
            f.write(_raw(value))

    atomic_write(path, write)


# -- reading ------------------------------------------------------------------------------------

def _corrupt(path: Path, detail: str) -> CheckpointError:
    return CheckpointError(f"{path}: not a valid safetensors file (corrupt or truncated?): {detail}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _nbytes(shape: tuple[int, ...], itemsize: int, limit: int) -> int:
    """Bytes of a tensor; stops multiplying past `limit` (any larger value is as wrong)."""
    if 0 in shape:
        return 0
    size = itemsize
    for dim in shape:
        size *= dim
        if size > limit:
            return size
    return size


def _tensor_info(path: Path, name: str, entry: object, data_size: int) -> TensorInfo:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise _corrupt(path, f"tensor {name}: header entry must hold exactly dtype, shape and "
                             f"data_offsets")
    code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(code, str) or code not in SAFETENSORS_DTYPES:
        raise CheckpointError(f"{path}: tensor {name} has dtype {code!r}, which rosetta does not "
                              f"read (known: {', '.join(SAFETENSORS_DTYPES)})")
    if (not isinstance(shape, list) or len(shape) > MAX_NDIM
            or not all(_is_int(d) and d >= 0 for d in shape)):
        raise _corrupt(path, f"tensor {name}: shape {shape!r} is not a list of at most {MAX_NDIM} "
                             f"non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))
            and 0 <= offsets[0] <= offsets[1]):
        raise _corrupt(path, f"tensor {name}: data_offsets {offsets!r} are not [begin, end] with "
                             f"0 <= begin <= end")
    begin, end = offsets
    if end > data_size:
        raise _corrupt(path, f"tensor {name} ends at byte {end:,} of the data, but the file holds "
                             f"only {data_size:,} bytes of data")
    dtype = SAFETENSORS_DTYPES[code]
    nbytes = _nbytes(tuple(shape), dtype.itemsize, data_size)
    if nbytes != end - begin:
        raise _corrupt(path, f"tensor {name}: shape {shape} of {code} needs {nbytes:,} bytes, its "
                             f"data_offsets span {end - begin:,}")
    return TensorInfo(dtype, tuple(shape), begin, end)


def _check_tiling(path: Path, tensors: dict[str, TensorInfo], data_size: int) -> None:
    """The tensors, in offset order, must cover the data section without gap or overlap."""
    position = 0
    for name, info in tensors.items():
        if info.begin != position:
            what = "overlaps the tensor before it" if info.begin < position else "leaves a gap"
            raise _corrupt(path, f"tensor {name} starts at byte {info.begin:,} of the data and "
                                 f"{what} (expected {position:,})")
        position = info.end
    if position != data_size:
        raise _corrupt(path, f"the tensors cover {position:,} bytes of data, the file holds "
                             f"{data_size:,}")


def _parse_header(path: Path, raw: bytes, data_size: int) -> Header:
    try:
        obj = strict_json_loads(raw.decode("utf-8"))
    except ValueError as e:  # also UnicodeDecodeError
        raise _corrupt(path, f"header is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise _corrupt(path, f"header is a JSON {type(obj).__name__}, not an object")
    metadata = obj.pop("__metadata__", {})
    if not (isinstance(metadata, dict)
            and all(isinstance(v, str) for v in metadata.values())):
        raise _corrupt(path, "__metadata__ must map names to strings")
    tensors = {name: _tensor_info(path, name, entry, data_size) for name, entry in obj.items()}
    tensors = dict(sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)))
    _check_tiling(path, tensors, data_size)
    return Header(metadata, tensors, data_size)


def read_header(path: Path, what: str = "checkpoint") -> Header:
    """Parse and validate the header of a safetensors file without reading its tensors. The
    header length is checked against the file size before the header is read."""
    if not path.is_file():
        raise CheckpointError(f"{path}: no such {what} file")
    try:
        with open(path, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            if file_size < 8:
                raise _corrupt(path, f"{file_size} bytes, shorter than the 8-byte header length")
            length = int.from_bytes(f.read(8), "little")
            if not 2 <= length <= min(MAX_HEADER_BYTES, file_size - 8):
                raise _corrupt(path, f"header length {length:,} does not fit the file "
                                     f"({file_size:,} bytes; at most {MAX_HEADER_BYTES:,})")
            raw = f.read(length)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the {what} file: {e.strerror or e}") from None
    if len(raw) != length:
        raise _corrupt(path, "the file shrank while its header was read")
    return _parse_header(path, raw, file_size - 8 - length)


def _integrity_record(path: Path, header: Header) -> str | None:
    """The file's SHA-256 record in lower case, None without one; refused if malformed."""
    record = header.metadata.get(INTEGRITY_KEY)
    if record is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", record):
        raise CheckpointError(f"{path}: metadata '{INTEGRITY_KEY}' is not a SHA-256 hex digest")
    return None if record is None else record.lower()


def has_integrity_record(path: str | os.PathLike) -> bool:
    """Whether the file carries the integrity record (its header only; a malformed record is
    refused). `load_checkpoint` verifies a record it finds; without one nothing is verified."""
    path = Path(path)
    return _integrity_record(path, read_header(path)) is not None


def read_tensors(path: Path, header: Header) -> dict[str, np.ndarray]:
    """Every tensor `header` declares, in file order, read through safetensors (after the
    header has been validated, so every read is bounded by the file). With an integrity
    record, the bytes are hashed as the tensors arrive; in file order they are exactly the data
    section, so nothing is read twice or copied."""
    record = _integrity_record(path, header)
    digest = None if record is None else hashlib.sha256()
    changed = CheckpointError(f"{path}: the file changed while it was being read")
    tensors = {}
    try:
        with safetensors.safe_open(str(path), framework="numpy") as f:
            if dict(f.metadata() or {}) != header.metadata or set(f.keys()) != set(header.tensors):
                raise changed
            for name, info in header.tensors.items():
                value = f.get_tensor(name)
                if value.dtype != info.dtype or value.shape != info.shape:
                    raise changed
                if digest is not None:
                    digest.update(_raw(np.asarray(value, order="C")))
                tensors[name] = value
    except CheckpointError:
        raise
    except (safetensors.SafetensorError, OSError, ValueError, TypeError, AttributeError) as e:
        # Not expected after the header checks; a file replaced in place between them could.
        raise _corrupt(path, str(e)) from None
    if digest is not None and digest.hexdigest() != record:
        raise CheckpointError(
            f"{path}: corrupted: the tensor data's SHA-256 is {digest.hexdigest()[:16]}..., the "
            f"file's integrity record says {record[:16]}..."
        )
    return tensors


def read_safetensors(path: Path, what: str = "checkpoint") -> tuple[dict[str, str], dict[str, np.ndarray]]:
    """(metadata, tensors) of a safetensors file, or a CheckpointError naming the file."""
    header = read_header(path, what)
    return header.metadata, read_tensors(path, header)


def _checkpoint_config(path: Path, metadata: Mapping[str, str]) -> tuple[ModelConfig, str]:
    if metadata.get("format") != FORMAT:
        raise CheckpointError(
            f"{path}: metadata 'format' is {metadata.get('format')!r}, expected {FORMAT!r}"
        )
    if "config" not in metadata:
        raise CheckpointError(f"{path}: metadata has no 'config'")
    try:
        cfg = ModelConfig.from_json(metadata["config"])
    except ConfigError as e:
        raise CheckpointError(f"{path}: bad config in metadata: {e}") from None
    dtype = metadata.get("dtype", "float32")
    if dtype not in DTYPES:
        raise CheckpointError(f"{path}: metadata 'dtype' {dtype!r} is not one of {', '.join(DTYPES)}")
    return cfg, dtype


def _check_header_against_config(path: Path, header: Header, cfg: ModelConfig, dtype: str) -> None:
    """Names, shapes and types, from the header alone. The tensor count the config needs is
    computed by arithmetic first; the names are enumerated only when it matches the header's
    count (which the file's size bounds) or to name what is missing (LIMITS bounds the config).
    With every name, shape and type right, the data size is right too: the header tiles it."""
    shapes = {name: info.shape for name, info in header.tensors.items()}
    if len(shapes) != checkpoint_size(cfg).tensors:
        check_shapes(cfg, shapes, str(path))  # names what is missing or extra
    for name, info in header.tensors.items():
        if info.dtype != DTYPES[dtype]:
            raise CheckpointError(
                f"{path}: tensor {name} is stored as {info.dtype}, metadata 'dtype' says {dtype}"
            )
    check_shapes(cfg, shapes, str(path))


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read and validate a checkpoint; tensors keep their stored dtype."""
    path = Path(path)
    header = read_header(path)
    cfg, dtype = _checkpoint_config(path, header.metadata)
    _check_header_against_config(path, header, cfg, dtype)
    tensors = read_tensors(path, header)
    params = {name: tensors[name] for name in param_shapes(cfg)}  # checkpoint order
    for name, value in params.items():
        if not np.all(np.isfinite(value)):
            raise CheckpointError(f"{path}: tensor {name} holds NaN or infinity")
    return Checkpoint(cfg, params, dtype, header.metadata)
