"""The training recipe (SPEC §4), framework-free: the hyperparameters both trainable backends
read, the names of the ways to compute the loss, the learning-rate schedule of the paper (§5.3,
eq. 3), the batch a training step takes (and `Prepared`, the same batch already on the device),
the check every trainer applies to the optimizer state it is asked to resume from, `Trainer`, the
protocol every trainer follows, and `HostTimer`, the clock of a trainer without device events.

torch_impl/train.py and jax_impl/train.py implement the loss, the optimizer and one training
step from these, identically; parity_tests/test_training_math.py checks that they agree.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

from rosetta.config import parse_json, strict_from_dict
from rosetta.errors import CheckpointError, ConfigError, RosettaError
from rosetta.inputs import Packing

if TYPE_CHECKING:
    from rosetta.backends import BackendModel
    from rosetta.distributed import LaunchEnv
    from rosetta.params import Params

# `rosetta train --loss`: the logits then the loss, or the output projection and the loss chunk by
# chunk without the [tokens, V] logits (docs/loss.md). Each trainer maps the names to its functions.
LOSSES: tuple[str, ...] = ("plain", "chunked")
# The one default of `--loss` and of every trainer's `loss` argument. Plain on every device for now:
# whether the chunked loss (bfloat16 GEMMs, no [tokens, V] logits) is faster on a GPU is not
# measured; the GPU session's measurement decides the GPU default (docs/loss.md).
DEFAULT_LOSS = "plain"


@dataclass(frozen=True)
class TrainConfig:
    """Defaults are the paper's: label smoothing 0.1 (§5.4), Adam(0.9, 0.98, 1e-9) and 4000
    warmup steps (§5.3). `clip_norm` None means no gradient clipping."""

    label_smoothing: float = 0.1
    warmup_steps: int = 4000
    lr_factor: float = 1.0
    adam_b1: float = 0.9
    adam_b2: float = 0.98
    adam_eps: float = 1e-9
    clip_norm: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        _validate(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        return strict_from_dict(cls, data, "train config")

    @classmethod
    def from_json(cls, text: str) -> TrainConfig:
        return cls.from_dict(parse_json(text, "train config"))

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)


def _is_number(value: object) -> bool:
    # bool is a subclass of int: `lr_factor=True` is a mistake, not 1.
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _validate(cfg: TrainConfig) -> None:
    if not _is_number(cfg.label_smoothing) or not 0.0 <= cfg.label_smoothing < 1.0:
        raise ConfigError(f"label_smoothing must be a number in [0, 1), got {cfg.label_smoothing!r}")
    if not _is_int(cfg.warmup_steps) or cfg.warmup_steps < 1:
        raise ConfigError(f"warmup_steps must be an integer >= 1, got {cfg.warmup_steps!r}")
    if not _is_number(cfg.lr_factor) or cfg.lr_factor <= 0:
        raise ConfigError(f"lr_factor must be a positive number, got {cfg.lr_factor!r}")
    for name in ("adam_b1", "adam_b2"):
        value = getattr(cfg, name)
        if not _is_number(value) or not 0.0 <= value < 1.0:
            raise ConfigError(f"{name} must be a number in [0, 1), got {value!r}")
    if not _is_number(cfg.adam_eps) or cfg.adam_eps <= 0:
        raise ConfigError(f"adam_eps must be a positive number, got {cfg.adam_eps!r}")
    if cfg.clip_norm is not None and (not _is_number(cfg.clip_norm) or cfg.clip_norm <= 0):
        raise ConfigError(f"clip_norm must be a positive number or null, got {cfg.clip_norm!r}")
    if not _is_int(cfg.seed) or cfg.seed < 0:
        raise ConfigError(f"seed must be an integer >= 0, got {cfg.seed!r}")


def learning_rate(step: int, d_model: int, warmup_steps: int = 4000, factor: float = 1.0) -> float:
    """lr = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), the paper's eq. 3,
    `step` counted from 1 (the first optimizer update is step 1): linear warmup, peak at
    step == warmup_steps, then inverse-square-root decay."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 1:
        raise ConfigError(f"step must be an integer >= 1 (counted from 1), got {step!r}")
    step = int(step)
    return factor * d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)


