"""The checkpoint file (SPEC §3): one safetensors file, config JSON in its metadata.

Loading is strict: a missing, extra, misshapen, wrongly typed or non-finite tensor, a wrong
format tag, a bad config, or a truncated file is refused with a message that names it.
Saving is atomic: the bytes go to a temporary file beside the target, are fsynced, and only
then renamed over the final name, so a crash never leaves a half-written checkpoint.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy

from rosetta.config import ModelConfig
from rosetta.errors import CheckpointError, ConfigError
from rosetta.params import Params, param_shapes

FORMAT = "rosetta-transformer/1"
# The `dtype` metadata values and the NumPy types that store them (bfloat16 via ml_dtypes).
DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}


@dataclass(frozen=True)
class Checkpoint:
    config: ModelConfig
    params: Params
    dtype: str
    metadata: dict[str, str]


def check_params(cfg: ModelConfig, params: Mapping[str, np.ndarray], source: str = "params") -> None:
    """Refuse parameters that do not match `cfg` exactly: every name, every shape."""
    expected = param_shapes(cfg)
    missing = [name for name in expected if name not in params]
    if missing:
        raise CheckpointError(f"{source}: missing tensor(s) {', '.join(missing)}")
    extra = sorted(name for name in params if name not in expected)
    if extra:
        raise CheckpointError(
            f"{source}: unexpected tensor(s) {', '.join(extra)} (not in the config's layout: "
            f"share_embeddings={cfg.share_embeddings!r}, final_norm={cfg.has_final_norm}, "
            f"attention_bias={cfg.attention_bias}, ffn_bias={cfg.ffn_bias}, "
            f"output_bias={cfg.output_bias})"
        )
    for name, shape in expected.items():
        found = tuple(np.shape(params[name]))
        if found != shape:
            raise CheckpointError(
                f"{source}: tensor {name} has shape {found}, the config expects {shape}"
            )


def save_checkpoint(
    path: str | os.PathLike,
    cfg: ModelConfig,
    params: Mapping[str, np.ndarray],
    dtype: str = "float32",
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write `params` (canonical names, math layout) as `dtype`, atomically."""
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    check_params(cfg, params)
    tensors = {}
    for name in param_shapes(cfg):
        value = np.asarray(params[name])
        if not np.all(np.isfinite(value.astype(np.float64))):
            raise CheckpointError(f"refusing to save: tensor {name} holds NaN or infinity")
        tensors[name] = np.ascontiguousarray(value.astype(DTYPES[dtype]))
    meta = {**(metadata or {}), "format": FORMAT, "config": cfg.to_json(), "dtype": dtype}
    data = safetensors.numpy.save(tensors, metadata=meta)
    path = Path(path)
    atomic_write_bytes(path, data)
    return path


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file in the same directory, fsync, then rename over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def read_safetensors(path: Path, what: str = "checkpoint") -> tuple[dict[str, str], dict[str, np.ndarray]]:
    """(metadata, tensors) of a safetensors file, or a CheckpointError naming the file."""
    if not path.is_file():
        raise CheckpointError(f"{path}: no such {what} file")
    try:
        with safetensors.safe_open(str(path), framework="numpy") as f:
            return dict(f.metadata() or {}), {name: f.get_tensor(name) for name in f.keys()}
    except (safetensors.SafetensorError, OSError, ValueError, TypeError) as e:
        raise CheckpointError(
            f"{path}: not a readable safetensors file (corrupt or truncated?): {e}"
        ) from None


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read and validate a checkpoint; tensors keep their stored dtype."""
    path = Path(path)
    metadata, tensors = read_safetensors(path)
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
    check_params(cfg, tensors, source=str(path))
    for name, value in tensors.items():
        if value.dtype != DTYPES[dtype]:
            raise CheckpointError(
                f"{path}: tensor {name} is stored as {value.dtype}, metadata 'dtype' says {dtype}"
            )
        if not np.all(np.isfinite(value.astype(np.float64))):
            raise CheckpointError(f"{path}: tensor {name} holds NaN or infinity")
    params = {name: tensors[name] for name in param_shapes(cfg)}
    return Checkpoint(cfg, params, dtype, metadata)
