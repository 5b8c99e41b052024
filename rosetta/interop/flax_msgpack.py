"""flax.serialization's msgpack format, in NumPy and msgpack only (no jax, no flax).

`encode_tree` writes the bytes `flax.serialization.msgpack_serialize` writes for a tree of dicts
and NumPy arrays. `read_structure` reads such a file's tree from its headers alone: every array
is a `Lazy` leaf (path, shape, dtype, where its bytes lie), checked against the bytes actually
present, and nothing of its data is read until `Lazy.load`; so a reader can refuse, by path, a
leaf it has no use for or one whose claimed size exceeds its bytes before allocating anything.
`decode_tree` loads everything: what `msgpack_restore` returns. Hostile input (a declared shape
larger than its bytes, a length past the end of the file, unknown dtypes, duplicate keys, deep
nesting, too many objects) is a CheckpointError naming the leaf. Used by rosetta/interop/flax_wmt.py.
"""

from __future__ import annotations

import io
import math
import os
import struct
from collections.abc import Mapping
from typing import Any, BinaryIO, NamedTuple

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
# A params tree of 1,000 layers has ~50,000 objects (keys and leaves); a TrainState three times that.
# Each parsed object costs ~100 bytes of Python: the budget keeps a hostile file of tiny objects
# (one byte each) to ~100 MB.
MAX_OBJECTS = 1_000_000
MAX_TEXT = 4096  # a string longer than this (no key or dtype name is) stays a Blob, unread


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


class Lazy:
    """An array leaf, not yet read: its shape and dtype from the record's header, and the
    (offset, length) spans of the file that hold its C-order bytes (several for a chunked array,
    flax's `__msgpack_chunked_array__`). Sizes were checked against the file when it was parsed."""

    def __init__(self, f: BinaryIO, path: str, shape: tuple[int, ...], dtype: np.dtype,
                 spans: list[tuple[int, int]], scalar: bool = False):
        self.f, self.path, self.shape, self.dtype = f, path, shape, dtype
        self.spans, self.scalar = spans, scalar

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.spans)

    def load(self, source: str = "flax msgpack") -> Any:
        """The array (a NumPy scalar for flax's np-scalar extension), read now."""
        parts = []
        for offset, n in self.spans:
            self.f.seek(offset)
            parts.append(self.f.read(n))
            if len(parts[-1]) != n:  # the file shrank since it was parsed
                raise CheckpointError(f"{source}: {self.path}: truncated while reading")
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        array = np.frombuffer(data, self.dtype).reshape(self.shape)
        return array[()] if self.scalar else array


class Blob(NamedTuple):
    """A bin leaf, or a string leaf longer than MAX_TEXT, not yet read."""

    f: BinaryIO
    offset: int
    length: int
    text: bool

    def load(self, source: str = "flax msgpack") -> bytes | str:
        self.f.seek(self.offset)
        data = self.f.read(self.length)
        if len(data) != self.length:
            raise CheckpointError(f"{source}: truncated while reading")
        return data.decode("utf-8", "surrogateescape") if self.text else data


def _where(path: tuple) -> str:
    return "/".join(map(str, path)) or "the top level"