@dataclass(frozen=True)
class Batch:
    """One batch. Arrays are int64 of shape `[rows, L]` for the batch's bucket length `L`.

    `src`: source ids then pad. `tgt_in`: `[bos, y1..yn, pad...]`. `labels`:
    `[y1..yn, eos, pad...]`. `indices[r]`: the position of row r's pair in the list given to
    the batcher, or -1 for a row that is all padding. `num_src_tokens` / `num_tgt_tokens`:
    non-pad entries of `src` / `labels` (the latter is the loss denominator of SPEC §4).

    Packed batches (docs/packing.md: several pairs per row) also hold `src_segments`,
    `tgt_segments` (segment ids 1..n per row, 0 on padding; a pair's source and target share
    one) and `src_positions`, `tgt_positions` (restarting at 0 per segment), all `[rows, L]`,
    and `indices` is `[rows, L]`: `indices[r, k]` the pair of segment k + 1 of row r, or -1.
    """

    src: np.ndarray
    tgt_in: np.ndarray
    labels: np.ndarray
    indices: np.ndarray
    num_src_tokens: int
    num_tgt_tokens: int
    src_segments: np.ndarray | None = None
    tgt_segments: np.ndarray | None = None
    src_positions: np.ndarray | None = None
    tgt_positions: np.ndarray | None = None

    @property
    def packed(self) -> bool:
        return self.src_segments is not None

    def packing(self) -> Packing | None:
        """The model's `packing` argument (`forward(src, tgt_in, packing=batch.packing())`, after
        conversion to the backend's arrays); None for an unpacked batch."""
        if not self.packed:
            return None
        return Packing(self.src_segments, self.tgt_segments, self.src_positions, self.tgt_positions)

    @property
    def num_examples(self) -> int:
        """Rows holding a real pair (the others are all padding)."""
        return int((self.indices >= 0).sum())

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.src.shape[0]), int(self.src.shape[1]))


@dataclass(frozen=True)
class Prepared:
    """`batch` with its arrays on the trainer's device(s), copied without waiting
    (`Trainer.prepare`): what `Trainer.step` takes, built while the previous step runs."""

    batch: Batch
    arrays: Any  # the trainer's own: its micro-batches as framework arrays


class HostTimer:
    """A stretch of steps timed by the host's clock: from its creation to `seconds()`, which the
    caller reads once the device has finished them (after `Trainer.read`). `stop()` marks the end of
    the stretch for a device clock (events); the host's reads the time when asked."""

    def __init__(self) -> None:
        self._start = time.perf_counter()

    def stop(self) -> None: ...

    def seconds(self) -> float:
        return time.perf_counter() - self._start


def check_trainer_args(backend: str, dtypes: tuple[str, ...], dtype: str, loss: str, accumulate: int) -> None:
    """The arguments every Trainer refuses alike (a caller that builds one directly; `rosetta
    train` refused the flags already, rosetta/harness/run_config.py: check_run)."""
    if dtype not in dtypes:
        raise RosettaError(f"the {backend} trainer computes in {', '.join(dtypes)}, not {dtype!r}")
    if loss not in LOSSES:
        raise RosettaError(f"loss must be one of {', '.join(LOSSES)}, got {loss!r}")
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise RosettaError(f"accumulate (micro-batches per update) must be an integer >= 1, "
                           f"not {accumulate!r}")


