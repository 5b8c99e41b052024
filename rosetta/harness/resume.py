"""A run's checkpoints, as the training loop (rosetta/harness/loop.py) writes and resumes them: each
step-N checkpoint (rosetta/harness/run_dir.py: written whole or not at all) holds the weights
(model.safetensors), the trainer's state (trainer_state.safetensors: Adam's moments, the
generators), state.json (the step, the batch iterator's position, the time and totals so far, the
settings) and the tokenizer of a text task. A resume reads every file of the newest checkpoint and
checks it; one it cannot start from (truncated, corrupt, holding NaN moments) is refused with the
newest earlier checkpoint that is intact and how to resume from that one.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from rosetta.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from rosetta.config import ModelConfig
from rosetta.errors import CheckpointError, RosettaError
from rosetta.files import atomic_write_bytes
from rosetta.harness.out_dir import os_errors
from rosetta.harness.report import read_json, read_log, write_log
from rosetta.harness.run_dir import (
    check_checkpoint_dir,
    checkpoint_name,
    clean_temporaries,
    latest_checkpoint,
    list_checkpoints,
    save_checkpoint_dir,
)
from rosetta.harness.trainer_state import load_trainer_state, save_trainer_state
from rosetta.tokenizer import TextTokenizer
from rosetta.training import Trainer

CHECKPOINT_FORMAT = "rosetta-train-checkpoint/1"  # state.json's
log = logging.getLogger(__name__)


class DivergedError(RosettaError):
    """A training step gave a non-finite loss or gradient norm; the run stopped before saving it."""


class Checkpoints:
    """`run_dir`/checkpoints of one backend's run; `main`: the process that writes (0)."""

    def __init__(self, run_dir: Path, backend: str, cfg: ModelConfig, main: bool,
                 tokenizer: TextTokenizer | None):
        self.run_dir, self.root = run_dir, run_dir / "checkpoints"
        self.backend, self.cfg, self.main, self.tokenizer = backend, cfg, main, tokenizer

    def refuse_diverged(self, values: dict[str, Any]) -> None:
        """Stop at the first non-finite loss or gradient norm (`values["non_finite"]`: Trainer.read's,
        kept by the trainer on the device: rosetta/training.py). That step's update has already
        poisoned the weights in memory, so nothing of it may reach a checkpoint or the log, and every
        later step would only repeat it: the last good checkpoint stays `latest`."""
        bad = values["non_finite"]
        if bad is None:
            return
        good = latest_checkpoint(self.root)
        kept = (f"the last good checkpoint, {good.name}, stays latest" if good is not None
                else "no checkpoint was written before it")
        raise DivergedError(f"{self.backend}: training diverged at step {bad['step']} (loss {bad['loss']}, "
                            f"gradient norm {bad['grad_norm']}): stopped without saving that step; {kept} (a "
                            f"lower --lr-factor, a longer --warmup or --clip-norm may help)")

    @contextlib.contextmanager
    def kept_on_failure(self, step: int, what: str, trainer: Trainer,
                        rescue: Callable[[], Any] | None = None) -> Iterator[None]:
        """An evaluation that fails, whatever raised, as one line naming the checkpoint the run keeps
        and how to finish (--resume evaluates it again; translate reads it). The last step's checkpoint
        is written before its evaluation; another step's, `rescue`, when its evaluation fails (in one
        process only: in a launch, saving is a collective the other processes may not join)."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - any failure of decoding or scoring: the trained steps stay
            if rescue is not None and trainer.num_processes == 1:
                with contextlib.suppress(Exception):  # the evaluation's error is the one to report
                    rescue()
            kept = latest_checkpoint(self.root, check=False)
            where = (f"the run is kept at {kept}: --resume goes on from there"
                     if kept is not None else "no checkpoint was written yet")
            first = str(e).strip().splitlines()[0] if str(e).strip() else "no message"
            raise RosettaError(f"{self.backend}: the {what} at step {step} failed ({type(e).__name__}: "
                               f"{first}); {where}") from e

    def begin(self, record: dict[str, Any], log_path: Path) -> None:
        """A new run's directory: run.json (`record`), a text task's tokenizer.json, an empty log."""
        with os_errors(self.run_dir, "write the run directory"):
            self.run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(self.run_dir / "run.json", json.dumps(record, indent=2).encode("utf-8"))
            if self.tokenizer is not None:
                self.tokenizer.save(self.run_dir / "tokenizer.json")
            write_log(log_path, [])

    # -- resume ----------------------------------------------------------------------------
    def trim_log(self, log_path: Path, step: int) -> set[str]:
        """The run's log cut back to checkpoint `step` (later records are redone by the resumed run);
        the kinds of record it keeps at that step ("eval", "eval_average": what need not be redone)."""
        with os_errors(log_path, "write"):
            kept = [r for r in read_log(log_path) if r.get("step", 0) <= step]
            write_log(log_path, kept)
        return {r.get("kind") for r in kept if r.get("step") == step}

    def resume(self, build: Callable[[dict], Trainer]) -> tuple[Trainer, dict[str, Any], Path] | None:
        """The trainer `build(params)` makes from the newest checkpoint, its state restored, the
        checkpoint's state.json and its directory; None when there is none yet (leftover
        temporaries removed first)."""
        if self.main:
            clean_temporaries(self.root)
        ckpt_dir = latest_checkpoint(self.root, check=False)  # `_read` checks it
        if ckpt_dir is None:
            return None
        try:
            state, ckpt, trainer_state = self._read(ckpt_dir)
        except RosettaError as e:
            raise self._unusable(ckpt_dir, e) from None
        if ckpt.config != self.cfg:
            raise RosettaError(f"cannot resume {self.run_dir}: its checkpoint's model config differs from "
                               f"this command's ({ckpt_dir / 'model.safetensors'})")
        trainer = build(ckpt.params)
        try:
            trainer.load_state_dict(trainer_state)  # refuses non-finite optimizer moments
            if trainer.step_count != state["step"]:
                raise CheckpointError(f"{ckpt_dir}: trainer state at step {trainer.step_count}, "
                                      f"state.json {state['step']}")
        except RosettaError as e:
            raise self._unusable(ckpt_dir, e) from None
        if state.get("world_size", 1) != trainer.world_size:
            log.warning("%s: resuming a run saved with %s data-parallel workers on %d: the global batches "
                        "and so the updates are the same (up to rounding in the reductions); dropout masks "
                        "are drawn differently from an uninterrupted run", self.backend,
                        state.get("world_size", 1), trainer.world_size)
        return trainer, state, ckpt_dir

    def _read(self, ckpt_dir: Path) -> tuple[dict[str, Any], Checkpoint, dict[str, np.ndarray]]:
        """What a resume from `ckpt_dir` reads, each file read and checked: the directory is what
        its name says, state.json, model.safetensors, trainer_state.safetensors (a RosettaError
        naming the file otherwise)."""
        check_checkpoint_dir(ckpt_dir)
        state = read_json(ckpt_dir / "state.json")
        if not (isinstance(state, dict) and isinstance(state.get("step"), int) and "data" in state):
            raise CheckpointError(f"{ckpt_dir / 'state.json'}: holds no step and data position")
        ckpt = load_checkpoint(ckpt_dir / "model.safetensors")
        trainer_state = load_trainer_state(ckpt_dir / "trainer_state.safetensors", self.backend)
        return state, ckpt, trainer_state

    def _intact(self, ckpt_dir: Path) -> bool:
        """Whether a resume could start from `ckpt_dir`: its files read, and its trainer state is
        finite (the check the trainers make when they load it: rosetta/training.py check_state)."""
        try:
            _, ckpt, trainer_state = self._read(ckpt_dir)
        except RosettaError:
            return False
        return ckpt.config == self.cfg and all(
            np.isfinite(v).all() for v in trainer_state.values() if np.asarray(v).dtype.kind == "f")

    def _unusable(self, ckpt_dir: Path, error: RosettaError) -> CheckpointError:
        """The refusal of a checkpoint a resume cannot start from (truncated, corrupt, poisoned):
        the error, the newest earlier checkpoint that is intact, and how to resume from that one.
        `latest` falls back to the newest checkpoint directory left, so moving the newer ones
        away is the whole of it (rosetta/harness/run_dir.py: latest_checkpoint)."""
        what = str(error) if str(ckpt_dir) in str(error) else f"{ckpt_dir}: {error}"
        found = list_checkpoints(self.root)
        for step, earlier in reversed([(n, p) for n, p in found if p.name < ckpt_dir.name]):
            if self._intact(earlier):
                newer = [p.name for _, p in found if p.name > earlier.name]
                names = " and ".join(newer)
                return CheckpointError(
                    f"{what}; the previous checkpoint {earlier} is intact: move {names} out of "
                    f"{self.root} (or delete {'it' if len(newer) == 1 else 'them'}) and run again with "
                    f"--resume to continue from step {step}")
        return CheckpointError(f"{what}; no earlier checkpoint in {self.root} is intact to resume from")

    # -- save --------------------------------------------------------------------------------
    def save(self, trainer: Trainer, state: dict[str, Any], keep: int) -> Path | None:
        """Checkpoint the trainer's current step with `state` (state.json's other fields: the dtype,
        the iterator's position, the time, the totals, the workers, the settings), keeping the
        newest `keep`.
        Every process calls it (gathering sharded weights and optimizer state is a collective);
        process 0 writes."""
        step = trainer.step_count
        params, trainer_state = trainer.params(), trainer.state_dict()
        if not self.main:
            return None
        record = {"format": CHECKPOINT_FORMAT, "step": step, "backend": self.backend, **state}

        def write(tmp: Path) -> None:
            save_checkpoint(tmp / "model.safetensors", self.cfg, params,
                            metadata={"step": str(step), "backend": self.backend})
            save_trainer_state(tmp / "trainer_state.safetensors", trainer_state, self.backend)
            atomic_write_bytes(tmp / "state.json", json.dumps(record, indent=2).encode("utf-8"))
            if self.tokenizer is not None:
                self.tokenizer.save(tmp / "tokenizer.json")

        # A full disk or a read-only directory: the checkpoints already there stay intact and
        # `latest` keeps naming the newest of them (save_checkpoint_dir removes its temporary).
        with os_errors(self.root / checkpoint_name(step), "write checkpoint"):
            return save_checkpoint_dir(self.root, step, write, keep)
