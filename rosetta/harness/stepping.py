"""Training steps as a GPU wants them, framework-free: the `Stepper` drives a trainer's own
`Trainer.step` (rosetta/training.py) over a batch iterator without ever making the device wait for
the host. The next batch is built and copied (`Trainer.prepare`) while the current step runs; the
step's loss and gradient norm stay on the device until `flush`, which reads them (one transfer) and
the clock of the steps since the previous flush. `rosetta train`'s loop (rosetta/harness/loop.py)
flushes at its log, evaluation and checkpoint steps; the benchmarks (benchmarks/run.py,
benchmarks/batches.py) time `Stepper.run`: the same steps, the same code.

A step's time is its stretch's: the time from the first step after a flush to the next flush
(CUDA events on a GPU, the host's clock after the device finished elsewhere), less the seconds
spent compiling, divided by the steps in the stretch. The first step of each batch shape compiles
(JAX, torch.compile) or tunes (cuDNN, cuBLAS): the loop flushes before and after it, so its time
stands alone and the medians of the log leave it out (PITFALLS 13).

The host's own seconds are kept beside it (`Stretch.host`): in `Trainer.step` (tracing, dispatch,
and any wait for the device inside a step), in drawing and copying the next batch (`prepare`:
the batch iterator and `Trainer.prepare`), and in the counts of `work`. Where their sum per step
reaches the step's time, the host, not the device, sets the pace (a loop that is host-bound).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from rosetta.training import Batch, Prepared, Trainer


@dataclass(frozen=True)
class Stepped:
    """One dispatched step: its batch, the epoch it came from, the trainer's metrics (device values
    until read), and whether its batch shape is new (it compiled, if anything did)."""

    batch: Batch
    epoch: int
    metrics: dict[str, Any]
    first_of_shape: bool


@dataclass(frozen=True)
class Stretch:
    """What a flush read: the steps dispatched since the previous flush."""

    steps: int
    seconds: float  # their time on the device, compilation excluded
    compile_s: float  # seconds compiling during them
    compiles: int  # programs compiled during them (read from a persistent cache: not counted)
    last: dict[str, Any]  # the last step's metrics, read: floats, and `non_finite`
    work: dict[str, float] = field(default_factory=dict)  # `work(batch)` summed over their batches
    # The host's seconds over the stretch in each of HOST_PHASES (the module docstring).
    host: dict[str, float] = field(default_factory=dict)

    @property
    def step_seconds(self) -> float:
        return self.seconds / max(self.steps, 1)

    def host_seconds(self, phase: str) -> float:
        """The host's seconds per step in `phase` (one of HOST_PHASES) over this stretch."""
        return self.host.get(phase, 0.0) / max(self.steps, 1)

    def add_to(self, totals: dict[str, float]) -> None:
        """Add this stretch to a run's running totals (its checkpoints keep them, for a resume)."""
        for key, value in (("step_time_s", self.seconds), ("compile_s", self.compile_s),
                           ("compiles", self.compiles), ("src_tokens", self.work["src_tokens"]),
                           ("tgt_tokens", self.work["tgt_tokens"])):
            totals[key] = totals.get(key, 0) + value


# What the host does for each step (Stretch.host): dispatch the step, draw and copy the next batch,
# count the batch's work.
HOST_PHASES = ("step", "prepare", "work")


class Stepper:
    """`trainer.step` over `batches`, one batch prepared ahead. `batches` is an iterator of Batch;
    a BatchIterator (rosetta/harness/batching.py) also gives its epoch and, through `data_state`,
    the position a checkpoint of the last step resumes from. `work(batch)`: counts to sum over a
    stretch's batches (tokens, FLOPs: rosetta/harness/metrics.py batch_work), on the host while the
    device computes."""

    def __init__(self, trainer: Trainer, batches: Iterator[Batch],
                 work: Callable[[Batch], Mapping[str, float]] | None = None):
        self.trainer, self.batches, self.work = trainer, batches, work
        self.shapes: set[tuple[int, int]] = set()
        self.data_state = self._state()
        self._reset()
        self._next = self._draw()

    def _state(self) -> Any:
        return self.batches.state_dict() if hasattr(self.batches, "state_dict") else None

    def _draw(self) -> tuple[Batch, int, Prepared] | None:
        start = time.perf_counter()
        epoch = getattr(self.batches, "epoch", 0)
        batch = next(self.batches, None)
        drawn = None if batch is None else (batch, epoch, self.trainer.prepare(batch))
        self._host["prepare"] += time.perf_counter() - start
        return drawn

    def _reset(self) -> None:
        self._timer, self._last = None, None
        self._steps = self._compiles = 0
        self._compile_s = 0.0
        self._work: dict[str, float] = {}
        self._host = dict.fromkeys(HOST_PHASES, 0.0)

    @property
    def pending(self) -> int:
        """Steps dispatched since the last flush."""
        return self._steps

    @property
    def next_is_new_shape(self) -> bool:
        return self._next is not None and self._next[0].shape not in self.shapes

    def step(self, keep_grads: bool = False) -> Stepped:
        """Dispatch the step of the prepared batch, then prepare the next one while it runs."""
        if self._next is None:
            raise RuntimeError("the batches ran out")  # BatchIterator never does; a finite list can
        batch, epoch, prepared = self._next
        first = batch.shape not in self.shapes
        self.shapes.add(batch.shape)
        if self._timer is None:
            self._timer = self.trainer.timer()
        seconds, programs = self.trainer.compilation()
        start = time.perf_counter()
        metrics = self.trainer.step(prepared, keep_grads=keep_grads)
        dispatched = time.perf_counter()
        after_seconds, after_programs = self.trainer.compilation()
        self._compile_s += after_seconds - seconds
        self._compiles += after_programs - programs
        # Compiling is the step's host time too, but it has its own count: left out here.
        self._host["step"] += max(dispatched - start - (after_seconds - seconds), 0.0)
        self._steps += 1
        for key, value in (self.work(batch) if self.work else {}).items():
            self._work[key] = self._work.get(key, 0) + value
        self._host["work"] += time.perf_counter() - dispatched
        self._last = metrics
        self.data_state = self._state()  # after this batch: where a checkpoint of this step resumes
        self._next = self._draw()
        return Stepped(batch, epoch, metrics, first)

    def flush(self) -> Stretch:
        """Wait for the steps dispatched so far and read the last one's values and the clock."""
        if self._last is None:
            raise RuntimeError("flush before any step")
        self._timer.stop()
        last = self.trainer.read(self._last)
        seconds = self._timer.seconds()
        stretch = Stretch(self._steps, max(seconds - self._compile_s, 0.0), self._compile_s, self._compiles,
                          last, self._work, self._host)
        self._reset()
        return stretch

    def run(self, steps: int) -> Stretch:
        """`steps` steps, flushed: what the benchmarks time (a flush before, so the clock starts here)."""
        if self._last is not None:
            self.flush()
        for _ in range(steps):
            self.step()
        return self.flush()


def cycle(batches: list[Batch]) -> Iterator[Batch]:
    """The benchmarks' batches, over and over."""
    while True:
        yield from batches
