"""Inside one step of a training trace (rosetta/diff/training/trace.py, docs/training_diff.md): its batch's
ids (their digest and checks), the forward pass on them, and the loop's evaluations. Two optional
parts of a trace directory:

    forward_00000k.npz        for a step k stored whole (k <= N): an activation dump in
                              rosetta.diff.shared.dump's format (`src`, `tgt` and `{stage: array}`) of one
                              forward pass on update k's src and tgt_in with the weights before
                              update k (step k-1's; the initial ones for k = 1), dropout off
    evals.jsonl               one JSON line per evaluation, steps increasing, at most one per step:
                              `step` (after that update; 0: before any), `batch_sha256`
                              (batch_digest of its ids) and `loss`: the mean cross entropy over the
                              labels that are not pad_id, no label smoothing, dropout off
    eval_00000k.safetensors   that evaluation's `src`, `tgt_in`, `labels` (int64)

TraceWriter.forward / .evaluation write them and Trace.forward / .evaluations / .evaluation_batch
read them, through the functions here: trace.py builds on this module. Reading is as strict as the
rest of a trace: a dump of another batch, a NaN loss, or an evaluation batch that does not hash to
its record is refused in one line (CheckpointError naming the file).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import re
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from rosetta.checkpoint import read_header, read_tensors, write_safetensors
from rosetta.config import ModelConfig
from rosetta.diff.shared.dump import Dump, check_stages, read_dump, write_dump
from rosetta.errors import CheckpointError, RosettaError
from rosetta.json_input import read_json_lines

BATCH_KEYS = ("src", "tgt_in", "labels")
EVALS = "evals.jsonl"
EVAL_LINE_LIMIT = 1024  # bytes: a step, a sha256 and a number take ~150
CUT_OFF = ("the trace is truncated (the writer stopped mid-line); remove that line to compare the steps "
           "before it")


class EvalRecord(NamedTuple):
    """One line of evals.jsonl: the loop's evaluation loss after update `step` (0: before any)."""

    step: int
    loss: float
    batch_sha256: str


def forward_file(k: int) -> str:
    return f"forward_{k:06d}.npz"


def eval_file(k: int) -> str:
    return f"eval_{k:06d}.safetensors"


# -- a batch's ids, and JSON lines: what steps, dumps and evaluations share --------------------------

def to_numpy(value: Any) -> np.ndarray:
    """A NumPy copy of a NumPy, PyTorch or JAX array (torch's bfloat16 widened to float32)."""
    if hasattr(value, "detach"):  # a torch tensor: on the CPU, and a dtype NumPy knows
        value = value.detach().cpu()
        if str(value.dtype) in ("torch.bfloat16", "torch.float16"):
            value = value.float()
        return value.numpy()
    return np.asarray(value)


def batch_digest(src: Any, tgt_in: Any, labels: Any) -> str:
    """sha256 of the batch's ids as int64 with their shapes: equal for the same batch whatever
    integer type or framework held it."""
    digest = hashlib.sha256()
    for ids in (src, tgt_in, labels):
        ids = np.ascontiguousarray(to_numpy(ids), dtype=np.int64)
        digest.update(repr(ids.shape).encode() + ids.tobytes())
    return digest.hexdigest()


def check_ids_header(path: Path, header: Any, cfg: ModelConfig) -> None:
    """The batch's shapes and types from a safetensors header, before any data is read."""
    for key in BATCH_KEYS:
        info = header.tensors[key]
        shape, kind = tuple(info.shape), np.dtype(info.dtype).kind
        if len(shape) != 2 or shape[1] > cfg.max_len or kind not in "iu":
            raise CheckpointError(f"{path}: {key} must be [rows, length <= max_len {cfg.max_len}] "
                                  f"integer ids, got {info.dtype} {shape}")


