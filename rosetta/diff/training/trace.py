"""The training trace: what one training loop did, step by step, in a form any framework writes
and `rosetta diff` compares (docs/training_diff.md).

A trace is a directory:

    trace.json               the header: format, the model config, the parameter names (canonical,
                             rosetta.params.param_shapes order), `full_steps` N, the dtype of the
                             stored tensors, the training settings when the writer knows them
    steps.jsonl              one JSON line per optimizer step, from step 1: the batch's sha256, the
                             loss, the learning rate used, the global gradient norm before
                             clipping, and per tensor the gradient's and the updated parameter's
                             norm and sum (checksums for the steps past N)
    step_000000.safetensors  the initial weights (`params.<name>`)
    step_00000k.safetensors  for k = 1..N: the batch (`src`, `tgt_in`, `labels`), the gradients
                             before clipping (`grads.<name>`) and the weights after the update
                             (`params.<name>`), canonical names and math layout ([in, out])
    forward_00000k.npz       optional, k <= N: a forward pass's stages on step k's batch; and
    evals.jsonl, eval_*      the loop's evaluations (rosetta/diff/training/trace_files.py: both formats)

`TraceWriter` writes one (our trainers through `rosetta train --trace N`, a user's loop through
the recipe in the docs); `read_trace` reads one strictly: a trace usually comes from someone
else's loop, and a truncated file, a NaN, a misnamed or transposed tensor would otherwise turn
up later as a baffling "difference". Every refusal is a CheckpointError naming the file and the
step or tensor at fault.
"""

from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from rosetta import json_input
from rosetta.checkpoint import read_header, read_tensors, write_safetensors
from rosetta.config import ModelConfig
from rosetta.diff.shared.dump import Dump
from rosetta.diff.training.trace_files import (
    BATCH_KEYS,
    EvalRecord,
    batch_digest,
    check_ids,
    check_ids_header,
    eval_file,
    forward_file,
    json_lines,
    os_errors,
    read_evaluation_batch,
    read_evaluations,
    read_forward,
    regular_file,
    to_numpy,
    write_evaluation,
    write_forward,
)
from rosetta.errors import CheckpointError, ConfigError, RosettaError
from rosetta.files import atomic_write_bytes
from rosetta.params import Params, param_shapes
from rosetta.parity import TOLERANCES

TRACE_FORMAT = "rosetta-trace/1"
HEADER, STEPS = "trace.json", "steps.jsonl"
HEADER_LIMIT = 16 * 2**20  # bytes of trace.json read at most
DTYPES = ("float32", "float64")  # of the stored tensors (a bfloat16 run keeps float32 weights)
# What a forward pass may compute in: the dtypes rosetta.parity holds a backend to.
COMPUTE_DTYPES = tuple(sorted({dtype for _, dtype in TOLERANCES}))
# trace.json's fields (rosetta/json_input.py checks them before any is used).
_field = json_input.field
HEADER_SCHEMA = {
    "format": _field("string", required=True), "model_config": _field("object", required=True),
    "names": _field("array", required=True), "full_steps": _field("integer", required=True),
    "dtype": _field("string", required=True, choices=DTYPES), "writer": _field("string", "null"),
    "compute_dtype": _field("string", "null", choices=COMPUTE_DTYPES),
    "train_config": _field("object", "null"),
}
CACHED_STEPS = 2  # whole steps a reader keeps besides step 0: a step and the one before it


def step_file(k: int) -> str:
    return f"step_{k:06d}.safetensors"


class StepRecord(NamedTuple):
    """One line of steps.jsonl."""

    step: int
    batch_sha256: str
    loss: float
    lr: float
    grad_norm: float  # global, before clipping
    grad_norms: dict[str, float]
    grad_sums: dict[str, float]
    param_norms: dict[str, float]  # after the update
    param_sums: dict[str, float]


class FullStep(NamedTuple):
    src: np.ndarray
    tgt_in: np.ndarray
    labels: np.ndarray
    grads: Params
    params: Params


# -- writing ------------------------------------------------------------------------------------