class _Parser:
    """msgpack objects from a seekable binary file, headers only: containers become dicts and
    lists, arrays Lazy leaves, bins Blobs; every length is checked against the bytes left in the
    file (or in the enclosing extension record) before anything is read or skipped."""

    def __init__(self, f: BinaryIO, source: str, records: bool):
        self.f, self.source, self.records, self.objects = f, source, records, 0
        self.end = f.seek(0, os.SEEK_END)
        f.seek(0)

    def fail(self, path: tuple, why: str) -> CheckpointError:
        return CheckpointError(f"{self.source}: {_where(path)}: {why}")

    def take(self, n: int, path: tuple, what: str) -> int:
        """Claim the next n bytes (returning their offset) after checking they are there."""
        at = self.f.tell()
        if n > self.end - at:
            raise self.fail(path, f"truncated: its {what} claims {n:,} bytes at offset {at:,}, but only "
                                  f"{self.end - at:,} remain")
        return at

    def read(self, n: int, path: tuple, what: str) -> bytes:
        self.take(n, path, what)
        return self.f.read(n)

    def uint(self, n: int, path: tuple) -> int:
        return int.from_bytes(self.read(n, path, "header"), "big")

    def value(self, path: tuple, depth: int = 1) -> Any:
        self.objects += 1
        if self.objects > MAX_OBJECTS:
            raise self.fail(path, f"more than {MAX_OBJECTS:,} msgpack objects: not a params tree")
        if depth > MAX_DEPTH:
            raise self.fail(path, f"msgpack objects nested deeper than {MAX_DEPTH} levels: not a params tree")
        t = self.read(1, path, "header")[0]
        if t <= 0x7f:
            return t
        if t >= 0xe0:
            return t - 0x100
        if t <= 0x8f or t in (0xde, 0xdf):
            n = t & 0x0f if t <= 0x8f else self.uint(2 if t == 0xde else 4, path)
            return self.map(n, path, depth)
        if t <= 0x9f or t in (0xdc, 0xdd):
            n = t & 0x0f if t <= 0x9f else self.uint(2 if t == 0xdc else 4, path)
            self.take(n, path, "array header")  # every element takes at least one byte
            return [self.value((*path, i), depth + 1) for i in range(n)]
        if t <= 0xbf or t in (0xd9, 0xda, 0xdb):
            n = t & 0x1f if t <= 0xbf else self.uint({0xd9: 1, 0xda: 2, 0xdb: 4}[t], path)
            return self.blob(n, path, text=True)
        if t in (0xc4, 0xc5, 0xc6):
            return self.blob(self.uint({0xc4: 1, 0xc5: 2, 0xc6: 4}[t], path), path, text=False)
        if t in (0xc7, 0xc8, 0xc9) or 0xd4 <= t <= 0xd8:
            n = self.uint({0xc7: 1, 0xc8: 2, 0xc9: 4}[t], path) if t <= 0xc9 else 1 << (t - 0xd4)
            return self.ext(self.uint(1, path), n, path)
        if t in (0xc0, 0xc2, 0xc3):
            return {0xc0: None, 0xc2: False, 0xc3: True}[t]
        if t in (0xca, 0xcb):
            single = t == 0xca
            return struct.unpack(">f" if single else ">d", self.read(4 if single else 8, path, "float"))[0]
        if 0xcc <= t <= 0xd3:
            n = 1 << ((t - 0xcc) % 4)
            return int.from_bytes(self.read(n, path, "integer"), "big", signed=t >= 0xd0)
        raise self.fail(path, f"not a valid msgpack tree: byte {t:#04x} at offset {self.f.tell() - 1:,} "
                              f"starts no msgpack object (corrupt?)")

    def blob(self, n: int, path: tuple, text: bool) -> Any:
        at = self.take(n, path, "string" if text else "binary")
        if text and n <= MAX_TEXT:
            try:
                return self.f.read(n).decode("utf-8")
            except UnicodeDecodeError:
                raise self.fail(path, "a string that is not UTF-8 (corrupt?)") from None
        self.f.seek(at + n)
        return Blob(self.f, at, n, text)

    def map(self, n: int, path: tuple, depth: int) -> dict[Any, Any]:
        self.take(2 * n, path, "map header")  # a key and a value, at least one byte each
        out: dict[Any, Any] = {}
        for _ in range(n):
            key = self.value(path, depth + 1)
            if isinstance(key, (dict, list, Blob, Lazy, Opaque)):
                raise self.fail(path, f"a map key that is a {type(key).__name__} (corrupt?)")
            if key in out:  # msgpack would keep the last silently; another reader may keep the first
                raise self.fail(path, f"duplicate key {key!r:.60} in a map")
            out[key] = self.value((*path, key), depth + 1)
        return _chunked(out, path, self) if CHUNKED in out else out

    def ext(self, code: int, n: int, path: tuple) -> Any:
        at = self.take(n, path, f"extension {code} record")
        if code in (EXT_NDARRAY, EXT_NPSCALAR) and self.records:
            leaf = self.array_record(at + n, path, code == EXT_NPSCALAR)
        else:
            leaf = Opaque("a complex number" if code == EXT_COMPLEX else f"msgpack extension {code}")
        self.f.seek(at + n)
        return leaf

    def array_record(self, end: int, path: tuple, scalar: bool) -> Lazy:
        """flax.serialization._ndarray_to_bytes: msgpack of [shape, dtype name, C-order bytes]."""
        outer, self.end = self.end, end  # nothing of the record may reach past the record
        try:
            if self.read(1, path, "array record")[0] != 0x93:  # a msgpack array of three
                raise self.fail(path, "corrupt array record (not [shape, dtype, bytes])")
            shape = self.value(path, MAX_DEPTH - 1)
            name = self.value(path, MAX_DEPTH - 1)
            t = self.read(1, path, "array record")[0]
            width = {0xc4: 1, 0xd9: 1, 0xc5: 2, 0xda: 2, 0xc6: 4, 0xdb: 4}  # bin, or str (raw msgpack)
            if t not in width and not 0xa0 <= t <= 0xbf:
                raise self.fail(path, "corrupt array record (data is not bytes)")
            n = self.uint(width[t], path) if t in width else t & 0x1f
            at = self.take(n, path, "array data")
        finally:
            self.end = outer
        if at + n != end:
            raise self.fail(path, "corrupt array record (bytes after the data)")
        if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(
                type(d) is int and d >= 0 for d in shape):
            raise self.fail(path, f"corrupt array record (bad shape {shape!r:.80})")
        if isinstance(name, bytes):
            name = name.decode("latin-1")
        if not isinstance(name, str) or name not in DTYPES:
            raise self.fail(path, f"array of unsupported dtype {name!r:.40}")
        dtype = DTYPES[name]
        # The declared size against the bytes present, before anything is allocated: a hostile
        # shape such as [2**40, 2**40] over a 16-byte buffer is refused here.
        claimed = math.prod(shape) * dtype.itemsize
        if claimed != n:
            raise self.fail(path, f"array record declares shape {tuple(shape)} of {dtype.name} "
                                  f"({claimed:,} bytes) but holds {n:,} bytes")
        return Lazy(self.f, _where(path), tuple(shape), dtype, [(at, n)], scalar)


