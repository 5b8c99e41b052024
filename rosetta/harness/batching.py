"""Token-budget batching with a small fixed set of shapes and an exactly resumable order.

Paper §5.1: "Sentence pairs were batched together by approximate sequence length. Each
training batch contained a set of sentence pairs containing approximately 25000 source
tokens and 25000 target tokens." Here:

* A pair `(x, y)` of token-id sequences becomes `src = x + [eos]` (`src_eos=True`, the
  default; `x` alone otherwise), `tgt_in = [bos] + y` and `labels = y + [eos]` (SPEC §4:
  the labels are the decoder input shifted left by one, and the position after the last
  real token is eos). Its length is `max(len(src), len(tgt_in))`.
* Bucket boundaries are a fixed increasing list (`default_buckets`: 8, 16, ..., 64, then
  96, 128, 192, 256, 384, 512, ... up to `max_len`). A pair goes into the smallest bucket
  `L` that holds it; pairs longer than the largest bucket are dropped and counted
  (`num_dropped`, `dropped`, and a logged warning), never cut.
* Every batch of bucket `L` has `src`, `tgt_in` and `labels` of shape exactly
  `(max_tokens // L, L)`: lengths are padded up to `L` and the last, partly filled batch of
  a bucket gets rows that are all padding (row index -1). So `src.size == tgt_in.size ==
  (max_tokens // L) * L <= max_tokens` for every batch, and a jitted step compiles once per
  bucket in use, not once per batch.
* Order: per epoch, the pairs of each bucket are shuffled, cut into batches, and the
  batches of all buckets shuffled together, from a generator seeded by `(seed, epoch)`.
  `state_dict()` is `{epoch, index, ...}`, so a fresh iterator over the same pairs with the
  same seed continues exactly where a saved one stopped.
* Packing (`packing=True`, docs/packing.md), as Flax's WMT example trains: one row length
  `L` (`pack_length`, default `default_pack_length`: the longest pair rounded up to a multiple
  of 16, at most the largest bucket) and `max_tokens // L` rows per batch, so every batch has
  the same shape. Per epoch the pairs are shuffled from `(seed, epoch)` and
  packed greedily in that order: a pair goes into the current row if both its source and its
  `tgt_in` still fit, else it starts the next row. Segment ids 1..n number a row's pairs (a
  pair's source and target share one; 0 is padding), positions restart at 0 in each segment,
  and each segment's `tgt_in` starts with bos and its labels end with eos. The number of
  batches can differ a little between epochs; `batches_per_epoch` is epoch 0's.

NumPy only; batches hold int64 arrays that every backend converts itself.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from rosetta.harness.data import DataError
from rosetta.training import Batch

log = logging.getLogger(__name__)

TokenPair = tuple[Sequence[int], Sequence[int]]


def default_buckets(max_len: int) -> tuple[int, ...]:
    """Bucket lengths: multiples of 8 up to 64, then 96, 128, 192, 256, 384, ... (x1.5 and x2
    per doubling), all below `max_len`, then `max_len` itself as the last bucket."""
    if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or max_len < 1:
        raise DataError(f"max_len must be a positive integer, got {max_len!r}")
    candidates = list(range(8, 65, 8))
    power = 64
    while candidates[-1] < max_len:
        candidates += [power * 3 // 2, power * 2]
        power *= 2
    return tuple(b for b in candidates if b < max_len) + (int(max_len),)


# Packed rows are a multiple of this long. A bfloat16 tensor-core MMA (mma.sync m16n8k16, which
# cuBLAS's and cuDNN's/FlashAttention's kernels are built of) takes 16 rows and a depth of 16: a row
# length L that is a multiple of 16 fills every tile of attention's score (L x L, queries in blocks of
# 16) and of P.V (depth L) with no partial tile; 8 would suffice for the GEMMs alone (16-byte alignment).
PACK_MULTIPLE = 16


def default_pack_length(longest: int, limit: int) -> int:
    """The packed row length for pairs whose longest is `longest` tokens (the larger of its source,
    eos included, and its `tgt_in`, bos included: as the batches count them): `longest` rounded up
    to a multiple of PACK_MULTIPLE, but at most `limit` (the largest bucket: `max_len` unless
    `buckets` say less), where the longer pairs are dropped. The one default of `pack_length`."""
    longest, limit = _check_int("longest pair", longest, 0), _check_int("limit", limit, 1)
    return min(max(-(-longest // PACK_MULTIPLE), 1) * PACK_MULTIPLE, limit)


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise DataError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


class BatchIterator:
    """Batches of `pairs` (token-id sequence pairs) by the rules of the module docstring.

    Iterating never ends: after the last batch of epoch e comes the first of epoch e + 1.
    Use `epoch_batches()` for the rest of the current epoch only, `batches_per_epoch` for its
    length, and `state_dict()` / `load_state_dict()` to save and resume the position.
    """

    def __init__(
        self,
        pairs: Sequence[TokenPair],
        max_tokens: int = 4096,
        max_len: int = 256,
        buckets: Sequence[int] | None = None,
        seed: int = 0,
        shuffle: bool = True,
        pad_id: int = 0,
        bos_id: int = 1,
        eos_id: int = 2,
        src_eos: bool = True,
        packing: bool = False,
        pack_length: int | None = None,
    ) -> None:
        self.max_tokens = _check_int("max_tokens", max_tokens, 1)
        self.max_len = _check_int("max_len", max_len, 1)
        self.seed = _check_int("seed", seed, 0)
        self.pad_id = _check_int("pad_id", pad_id, 0)
        self.bos_id = _check_int("bos_id", bos_id, 0)
        self.eos_id = _check_int("eos_id", eos_id, 0)
        if self.eos_id == self.pad_id:
            raise DataError(f"eos_id and pad_id must differ (both {eos_id}): labels end in eos")
        self.shuffle = bool(shuffle)
        self.src_eos = bool(src_eos)
        self.buckets = self._check_buckets(default_buckets(self.max_len) if buckets is None else buckets)
        if pack_length is not None and not packing:
            raise DataError("pack_length is given but packing is off: pass packing=True")
        lengths = self._read(pairs)
        self.pack_length: int | None = None
        if packing:  # one "bucket": the row length every pair is packed into
            longest = int(lengths.max(initial=0))
            length = (default_pack_length(longest, self.buckets[-1]) if pack_length is None
                      else _check_int("pack_length", pack_length, 1))
            self.buckets = self._check_buckets([length])
            self.pack_length = self.buckets[0]
        if self.max_tokens < self.buckets[-1]:
            raise DataError(
                f"max_tokens ({max_tokens}) must be at least the largest bucket length "
                f"({self.buckets[-1]}) so that every batch holds at least one row"
            )
        self.rows = {b: self.max_tokens // b for b in self.buckets}
        self._assign(lengths)
        self.epoch = 0
        self.index = 0
        self._plan_epoch: int | None = None
        self._plan: list[tuple[int, Any]] = []
        if self.pack_length is not None:
            self.batches_per_epoch = len(self.epoch_plan(0))

    @classmethod
    def from_config(cls, pairs: Sequence[TokenPair], cfg: Any, **kwargs: Any) -> BatchIterator:
        """As the constructor, with `max_len` and the special ids taken from a ModelConfig."""
        ids = dict(max_len=cfg.max_len, pad_id=cfg.pad_id, bos_id=cfg.bos_id, eos_id=cfg.eos_id)
        return cls(pairs, **{**ids, **kwargs})

    # -- set-up ----------------------------------------------------------------------------
    def _check_buckets(self, buckets: Sequence[int]) -> tuple[int, ...]:
        out = tuple(_check_int("bucket length", b, 1) for b in buckets)
        if not out or any(a >= b for a, b in zip(out[:-1], out[1:], strict=True)):
            raise DataError(f"buckets must be a non-empty strictly increasing list, got {list(buckets)}")
        if out[-1] > self.max_len:
            raise DataError(f"the largest bucket ({out[-1]}) exceeds max_len ({self.max_len})")
        return out

    def _read(self, pairs: Sequence[TokenPair]) -> np.ndarray:
        """Each pair as `src` and target arrays, checked; returns each pair's length as the
        batches count it: max(len(src), len(tgt_in)), eos and bos included."""
        self.num_pairs = len(pairs)
        eos = [self.eos_id] if self.src_eos else []
        self._src: list[np.ndarray] = []
        self._tgt: list[np.ndarray] = []
        for i, pair in enumerate(pairs):
            if len(pair) != 2:
                raise DataError(f"pair {i} must be (source ids, target ids), got {len(pair)} items")
            src, tgt = (np.asarray(list(pair[0]) + eos, dtype=np.int64), np.asarray(pair[1], dtype=np.int64))
            if src.ndim != 1 or tgt.ndim != 1:
                raise DataError(f"pair {i} must hold two flat sequences of token ids")
            self._src.append(src)
            self._tgt.append(tgt)
        if self.num_pairs:
            every = np.concatenate(self._src + self._tgt)
            if every.size and (every.min() < 0 or (every == self.pad_id).any()):
                bad = int(every.min()) if every.min() < 0 else self.pad_id
                raise DataError(f"the pairs hold token id {bad}: ids must be >= 0 and never pad_id")
        return np.array([max(len(s), len(t) + 1) for s, t in zip(self._src, self._tgt, strict=True)],
                        dtype=np.int64)

    def _assign(self, lengths: np.ndarray) -> None:
        """Each pair to the smallest bucket that holds it; the longer ones dropped (and counted)."""
        where = np.searchsorted(np.asarray(self.buckets), lengths, side="left")  # smallest L >= length
        dropped = np.flatnonzero(where >= len(self.buckets))
        self.dropped: list[int] = dropped.tolist()
        self.members: dict[int, np.ndarray] = {
            b: np.flatnonzero(where == k) for k, b in enumerate(self.buckets) if (where == k).any()
        }
        if self.dropped:
            log.warning("batching: dropped %d of %d pairs longer than %d tokens (with bos/eos)",
                        len(self.dropped), self.num_pairs, self.buckets[-1])
        if not self.members:
            raise DataError(
                f"no pairs to batch: {self.num_pairs} given, {len(self.dropped)} dropped as longer "
                f"than {self.buckets[-1]} tokens"
            )
        self.batches_per_epoch = sum(-(-len(m) // self.rows[b]) for b, m in self.members.items())

    # -- facts -----------------------------------------------------------------------------
    @property
    def num_dropped(self) -> int:
        """Pairs left out because they are longer than the largest bucket."""
        return len(self.dropped)

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """The `(rows, length)` shapes that batches take, one per bucket in use."""
        return [(self.rows[b], b) for b in self.members]

    def real_token_share(self, epoch: int = 0) -> float:
        """The share of the target slots of `epoch`'s batches (rows x L each, padding rows included)
        that hold real tokens: the batches' `num_tgt_tokens` summed over their `labels.size`."""
        plan = self.epoch_plan(epoch)
        slots = sum(self.rows[length] * length for length, _ in plan)
        held = ([i for _, rows in plan for row in rows for i in row] if self.pack_length is not None
                else [int(i) for _, members in plan for i in members])
        return sum(len(self._tgt[i]) + 1 for i in held) / slots

    def __repr__(self) -> str:
        return (f"BatchIterator({self.num_pairs} pairs, {self.num_dropped} dropped, "
                f"{self.batches_per_epoch} batches/epoch, shapes {self.shapes}, "
                f"epoch {self.epoch}, index {self.index})")

    # -- order -----------------------------------------------------------------------------
    def epoch_plan(self, epoch: int) -> list[tuple[int, Any]]:
        """The batches of `epoch` in order, as `(bucket length, pair indices)`, or when packing
        `(pack_length, [pair indices of each row])`: a pure function of the pairs, the seed
        and `epoch`."""
        rng = np.random.default_rng([self.seed, _check_int("epoch", epoch, 0)])
        if self.pack_length is not None:
            return self._packed_plan(rng)
        plan = []
        for b, members in self.members.items():
            order = rng.permutation(members) if self.shuffle else members
            rows = self.rows[b]
            plan += [(b, order[start:start + rows]) for start in range(0, len(order), rows)]
        if self.shuffle:
            plan = [plan[k] for k in rng.permutation(len(plan))]
        return plan

    def _packed_plan(self, rng: np.random.Generator) -> list[tuple[int, list[list[int]]]]:
        """Greedy packing in shuffled order (module docstring), cut into batches of rows."""
        length = self.pack_length
        members = self.members[length]
        order = rng.permutation(members) if self.shuffle else members
        rows: list[list[int]] = [[]]
        used_src = used_tgt = 0
        for i in order.tolist():
            n_src, n_tgt = len(self._src[i]), len(self._tgt[i]) + 1  # tgt_in: bos + target
            if rows[-1] and (used_src + n_src > length or used_tgt + n_tgt > length):
                rows.append([])
                used_src = used_tgt = 0
            rows[-1].append(i)
            used_src, used_tgt = used_src + n_src, used_tgt + n_tgt
        per_batch = self.rows[length]
        return [(length, rows[start:start + per_batch]) for start in range(0, len(rows), per_batch)]

    def make_packed_batch(self, length: int, rows: Sequence[Sequence[int]]) -> Batch:
        """The packed batch of row length `length` whose row r holds the pairs `rows[r]` one
        after the other (at most `max_tokens // length` rows; the remaining ones are padding)."""
        num_rows = self.rows[length]
        if len(rows) > num_rows:
            raise DataError(f"{len(rows)} packed rows do not fit a batch of {num_rows} rows")
        src, tgt_in, labels, src_seg, tgt_seg, src_pos, tgt_pos = (
            np.full((num_rows, length), self.pad_id if k < 3 else 0, dtype=np.int64) for k in range(7))
        index = np.full((num_rows, length), -1, dtype=np.int64)
        n_src = n_tgt = 0
        for r, row in enumerate(rows):
            at_src = at_tgt = 0
            for k, i in enumerate(row):
                s, t = self._src[i], self._tgt[i]
                n = len(t)
                if at_src + len(s) > length or at_tgt + n + 1 > length:
                    raise DataError(f"pair {i} does not fit row {r} of length {length}")
                ss, ts = slice(at_src, at_src + len(s)), slice(at_tgt, at_tgt + n + 1)
                src[r, ss], src_seg[r, ss], src_pos[r, ss] = s, k + 1, np.arange(len(s))
                tgt_in[r, ts] = np.concatenate([[self.bos_id], t])
                labels[r, ts] = np.concatenate([t, [self.eos_id]])
                tgt_seg[r, ts], tgt_pos[r, ts] = k + 1, np.arange(n + 1)
                index[r, k] = i
                at_src, at_tgt = at_src + len(s), at_tgt + n + 1
                n_src += len(s)
                n_tgt += n + 1
        return Batch(src, tgt_in, labels, index, n_src, n_tgt, src_seg, tgt_seg, src_pos, tgt_pos)

    def make_batch(self, length: int, indices: Sequence[int]) -> Batch:
        """The padded batch of bucket `length` holding the pairs `indices` (at most
        `max_tokens // length` of them; the remaining rows are all padding)."""
        rows = self.rows[length]
        if len(indices) > rows:
            raise DataError(f"{len(indices)} pairs do not fit bucket {length} ({rows} rows)")
        src = np.full((rows, length), self.pad_id, dtype=np.int64)
        tgt_in = np.full((rows, length), self.pad_id, dtype=np.int64)
        labels = np.full((rows, length), self.pad_id, dtype=np.int64)
        index = np.full(rows, -1, dtype=np.int64)
        n_src = n_tgt = 0
        for r, i in enumerate(indices):
            s, t = self._src[i], self._tgt[i]
            n = len(t)
            if len(s) > length or n + 1 > length:
                raise DataError(f"pair {i} does not fit bucket {length}")
            src[r, :len(s)] = s
            tgt_in[r, 0] = self.bos_id
            tgt_in[r, 1:n + 1] = t
            labels[r, :n] = t
            labels[r, n] = self.eos_id
            index[r] = i
            n_src += len(s)
            n_tgt += n + 1
        return Batch(src, tgt_in, labels, index, n_src, n_tgt)

    # -- iteration -------------------------------------------------------------------------
    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> Batch:
        if self._plan_epoch != self.epoch:
            self._plan, self._plan_epoch = self.epoch_plan(self.epoch), self.epoch
        length, indices = self._plan[self.index]
        self.index += 1
        if self.index == len(self._plan):
            self.epoch, self.index = self.epoch + 1, 0
        if self.pack_length is not None:
            return self.make_packed_batch(length, indices)
        return self.make_batch(length, indices)

    def epoch_batches(self) -> Iterator[Batch]:
        """The remaining batches of the current epoch (all of it from a fresh iterator)."""
        epoch = self.epoch
        while self.epoch == epoch:
            yield next(self)

    # -- resume ----------------------------------------------------------------------------
    def _epoch_length(self, epoch: int) -> int:
        """Batches in `epoch`: the same for every epoch unless packing."""
        if self.pack_length is None:
            return self.batches_per_epoch
        if self._plan_epoch != epoch:
            self._plan, self._plan_epoch = self.epoch_plan(epoch), epoch
        return len(self._plan)

    def state_dict(self) -> dict[str, int]:
        """The position, JSON-able: the next batch is batch `index` of epoch `epoch`."""
        state = {"epoch": self.epoch, "index": self.index, "seed": self.seed,
                 "batches_per_epoch": self._epoch_length(self.epoch)}
        if self.pack_length is not None:
            state["pack_length"] = self.pack_length
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict()` saved by an iterator over the same pairs and seed."""
        try:
            epoch, index = int(state["epoch"]), int(state["index"])
        except (KeyError, TypeError, ValueError):
            raise DataError(
                f"batch iterator state needs integer 'epoch' and 'index', got {state!r}"
            ) from None
        if "seed" in state and int(state["seed"]) != self.seed:
            raise DataError(f"state was saved with seed {state['seed']}, this iterator has seed {self.seed}")
        if state.get("pack_length") != self.pack_length:
            raise DataError(f"state was saved with pack_length {state.get('pack_length')}, this iterator "
                            f"has {self.pack_length} (None: no packing)")
        if epoch < 0:
            raise DataError(f"state position epoch {epoch}, index {index} is out of range")
        length = self._epoch_length(epoch)
        if "batches_per_epoch" in state and int(state["batches_per_epoch"]) != length:
            raise DataError(
                f"state was saved with {state['batches_per_epoch']} batches per epoch, this iterator "
                f"has {length}: not the same pairs or batching settings"
            )
        if not 0 <= index < length:
            raise DataError(f"state position epoch {epoch}, index {index} is out of range")
        self.epoch, self.index = epoch, index


def eval_batches(
    pairs: Sequence[TokenPair], max_tokens: int = 4096, max_len: int = 256, **kwargs: Any
) -> tuple[list[Batch], list[int]]:
    """All `pairs` batched once without shuffling: buckets in increasing length, pairs in
    their original order within a bucket. Returns `(batches, dropped)`, `dropped` being the
    indices of pairs too long for `max_len`. Each batch's `indices` maps its rows back to
    `pairs`; `restore_order` puts per-row outputs back in the original order. For sources
    without references pass empty targets. Other keyword arguments as for BatchIterator."""
    it = BatchIterator(pairs, max_tokens=max_tokens, max_len=max_len, shuffle=False, **kwargs)
    return list(it.epoch_batches()), it.dropped


def restore_order(batches: Sequence[Batch], outputs: Sequence[Sequence[Any]], num_pairs: int) -> list[Any]:
    """`outputs[b][r]` (one output per row of batch b, e.g. decoded text) in the original pair
    order: a list of `num_pairs` items, None where a pair was dropped. Padding rows are
    skipped."""
    if len(outputs) != len(batches):
        raise DataError(f"{len(outputs)} output groups for {len(batches)} batches")
    result: list[Any] = [None] * num_pairs
    for batch, out in zip(batches, outputs, strict=True):
        for r, i in enumerate(batch.indices.tolist()):
            if i >= 0:
                result[i] = out[r]
    return result
