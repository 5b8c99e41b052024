"""`rosetta train --time-budget MINUTES`: the training loop's own clock, across resumes (each
checkpoint keeps the seconds so far), and whether the budget is spent. Under a launcher of
several processes the question is a collective (each process reads its own clock), so that every
process stops at the same step."""

from __future__ import annotations

import time

from rosetta.training import Trainer


class Budget:
    """The loop's seconds since `elapsed0` (a resumed run's), and `spent()` against `minutes`
    (None: no budget, never spent)."""

    def __init__(self, minutes: float | None, elapsed0: float, trainer: Trainer):
        self.minutes, self.elapsed0, self.trainer = minutes, elapsed0, trainer
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return self.elapsed0 + time.perf_counter() - self.start

    def spent(self) -> bool:
        """Every process asks at the same point (`Trainer.any_process`, a collective under a launcher)."""
        return self.minutes is not None and self.trainer.any_process(self.elapsed() >= 60 * self.minutes)