def _chunked(node: dict[Any, Any], path: tuple, parser: _Parser) -> Lazy:
    """flax.serialization._chunk's record of an array above MAX_CHUNK_SIZE, as one Lazy leaf."""
    shape, chunks = node.get("shape"), node.get("chunks")
    if set(node) != {CHUNKED, "shape", "chunks"} or type(shape) is not dict or type(chunks) is not dict:
        raise parser.fail(path, "corrupt chunked array record")
    try:
        dims = [shape[str(i)] for i in range(len(shape))]
        parts = [chunks[str(i)] for i in range(len(chunks))]
    except KeyError:
        raise parser.fail(path, "corrupt chunked array record (keys not 0..n-1)") from None
    if (len(dims) > MAX_NDIM or not all(type(n) is int and n >= 0 for n in dims)
            or not parts or not all(isinstance(p, Lazy) and p.ndim == 1 for p in parts)
            or len({p.dtype for p in parts}) != 1
            or sum(p.shape[0] for p in parts) != math.prod(dims)):
        raise parser.fail(path, f"corrupt chunked array record (chunks do not make {dims!r:.80})")
    return Lazy(parser.f, _where(path), tuple(dims), parts[0].dtype, [s for p in parts for s in p.spans])


def read_structure(f: BinaryIO, source: str = "flax msgpack", records: bool = True) -> Any:
    """The tree of a flax msgpack file opened in binary mode, its leaves unread (Lazy arrays,
    Blobs, Opaque); the file must stay open while they are loaded. `records=False` leaves the
    array records unopened (every extension an Opaque): the structure alone, for detection."""
    parser = _Parser(f, source, records)
    if parser.end == 0:
        raise CheckpointError(f"{source}: empty file, not a flax msgpack tree")
    tree = parser.value(())
    if f.tell() != parser.end:
        raise CheckpointError(f"{source}: not a valid msgpack tree: {parser.end - f.tell():,} bytes after "
                              f"its end (corrupt?)")
    return tree


def load_all(tree: Any, source: str = "flax msgpack") -> Any:
    """The tree with every Lazy leaf and Blob read."""
    if isinstance(tree, dict):
        return {k: load_all(v, source) for k, v in tree.items()}
    if isinstance(tree, list):
        return [load_all(v, source) for v in tree]
    return tree.load(source) if isinstance(tree, (Lazy, Blob)) else tree


def decode_tree(data: bytes, source: str = "flax msgpack") -> Any:
    """What `flax.serialization.msgpack_restore(data)` returns (NumPy arrays as leaves; chunked
    arrays joined), or a CheckpointError naming `source` for bytes that are not such a tree."""
    return load_all(read_structure(io.BytesIO(data), source), source)