def check_state(state: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]],
                framework: str) -> None:
    """Refuse trainer state whose keys or shapes differ from what this trainer holds, or whose
    floating-point values (Adam's moments, the learning rate) are not all finite: resuming from
    them would poison every weight at the first update."""
    missing, extra = sorted(set(shapes) - set(state)), sorted(set(state) - set(shapes))
    if missing or extra:
        raise CheckpointError(f"{framework} trainer state does not match this trainer: missing "
                              f"{missing[:3]}, unexpected {extra[:3]} (another framework or config?)")
    for key, shape in shapes.items():
        if tuple(np.shape(state[key])) != tuple(shape):
            raise CheckpointError(f"{framework} trainer state {key} has shape {np.shape(state[key])}, "
                                  f"expected {tuple(shape)}")
    for key in shapes:
        value = np.asarray(state[key])
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            bad = int(np.size(value) - np.isfinite(value).sum())
            raise CheckpointError(f"{framework} trainer state {key} holds {bad} NaN or infinite value(s) "
                                  f"of {np.size(value)}: refusing to resume from it")


class Trainer(Protocol):
    """What rosetta/harness/loop.py drives: torch_impl/train.py's and jax_impl/train.py's
    `Trainer` (and peer_impl/train.py's), built as Trainer(cfg, params, train_cfg, device=,
    dtype=, accumulate=, shard=, num_devices=, loss=, compile=, compile_cache=) from canonical weights.

    A step does not wait for the device: its loss, learning rate and gradient norm stay there until
    `read` fetches them (at the harness's log steps), so the device never idles while the host reads
    a number; the trainer keeps, on the device, the first step whose loss or gradient norm was not
    finite, and `read` reports it."""

    framework: ClassVar[str]  # "torch", "jax", "peer"
    dtypes: ClassVar[tuple[str, ...]]  # the compute dtypes it trains in
    device_name: str
    world_size: int  # data-parallel workers (devices or processes)
    num_processes: int
    is_main: bool  # process 0: the one that writes
    accumulate: int  # micro-batches per update
    shard: bool  # parameters and optimizer state split over the workers

    @staticmethod
    def resolve_device(name: str | None, env: LaunchEnv) -> str:
        """The device a trainer built with `device=name` in the launch `env` would take, checked by
        the framework as the constructor checks it (rosetta train's preflight, before anything is
        written): a RosettaError of one line if this machine lacks it. JAX under a launcher cannot
        look before the processes join: it checks the name's spelling only (rosetta/device.py)."""

    @property
    def step_count(self) -> int:
        """Updates done so far."""

    def prepare(self, batch: Batch) -> Prepared:
        """`batch` split into this process's micro-batches and copied to the device(s), not waiting
        for the copy (pinned host memory on a GPU)."""

    def step(self, batch: Batch | Prepared, keep_grads: bool = False) -> dict[str, Any]:
        """One update on the global `batch`: {step, loss, lr, grad_norm, token counts, world_size,
        worker_rows}, loss, lr and grad_norm as device values (`read` gives floats); with
        `keep_grads` also `grads`, the canonical gradients before clipping (`rosetta train --trace`,
        rosetta/diff/training/trace.py: that step waits for the device)."""

    def read(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """`metrics` of a step with its device values as floats, and `non_finite`: None, or
        {step, loss, grad_norm} of the first step so far whose loss or gradient norm was not finite.
        One transfer from the device, which waits for every step dispatched before it."""

    def timer(self) -> HostTimer:
        """A clock for a stretch of steps starting now: device events where the trainer has them
        (CUDA), else HostTimer."""

    def compilation(self) -> tuple[float, int]:
        """(seconds, programs) this process has spent compiling so far, and how many programs it
        compiled (persistent-cache reads not counted): a step's share is the difference around it."""

    def any_process(self, flag: bool) -> bool:
        """Whether `flag` holds on any process of the launch."""

    def eval_loss(self, batches: Iterable[Batch]) -> float:
        """The label-smoothed loss without dropout, token-weighted over `batches`."""

    def params(self) -> Params:
        """The current weights, canonical."""

    def backend_model(self) -> BackendModel:
        """A backend model on a copy of the current weights (generate, logits)."""

    def peak_memory_bytes(self) -> int: ...

    def state_dict(self) -> dict[str, np.ndarray]:
        """Everything besides the weights an exact resume needs."""

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None: ...