class TraceWriter:
    """Writes a trace to `path`, a new or empty directory (nothing already there is replaced).

        with TraceWriter("trace", cfg, full_steps=5) as trace:
            trace.start(initial_params)
            for each update k = 1, 2, ...:  trace.step(k, src, tgt_in, labels, loss, lr, grads, params)
                                            trace.forward(k, stages)   # optional, whole steps
            any time after update k:        trace.evaluation(k, src, tgt_in, labels, loss)  # optional

    `grads` (before clipping) and `params` (after the update) map canonical names to arrays of
    NumPy, PyTorch or JAX; their shapes are checked against `cfg` (a torch Linear weight must be
    transposed to [in, out]). `train_config`: the settings, when known (our trainers give theirs);
    `compute_dtype`: what the forward pass computed in, when it differs from the stored tensors'
    (a bfloat16 run keeps float32 weights), for the comparison's tolerance.
    """

    def __init__(self, path: str | os.PathLike, cfg: ModelConfig, full_steps: int = 5, *,
                 train_config: Mapping[str, Any] | None = None, writer: str = "user",
                 dtype: str | None = None, compute_dtype: str | None = None):
        if isinstance(full_steps, bool) or not isinstance(full_steps, int) or full_steps < 0:
            raise ConfigError(f"full_steps must be an integer >= 0, got {full_steps!r}")
        if dtype not in (None, *DTYPES):
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)} or None, got {dtype!r}")
        if compute_dtype not in (None, *COMPUTE_DTYPES):  # the reader refuses any other
            raise ConfigError(f"compute_dtype must be one of {', '.join(COMPUTE_DTYPES)} or None, "
                              f"got {compute_dtype!r}")
        self.path, self.cfg, self.full_steps = Path(path), cfg, full_steps
        self.shapes = param_shapes(cfg)
        if self.path.exists() and (not self.path.is_dir() or any(self.path.iterdir())):
            raise RosettaError(f"trace: {self.path} already exists and is not an empty directory: "
                               f"give a new path (nothing there is replaced)")
        self.header = {"format": TRACE_FORMAT, "model_config": cfg.to_dict(), "names": list(self.shapes),
                       "full_steps": full_steps, "dtype": dtype, "writer": writer,
                       "compute_dtype": compute_dtype, "train_config": dict(train_config or {}) or None}
        self.steps_done, self.started = 0, False
        self.last_batch: tuple[np.ndarray, np.ndarray] | None = None  # the last step's src, tgt_in
        self.last_evaluation = -1  # the step of the last evaluation record
        with os_errors(self.path):
            self.path.mkdir(parents=True, exist_ok=True)
            (self.path / STEPS).write_bytes(b"")

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        pass  # every step is on disk when step() returns

    def _tensors(self, what: str, tensors: Mapping[str, Any]) -> Params:
        missing = [n for n in self.shapes if n not in tensors]
        extra = [n for n in tensors if n not in self.shapes]
        if missing or extra:
            raise RosettaError(f"trace: {what} missing {missing[:3]}, unexpected {extra[:3]}: give every "
                               f"parameter under its canonical name (rosetta.params.param_shapes)")
        out = {}
        for name, shape in self.shapes.items():
            value = to_numpy(tensors[name])
            if value.shape != tuple(shape):
                flipped = value.shape == tuple(shape)[::-1]
                hint = " (a torch Linear weight is [out, in]: transpose it)" if flipped else ""
                raise RosettaError(f"trace: {what} {name} has shape {value.shape}, expected "
                                   f"{tuple(shape)}{hint}")
            out[name] = value
        if self.header["dtype"] is None:  # the first tensors' own (float32 for a bfloat16 run's weights)
            dtype = str(next(iter(out.values())).dtype)
            self.header["dtype"] = dtype if dtype in DTYPES else "float32"
        return {n: v.astype(self.header["dtype"], copy=False) for n, v in out.items()}

    def start(self, params: Mapping[str, Any]) -> None:
        """The weights before the first update (step 0)."""
        arrays = self._tensors("initial params", params)
        atomic_write_bytes(self.path / HEADER, (json.dumps(self.header, indent=1) + "\n").encode("utf-8"))
        write_safetensors(self.path / step_file(0), {f"params.{n}": v for n, v in arrays.items()}, {})
        self.started = True

    def step(self, step: int, src: Any, tgt_in: Any, labels: Any, loss: float, lr: float,
             grads: Mapping[str, Any], params: Mapping[str, Any]) -> None:
        """Update `step` (from 1): its batch, loss, learning rate, gradients before clipping and the
        weights after the update."""
        if not self.started:
            raise RosettaError("trace: call start(initial params) before the first step")
        if step != self.steps_done + 1:
            raise RosettaError(f"trace: step {step} after step {self.steps_done}: steps go 1, 2, 3, ...")
        g, p = self._tensors(f"step {step} grads", grads), self._tensors(f"step {step} params", params)
        ids = {key: np.asarray(to_numpy(v), dtype=np.int64)
               for key, v in zip(BATCH_KEYS, (src, tgt_in, labels), strict=True)}
        norms = {n: float(np.linalg.norm(v.astype(np.float64))) for n, v in g.items()}
        record = {"step": step, "batch_sha256": batch_digest(*ids.values()), "loss": float(loss),
                  "lr": float(lr), "grad_norm": math.sqrt(sum(x * x for x in norms.values())),
                  "grad_norms": norms, "grad_sums": _sums(g),
                  "param_norms": {n: float(np.linalg.norm(v.astype(np.float64))) for n, v in p.items()},
                  "param_sums": _sums(p)}
        if step <= self.full_steps:
            write_safetensors(self.path / step_file(step),
                              {**ids, **{f"grads.{n}": v for n, v in g.items()},
                               **{f"params.{n}": v for n, v in p.items()}}, {})
        with os_errors(self.path), (self.path / STEPS).open("a", encoding="utf-8") as lines:
            lines.write(json.dumps(record) + "\n")  # one write per line: a crash leaves whole lines
        self.steps_done, self.last_batch = step, (ids["src"], ids["tgt_in"])

    def forward(self, step: int, stages: Mapping[str, Any], *, src: Any = None, tgt_in: Any = None) -> Path:
        """The stages (rosetta.diff.shared.capture's `{stage: array}`) of one forward pass on update `step`'s
        src and tgt_in with the weights before that update, dropout off; call it right after
        `step(step, ...)`, for a step stored whole. `src`/`tgt_in`, when given, must be that batch."""
        if self.last_batch is None or step != self.steps_done:
            raise RosettaError(f"trace: forward({step!r}) must follow step({step!r}), the update whose batch "
                               f"it ran on (the last step written is {self.steps_done})")
        if step > self.full_steps:
            raise RosettaError(f"trace: forward dumps are kept for the steps stored whole "
                               f"(1..{self.full_steps}), not step {step}: raise TraceWriter's full_steps")
        path = self.path / forward_file(step)
        return write_forward(path, self.cfg, step, self.last_batch, stages, src, tgt_in)

    def evaluation(self, step: int, src: Any, tgt_in: Any, labels: Any, loss: float) -> None:
        """The loop's evaluation loss after update `step` (0: before any) on a batch it chooses: the
        mean cross entropy over the labels that are not pad_id, no label smoothing, dropout off."""
        if not self.started:
            raise RosettaError("trace: call start(initial params) before the first evaluation")
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= self.steps_done:
            raise RosettaError(f"trace: evaluation after step {step!r}: steps 0..{self.steps_done} are "
                               f"written (0: before the first update)")
        if step <= self.last_evaluation:
            raise RosettaError(f"trace: an evaluation after step {step} follows one after step "
                               f"{self.last_evaluation}: at most one per step, in order")
        write_evaluation(self.path, self.cfg, step, (src, tgt_in, labels), loss)
        self.last_evaluation = step