def check_ids(path: Path, key: str, ids: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    vocab = cfg.src_vocab_size if key == "src" else cfg.tgt_vocab_size
    if ids.ndim != 2 or ids.dtype.kind not in "iu" or ids.size == 0:
        raise CheckpointError(f"{path}: {key} must be a non-empty [rows, length] integer array, "
                              f"got {ids.dtype} {ids.shape}")
    if ids.min() < 0 or ids.max() >= vocab:
        raise CheckpointError(f"{path}: {key} holds ids outside [0, {vocab}) (ids {int(ids.min())}.."
                              f"{int(ids.max())}): a trace of another model?")
    return ids.astype(np.int64)


def json_lines(path: Path, limit: int, what: str) -> Iterator[tuple[int, object]]:
    """(line number, parsed JSON) of each line of a trace's JSON-lines file, through the one JSON reader
    (rosetta/json_input.py): every line read up to `limit` bytes and refused in one line when longer
    than `what`, cut off, not JSON or past its bounds. NaN and Infinity read as floats: a diverged
    step's loss (the record's check names it). FileNotFoundError passes through: the caller knows
    what a missing file means."""
    regular_file(path)
    return read_json_lines(path, limit, what, error=CheckpointError, nonfinite=True,
                           note=": the trace is corrupt", cut_off=CUT_OFF, crlf=False)


def regular_file(path: Path) -> bool:
    """Whether `path` exists; CheckpointError when it is anything but a regular file (a FIFO would
    block the open, a device never end), checked before it is opened."""
    try:
        mode = path.stat().st_mode  # follows links: a link to a regular file is one
    except FileNotFoundError:
        return False
    except (OSError, RuntimeError) as e:  # a link loop, a denied folder
        raise CheckpointError(f"{path}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    if not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "not a regular file")
        raise CheckpointError(f"{path} is {kind}: a trace's files are regular files (refused before opening)")
    return True


@contextlib.contextmanager
def os_errors(path: Path) -> Iterator[None]:
    """A file system error (read-only, full, a file in the way) as one line naming the path."""
    try:
        yield
    except OSError as e:
        raise RosettaError(f"trace: cannot write {path}: {e.strerror or e}") from None


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool((a == b).all())


def _check_eval_ids(path: Path, cfg: ModelConfig, ids: list[np.ndarray]) -> tuple[np.ndarray, ...]:
    """The evaluation batch as a step's: integer ids within the vocabularies, [rows, length <= max_len],
    labels shaped as tgt_in."""
    src, tgt_in, labels = (check_ids(path, key, v, cfg) for key, v in zip(BATCH_KEYS, ids, strict=True))
    longest = max(src.shape[1], tgt_in.shape[1])
    if tgt_in.shape != labels.shape or len(src) != len(tgt_in) or longest > cfg.max_len:
        raise CheckpointError(f"{path}: src {src.shape}, tgt_in {tgt_in.shape}, labels {labels.shape}: "
                              f"expected [rows, S], [rows, T], [rows, T] with S, T <= max_len {cfg.max_len}")
    return src, tgt_in, labels


# -- the forward dump ------------------------------------------------------------------------------

def write_forward(path: Path, cfg: ModelConfig, step: int, batch: tuple[np.ndarray, np.ndarray],
                  stages: Mapping[str, Any], src: Any = None, tgt_in: Any = None) -> Path:
    """Step `step`'s dump at `path`, on its `batch` (src, tgt_in); `src`/`tgt_in`, when the loop gives
    them, must be that batch (TraceWriter.forward checks the step)."""
    if path.exists():
        raise RosettaError(f"trace: {path} already exists: one forward dump per step")
    for key, given, want in zip(("src", "tgt_in"), (src, tgt_in), batch, strict=True):
        if given is not None and not _same(np.asarray(to_numpy(given)), want):
            raise RosettaError(f"trace: forward({step}): the {key} given is not step {step}'s (shape "
                               f"{np.shape(to_numpy(given))} against {want.shape}): capture the forward "
                               f"pass on the batch of the update it belongs to")
    if not stages:
        raise RosettaError(f"trace: forward({step}): no stages (capture_torch or capture_nnx give them)")
    try:  # the model's widths and layer counts, and the batch's shapes, before anything is written
        checked = check_stages(*batch, {n: to_numpy(v) for n, v in stages.items()}, cfg)
    except CheckpointError as e:
        raise RosettaError(f"trace: forward({step}): {e}") from None
    return write_dump(path, *batch, checked)


def read_forward(path: Path, cfg: ModelConfig, k: int, src: np.ndarray, tgt_in: np.ndarray) -> Dump:
    """Step k's dump at `path`, checked against the model and step k's batch (src, tgt_in)."""
    dump = read_dump(path, cfg)
    if not (_same(dump.src, src) and _same(dump.tgt, tgt_in)):
        raise CheckpointError(f"{path}: its batch (src {dump.src.shape}, tgt {dump.tgt.shape}) is not step "
                              f"{k}'s (src {src.shape}, tgt_in {tgt_in.shape}): a forward dump of another "
                              f"batch (trace.forward(k, stages) right after trace.step(k, ...))")
    return dump


# -- the evaluations -------------------------------------------------------------------------------

def write_evaluation(folder: Path, cfg: ModelConfig, step: int, batch: tuple[Any, Any, Any],
                     loss: float) -> None:
    """The ids to eval_00000k.safetensors, then the line to evals.jsonl (TraceWriter.evaluation
    checks the step)."""
    path = folder / eval_file(step)
    ids = _check_eval_ids(path, cfg, [np.asarray(to_numpy(v)) for v in batch])
    write_safetensors(path, dict(zip(BATCH_KEYS, ids, strict=True)), {})
    record = {"step": step, "batch_sha256": batch_digest(*ids), "loss": float(loss)}
    with os_errors(folder), (folder / EVALS).open("a", encoding="utf-8") as lines:
        lines.write(json.dumps(record) + "\n")  # one write per line, as steps.jsonl


def read_evaluations(folder: Path, steps: int) -> list[EvalRecord]:
    """Every line of evals.jsonl, checked; [] without the file (a loop that recorded none)."""
    path, records = folder / EVALS, []
    try:
        for number, record in json_lines(path, EVAL_LINE_LIMIT, "an evaluation record"):
            records.append(_eval_record(path, number, record, steps, records[-1].step if records else -1))
    except FileNotFoundError:
        return []
    return records


def _eval_record(path: Path, number: int, record: object, steps: int, last: int) -> EvalRecord:
    where = f"{path}: line {number}"
    if not isinstance(record, dict):
        raise CheckpointError(f"{where}: not an evaluation record (step, batch_sha256, loss)")
    step, digest, loss = (record.get(key) for key in ("step", "batch_sha256", "loss"))
    if isinstance(step, bool) or not isinstance(step, int) or not last < step <= steps:
        raise CheckpointError(f"{where}: step must be an integer after the previous record's ({last}) and at "
                              f"most the trace's {steps} steps, got {step!r}")
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise CheckpointError(f"{where}: batch_sha256 must be a sha256 hex digest")
    if isinstance(loss, bool) or not isinstance(loss, (int, float)):
        raise CheckpointError(f"{where}: loss must be a number, got {loss!r}")
    if not math.isfinite(loss):
        raise CheckpointError(f"{where}: the evaluation loss after step {step} is {loss}: the run had "
                              f"diverged there (compare the steps before it: --steps {max(step - 1, 1)})")
    return EvalRecord(step, float(loss), digest)


def read_evaluation_batch(path: Path, cfg: ModelConfig, record: EvalRecord) -> tuple[np.ndarray, ...]:
    """The ids of `record`'s evaluation from `path`, every header checked before its data is read,
    and the ids against the record's hash."""
    if not regular_file(path):
        raise CheckpointError(f"{path} is missing: the trace is truncated ({EVALS} records an evaluation "
                              f"after step {record.step})")
    header = read_header(path, "trace evaluation")
    if set(header.tensors) != set(BATCH_KEYS):
        raise CheckpointError(f"{path}: holds {sorted(header.tensors)[:4]}, expected {list(BATCH_KEYS)}")
    check_ids_header(path, header, cfg)
    tensors = read_tensors(path, header)
    ids = _check_eval_ids(path, cfg, [tensors[key] for key in BATCH_KEYS])
    if batch_digest(*ids) != record.batch_sha256:
        raise CheckpointError(f"{path}: its batch does not hash to the batch_sha256 of the evaluation after "
                              f"step {record.step} in {EVALS}: the files come from different runs, or were "
                              f"edited")
    return ids
