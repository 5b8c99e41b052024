"""flax.serialization's msgpack format, in NumPy and msgpack only (no jax, no flax).

`encode_tree` writes the bytes `flax.serialization.msgpack_serialize` writes for a tree of dicts
and NumPy arrays; `decode_tree` reads what `msgpack_restore` reads, refusing hostile input (a
declared shape larger than its bytes, unknown dtypes, duplicate keys, deep nesting) with a
CheckpointError before anything is allocated. Used by rosetta/interop/flax_wmt.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import ml_dtypes
import msgpack
import numpy as np

from rosetta.errors import CheckpointError

# flax.serialization's msgpack extension codes (_MsgpackExtType) and its chunking of huge leaves.
EXT_NDARRAY, EXT_COMPLEX, EXT_NPSCALAR = 1, 2, 3
MAX_CHUNK_SIZE = 2**30  # flax.serialization.MAX_CHUNK_SIZE: arrays above it are stored in chunks
CHUNKED = "__msgpack_chunked_array__"
# The dtype names an ndarray extension may carry (flax writes `arr.dtype.name`); parameters must be
# one of FLOAT_DTYPES. Any other name is refused before NumPy sees it.
DTYPES: dict[str, np.dtype] = {
    name: np.dtype(t) for name, t in [
        ("bool", np.bool_), ("int8", np.int8), ("int16", np.int16), ("int32", np.int32),
        ("int64", np.int64), ("uint8", np.uint8), ("uint16", np.uint16), ("uint32", np.uint32),
        ("uint64", np.uint64), ("float16", np.float16), ("bfloat16", ml_dtypes.bfloat16),
        ("float32", np.float32), ("float64", np.float64), ("complex64", np.complex64),
        ("complex128", np.complex128),
    ]
}
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
MAX_NDIM = 32
# A params tree nests about 6 maps deep (params/decoder/encoderdecoderblock_0/MHA_0/query/kernel), a
# TrainState's optimizer state a few more; anything deeper is not a model and would only exhaust
# Python's recursion limit.
MAX_DEPTH = 64


def _ndarray_ext(arr: np.ndarray) -> msgpack.ExtType:
    # flax.serialization._ndarray_to_bytes: msgpack of (shape, dtype name, C-order bytes).
    payload = msgpack.packb((arr.shape, arr.dtype.name, arr.tobytes("C")), use_bin_type=True)
    return msgpack.ExtType(EXT_NDARRAY, payload)


def _encode_leaf(value: Any) -> Any:
    if isinstance(value, Mapping):
        # msgpack_serialize rebuilds the tree with jax.tree_util, which orders dict keys sorted.
        return {str(k): _encode_leaf(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, np.ndarray):
        if value.size * value.dtype.itemsize > MAX_CHUNK_SIZE:  # flax.serialization._chunk
            per_chunk = max(1, int(MAX_CHUNK_SIZE / value.dtype.itemsize))
            flat = value.reshape(-1)
            chunks = [flat[i:i + per_chunk] for i in range(0, flat.size, per_chunk)]
            return {CHUNKED: True, "shape": {str(i): int(n) for i, n in enumerate(value.shape)},
                    "chunks": {str(i): _ndarray_ext(c) for i, c in enumerate(chunks)}}
        return _ndarray_ext(value)
    if isinstance(value, np.generic):
        return msgpack.ExtType(EXT_NPSCALAR, _ndarray_ext(np.asarray(value)).data)
    return value


def encode_tree(tree: Mapping[str, Any]) -> bytes:
    """The bytes `flax.serialization.msgpack_serialize(tree)` writes for a tree of dicts and NumPy
    arrays: keys sorted at every level, arrays as extension 1, leaves over 1 GiB chunked."""
    return msgpack.packb(_encode_leaf(tree), use_bin_type=True, strict_types=True)


class Opaque(NamedTuple):
    """A leaf that is not an array (a complex scalar, an unknown extension): kept to be named."""

    what: str


def _decode_ndarray(data: bytes, source: str) -> np.ndarray:
    try:
        header = msgpack.unpackb(data, raw=True)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise CheckpointError(f"{source}: corrupt array record ({e})") from None
    if not (isinstance(header, (list, tuple)) and len(header) == 3):
        raise CheckpointError(f"{source}: corrupt array record (not [shape, dtype, bytes])")
    shape, name, buffer = header
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_NDIM or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise CheckpointError(f"{source}: corrupt array record (bad shape {shape!r:.80})")
    if not isinstance(name, bytes) or name.decode("latin-1") not in DTYPES:
        raise CheckpointError(f"{source}: array of unsupported dtype {name!r:.40}")
    if not isinstance(buffer, bytes):
        raise CheckpointError(f"{source}: corrupt array record (data is not bytes)")
    dtype = DTYPES[name.decode("latin-1")]
    # Check the declared size against the bytes present before NumPy makes anything of it: a
    # hostile shape such as [2**40, 2**40] with a short buffer is refused here, never allocated.
    count = math.prod(shape)
    if count * dtype.itemsize != len(buffer):
        raise CheckpointError(f"{source}: array record declares shape {tuple(shape)} of {dtype.name} "
                              f"({count * dtype.itemsize:,} bytes) but holds {len(buffer):,} bytes")
    return np.frombuffer(buffer, dtype=dtype).reshape(shape)


def _unique_map(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for key, value in pairs:
        if key in out:  # msgpack would keep the last silently; another reader may keep the first
            raise CheckpointError(f"duplicate key {key!r:.60} in a map")
        out[key] = value
    return out


def _unchunk(node: dict[Any, Any], source: str) -> np.ndarray:
    shape, chunks = node.get("shape"), node.get("chunks")
    if set(node) != {CHUNKED, "shape", "chunks"} or not isinstance(shape, dict) or type(chunks) is not dict:
        raise CheckpointError(f"{source}: corrupt chunked array record")
    try:
        dims = [shape[str(i)] for i in range(len(shape))]
        parts = [chunks[str(i)] for i in range(len(chunks))]
    except KeyError:
        raise CheckpointError(f"{source}: corrupt chunked array record (keys not 0..n-1)") from None
    if (len(dims) > MAX_NDIM or not all(type(n) is int and n >= 0 for n in dims)
            or not parts or not all(isinstance(p, np.ndarray) and p.ndim == 1 for p in parts)
            or len({p.dtype for p in parts}) != 1 or sum(p.size for p in parts) != math.prod(dims)):
        raise CheckpointError(f"{source}: corrupt chunked array record (chunks do not make {dims!r:.80})")
    return np.concatenate(parts).reshape(dims)


def _check_depth(tree: Any, source: str) -> None:
    """Refuse nesting deeper than MAX_DEPTH (iteratively, before anything recurses over it)."""
    stack = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise CheckpointError(f"{source}: nested deeper than {MAX_DEPTH} levels: not a params tree")
        if isinstance(node, (dict, list)):
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


def _restore(node: Any, source: str) -> Any:
    if isinstance(node, dict):
        if CHUNKED in node:
            return _unchunk(node, source)
        return {k: _restore(v, source) for k, v in node.items()}
    return node


def decode_tree(data: bytes, source: str = "flax msgpack") -> Any:
    """What `flax.serialization.msgpack_restore(data)` returns (NumPy arrays as leaves; chunked
    arrays joined), or a CheckpointError naming `source` for bytes that are not such a tree."""

    def ext_hook(code: int, payload: bytes) -> Any:
        if code == EXT_NDARRAY:
            return _decode_ndarray(payload, source)
        if code == EXT_NPSCALAR:
            return _decode_ndarray(payload, source)[()]
        return Opaque("a complex number" if code == EXT_COMPLEX else f"msgpack extension {code}")

    if not data:
        raise CheckpointError(f"{source}: empty file, not a flax msgpack tree")
    try:
        tree = msgpack.unpackb(data, ext_hook=ext_hook, raw=False, strict_map_key=False,
                               object_pairs_hook=_unique_map)
    except CheckpointError as e:
        raise CheckpointError(str(e) if str(e).startswith(source) else f"{source}: {e}") from None
    except (ValueError, TypeError, OverflowError, RecursionError, msgpack.UnpackException) as e:
        raise CheckpointError(f"{source}: not a valid msgpack tree (corrupt or truncated?): "
                              f"{type(e).__name__}: {e}") from None
    _check_depth(tree, source)
    return _restore(tree, source)