class Tracer:
    """`rosetta train --trace N` (rosetta/harness/loop.py): a TraceWriter fed by a Trainer whose
    steps keep their gradients, started on the initial weights. Every process calls it (gathering
    sharded weights is a collective); `path` None on the processes that do not write."""

    def __init__(self, path: Path | None, cfg: ModelConfig, full_steps: int, train_config: Mapping[str, Any],
                 writer: str, trainer: Any):
        params = trainer.params()  # a collective: every process
        self.writer = None if path is None else TraceWriter(path, cfg, full_steps, train_config=train_config,
                                                            writer=writer, compute_dtype=trainer.dtype)
        if self.writer is not None:
            self.writer.start(params)

    def record(self, trainer: Any, batch: Any, metrics: dict[str, Any]) -> None:
        """The update `trainer.step(batch, keep_grads=True)` just made (its values read from the
        device here: `Trainer.read`); its `grads` leave `metrics`."""
        grads, params = metrics.pop("grads"), trainer.params()
        metrics = trainer.read(metrics)
        if self.writer is not None:
            self.writer.step(metrics["step"], batch.src, batch.tgt_in, batch.labels, metrics["loss"],
                             metrics["lr"], grads, params)


def _sums(tensors: Params) -> dict[str, float]:
    return {n: float(v.astype(np.float64).sum()) for n, v in tensors.items()}


# -- reading ------------------------------------------------------------------------------------

