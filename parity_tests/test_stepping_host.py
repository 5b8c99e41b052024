"""The host's seconds per step that the harness's Stepper records beside the step time
(rosetta/harness/stepping.py: Stretch.host; log.jsonl's host_step_s, host_prepare_s, host_work_s),
so that a loop bound by its host (issue 45, item 9: the JAX loop's step 1.25x its benchmark's on an
H100) shows it. A scripted trainer advances a fake clock by known amounts in each phase: the
expected seconds are those amounts, not anything the Stepper computed."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from rosetta.harness import stepping
from rosetta.harness.stepping import HOST_PHASES, Stepper
from rosetta.training import Batch, Prepared

STEP_S, PREPARE_S, WORK_S, COMPILE_S = 0.005, 0.002, 0.0005, 0.25


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class ScriptedTrainer:
    """Each call costs the fake clock a fixed time; the first step also 'compiles' COMPILE_S."""

    def __init__(self, clock: Clock) -> None:
        self.clock, self.compiled, self.programs = clock, 0.0, 0

    def prepare(self, batch: Batch) -> Prepared:
        self.clock.now += PREPARE_S
        return Prepared(batch, None)

    def step(self, prepared: Prepared, keep_grads: bool = False) -> dict:
        if not self.programs:  # compiling is host time, counted apart from the step's
            self.compiled += COMPILE_S
            self.programs += 1
            self.clock.now += COMPILE_S
        self.clock.now += STEP_S
        return {"loss": 0.0}

    def compilation(self) -> tuple[float, int]:
        return self.compiled, self.programs

    def timer(self):
        start = self.clock.now
        return type("T", (), {"stop": lambda _: None, "seconds": lambda _: self.clock.now - start})()

    def read(self, metrics: dict) -> dict:
        return metrics


def work(clock: Clock):
    def count(batch: Batch) -> dict[str, float]:
        clock.now += WORK_S
        return {"tgt_tokens": 1.0}
    return count


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(stepping.time, "perf_counter", clock)
    return clock


def batches():
    ids = np.ones((2, 3), dtype=np.int64)
    return itertools.repeat(Batch(ids, ids, ids, np.arange(2), 6, 6))


def test_host_seconds_per_phase(clock):
    stepper = Stepper(ScriptedTrainer(clock), batches(), work(clock))
    first = stepper.run(1)  # compiles: its compile seconds are not the step's host time
    assert first.host_seconds("step") == pytest.approx(STEP_S)
    assert first.compile_s == pytest.approx(COMPILE_S)
    stretch = stepper.run(4)
    assert set(stretch.host) == set(HOST_PHASES)
    assert stretch.host_seconds("step") == pytest.approx(STEP_S)
    assert stretch.host_seconds("prepare") == pytest.approx(PREPARE_S)  # the batch after each step
    assert stretch.host_seconds("work") == pytest.approx(WORK_S)
    # The stretch's own time is everything the host spent: here, a host-bound loop.
    assert stretch.step_seconds == pytest.approx(STEP_S + PREPARE_S + WORK_S)