@dataclass
class Trace:
    path: Path
    cfg: ModelConfig
    names: list[str]
    full_steps: int  # steps stored whole: min(the header's N, the steps traced)
    dtype: str
    train_config: dict[str, Any] | None
    writer: str
    steps: list[StepRecord]
    compute_dtype: str | None = None  # the forward pass's, when the writer said it
    evaluations: list[EvalRecord] = field(default_factory=list)  # evals.jsonl's, when there is one
    _cache: OrderedDict[int, Any] = field(default_factory=OrderedDict, repr=False)

    def __len__(self) -> int:
        return len(self.steps)

    def initial(self) -> Params:
        """The weights before step 1."""
        return self._load(0)[1]

    def full(self, k: int) -> FullStep:
        """Step k (1..full_steps) whole."""
        if not 1 <= k <= self.full_steps:
            raise RosettaError(f"{self.path}: step {k} is not stored whole (steps 1..{self.full_steps} are)")
        ids, params, grads = self._load(k)
        return FullStep(*ids, grads, params)

    def forward(self, k: int) -> Dump | None:
        """Step k's forward dump (rosetta.diff.shared.dump.Dump: the stages on step k's src and tgt_in with
        the weights before update k), None when the trace holds none (dumps are of whole steps)."""
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= len(self):
            raise RosettaError(f"{self.path}: no step {k!r} (steps 1..{len(self)})")
        path = self.path / forward_file(k)
        # Absent: no dump. Anything else of that name (a folder, a dangling link) read_dump refuses by name.
        if k > self.full_steps or not (path.exists() or path.is_symlink()):
            return None
        step = self.full(k)
        return read_forward(path, self.cfg, k, step.src, step.tgt_in)

    def evaluation_batch(self, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(src, tgt_in, labels) of the evaluation after update `step`, checked against its record."""
        record = next((r for r in self.evaluations if r.step == step), None)
        if record is None:
            shown = ", ".join(str(r.step) for r in self.evaluations[:8]) or "none"
            raise RosettaError(f"{self.path}: no evaluation after step {step!r} (evaluations after steps: "
                               f"{shown})")
        return read_evaluation_batch(self.path / eval_file(step), self.cfg, record)

    def _load(self, k: int) -> tuple:
        if k in self._cache:
            self._cache.move_to_end(k)
            return self._cache[k]
        path = self.path / step_file(k)
        header = read_header(path, "trace step")
        shapes = param_shapes(self.cfg)
        groups = ("params",) if k == 0 else ("grads", "params")
        expected = {f"{g}.{n}" for g in groups for n in self.names} | (set() if k == 0 else set(BATCH_KEYS))
        if set(header.tensors) != expected:
            raise CheckpointError(f"{path}: missing {sorted(expected - set(header.tensors))[:3]}, unexpected "
                                  f"{sorted(set(header.tensors) - expected)[:3]}")
        for group in groups:  # every shape and type before any data is read: a file cannot make us allocate
            for name in self.names:
                info = header.tensors[f"{group}.{name}"]
                if tuple(info.shape) != tuple(shapes[name]) or info.dtype != np.dtype(self.dtype):
                    raise CheckpointError(f"{path}: {group}.{name} is {info.dtype} {tuple(info.shape)}, "
                                          f"expected {self.dtype} {tuple(shapes[name])}")
        if k:
            check_ids_header(path, header, self.cfg)
        tensors = read_tensors(path, header)
        out: dict[str, Params] = {}
        for group in groups:
            out[group] = {}
            for name in self.names:
                value = tensors[f"{group}.{name}"]
                if not np.isfinite(value).all():
                    raise CheckpointError(f"{path}: {group}.{name} holds NaN or infinite values "
                                          f"(step {k}): the run had diverged")
                out[group][name] = value
        ids = None
        if k:
            ids = tuple(check_ids(path, key, tensors[key], self.cfg) for key in BATCH_KEYS)
            if batch_digest(*ids) != self.steps[k - 1].batch_sha256:
                raise CheckpointError(f"{path}: its batch does not hash to step {k}'s batch_sha256 in "
                                      f"{STEPS}: the files come from different runs")
        result = (ids, out["params"], out.get("grads"))
        self._cache[k] = result
        # Step 0 stays (every comparison starts there); the least recently used others go (memory).
        for key in [key for key in self._cache if key != 0][:-CACHED_STEPS]:
            del self._cache[key]
        return result


def find_trace(path: str | os.PathLike) -> Path | None:
    """The trace directory `path` names: a trace itself, or a run directory holding `trace/`
    (`rosetta train --trace`); None when it is neither."""
    path = Path(path)
    for candidate in (path, path / "trace"):
        if any((candidate / name).exists() and not (candidate / name).is_dir() for name in (HEADER, STEPS)):
            return candidate
    return None


def read_trace(path: str | os.PathLike) -> Trace:
    """Read and check a trace (CheckpointError naming the problem). The header, every line and
    every whole step's header are checked here; a whole step's tensors when first used."""
    found = find_trace(path)
    if found is None:
        raise CheckpointError(f"{path}: not a training trace (no {HEADER}; `rosetta train --trace N` or "
                              f"rosetta.diff.training.trace.TraceWriter writes one)")
    header = _read_header(found)
    try:
        cfg = ModelConfig.from_dict(header["model_config"])
    except (RosettaError, TypeError) as e:
        raise CheckpointError(f"{found / HEADER}: model_config: {e}") from None
    if header.get("names") != list(param_shapes(cfg)):
        raise CheckpointError(f"{found / HEADER}: names are not the model's parameters in canonical order")
    steps = _read_steps(found, header["names"])
    full = min(header["full_steps"], len(steps))
    for k in range(full + 1):
        if not regular_file(found / step_file(k)):
            raise CheckpointError(f"{found}: {step_file(k)} is missing: the trace is truncated "
                                  f"(steps 0..{full} must be stored whole)")
        read_header(found / step_file(k), "trace step")
    return Trace(found, cfg, header["names"], full, header["dtype"], header.get("train_config"),
                 str(header.get("writer") or ""), steps, header.get("compute_dtype"),
                 read_evaluations(found, len(steps)))


def _read_header(folder: Path) -> dict[str, Any]:
    path = folder / HEADER
    if not regular_file(path):
        raise CheckpointError(f"{path} is missing: the trace is truncated (the writer stopped before "
                              f"its first step?)")
    header = json_input.read_json(path, "a trace header", limit=HEADER_LIMIT, error=CheckpointError)
    if header.get("format") != TRACE_FORMAT:
        raise CheckpointError(f"{path}: not a {TRACE_FORMAT} header")
    json_input.check_schema(header, HEADER_SCHEMA, str(path), CheckpointError)
    if header["full_steps"] < 0:
        raise CheckpointError(f"{path}: full_steps must be an integer >= 0, got {header['full_steps']!r}")
    return header


_NUMBERS = ("loss", "lr", "grad_norm")
_WHAT = {"loss": "loss (a cross entropy)", "lr": "learning rate", "grad_norm": "gradient norm"}
_PER_TENSOR = ("grad_norms", "grad_sums", "param_norms", "param_sums")


def _read_steps(folder: Path, names: list[str]) -> list[StepRecord]:
    path = folder / STEPS
    limit = 4096 + 4 * 64 * len(names) + sum(4 * len(n) for n in names)  # a record's longest line
    try:
        steps = [_step_record(path, number, record, names)
                 for number, record in json_lines(path, limit, "any step record of this model")]
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the trace is truncated") from None
    if not steps:
        raise CheckpointError(f"{path}: no steps: the trace is empty")
    return steps


def _step_record(path: Path, number: int, record: object, names: list[str]) -> StepRecord:
    where = f"{path}: line {number}"
    if not isinstance(record, dict) or record.get("step") != number:
        raise CheckpointError(f"{where}: expected the record of step {number}")
    if not isinstance(record.get("batch_sha256"), str):
        raise CheckpointError(f"{where}: no batch_sha256")
    for key in _NUMBERS:
        value = record.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CheckpointError(f"{where}: {key} must be a number, got {value!r}")
        if not math.isfinite(value) and key != "lr":
            raise CheckpointError(f"{where}: step {number}'s {key} is {value}: the run had diverged there "
                                  f"(compare the steps before it: --steps {number - 1})")
        if not value >= 0 or not math.isfinite(value):  # a rate (eq. 3), a cross entropy and a norm are >= 0
            raise CheckpointError(f"{where}: step {number}'s {key} is {value}: no step gives a {_WHAT[key]} "
                                  f"outside [0, inf) (the trace was edited?)")
    for key in _PER_TENSOR:
        values = record.get(key)
        if not isinstance(values, dict) or list(values) != names:
            raise CheckpointError(f"{where}: {key} must give every parameter, in canonical order")
        bad = [n for n, v in values.items() if not isinstance(v, (int, float)) or not math.isfinite(v)]
        if bad:
            raise CheckpointError(f"{where}: step {number}'s {key} of {bad[0]} is {values[bad[0]]!r}: the "
                                  f"run had diverged there (compare the steps before: --steps {number - 1})")
        bad = [n for n, v in values.items() if key.endswith("norms") and v < 0]
        if bad:
            raise CheckpointError(f"{where}: step {number}'s {key} of {bad[0]} is {values[bad[0]]!r}: no "
                                  f"step gives a norm below 0 (the trace was edited?)")
    return StepRecord(number, record["batch_sha256"], *(float(record[k]) for k in _NUMBERS),
                      *({n: float(v) for n, v in record[k].items()} for k in _PER_TENSOR))
