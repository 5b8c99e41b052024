"""The shared training loop: one loop trains PyTorch and JAX on the same data, from the same
initial weights (rosetta.init_params), with the same schedule, through each framework's
`Trainer` adapter (torch_impl/train.py, jax_impl/train.py). Framework-free itself: a framework
is imported only when its trainer is built.

    from rosetta.harness.loop import RunConfig, train
    results = train(RunConfig(backends=("torch", "jax"), task="copy", steps=300, out="runs/copy"))

Per backend `b`, `out/b/` holds `run.json` (settings), `log.jsonl` (one JSON record per logged
step and per evaluation), `checkpoints/` (rosetta/harness/run_dir.py), `result.json`, `plot.png`,
`tokenizer.json` for text tasks, `trace/` with --trace; `out/` holds the combined `plot.png`,
`summary.json`, `summary.md`, and `.rosetta.lock` (a second process stays out while a run holds it).
Nothing the harness did not write is overwritten or deleted (a user's own summary.md, a stray file
in a run directory given to --overwrite): such files are refused by name before training starts.
A file system error (read-only, full) is one line naming the path.
Batching is by token budget (paper §5.1, rosetta/harness/batching.py),
the optimizer and schedule are §5.3's, label smoothing and dropout §5.4's.

Many devices (docs/distributed.md): the token budget is the global batch's; every process builds
the same global batch and its trainer trains on its own blocks (rosetta/distributed.py). Every
process runs the same loop (the steps, the evaluations: identical on each) and calls the
collectives (`params()`, `state_dict()`) together; only process 0 touches `out/`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from rosetta.backends import BACKENDS, from_params, get_trainer
from rosetta.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from rosetta.config import ModelConfig, preset
from rosetta.diff.trace import Tracer
from rosetta.distributed import LaunchEnv, launch_env
from rosetta.errors import CheckpointError, RosettaError
from rosetta.files import atomic_write_bytes
from rosetta.harness.batching import Batch, BatchIterator, eval_batches
from rosetta.harness.evaluate import score_batches
from rosetta.harness.metrics import batch_work, peak_flops, train_record
from rosetta.harness.out_dir import check_out_dirs, os_errors
from rosetta.harness.preflight import check_backends
from rosetta.harness.report import (
    RESULT_FORMAT,
    NoProgress,
    check_overwritable,
    progress_bar,
    read_json,
    read_log,
    summarize,
    write_combined_report,
    write_log,
    write_plot,
)
from rosetta.harness.run_config import DEFAULT_STEPS, RunConfig, check_run
from rosetta.harness.run_dir import (
    check_checkpoint_dir,
    checkpoint_name,
    clean_temporaries,
    latest_checkpoint,
    list_checkpoints,
    out_dir_lock,
    save_checkpoint_dir,
)
from rosetta.harness.stepping import Stepper, Stretch
from rosetta.harness.tasks import TaskData, load_task
from rosetta.harness.trainer_state import load_trainer_state, save_trainer_state
from rosetta.params import init_params
from rosetta.training import Trainer

log = logging.getLogger(__name__)

RUN_FORMAT = "rosetta-run/1"

class DivergedError(RosettaError):
    """A training step gave a non-finite loss or gradient norm; the run stopped before saving it."""


# -- Data, model, evaluation -----------------------------------------------------------------

def _model_config(run: RunConfig, task: TaskData) -> ModelConfig:
    overrides = dict(run.overrides)
    if task.tokenizer is not None:  # the joint BPE vocabulary sizes both tables (§5.1)
        size = task.tokenizer.vocab_size
        overrides |= {"src_vocab_size": size, "tgt_vocab_size": size}
    return preset(run.preset, **overrides)


def _load_task(run: RunConfig) -> TaskData:
    """The task's data; on --resume a text task reloads the run's own tokenizer."""
    tokenizer_path = None
    if run.resume and run.task == "multi30k":
        paths = [Path(run.out) / b / "tokenizer.json" for b in run.backends]
        texts = {p.read_text(encoding="utf-8") if p.is_file() else None for p in paths}
        if None in texts or len(texts) != 1:
            raise RosettaError(f"--resume: the runs in {run.out} do not share one tokenizer.json")
        tokenizer_path = paths[0]
    base = preset(run.preset, **run.overrides)
    return load_task(run.task, vocab_size=min(base.src_vocab_size, base.tgt_vocab_size), seed=run.seed,
                     train_size=run.train_size, eval_size=run.eval_size, eval_split=run.eval_split,
                     pair=run.pair, data_dir=run.data_dir,
                     bpe_vocab_size=run.vocab_size, tokenizer_path=tokenizer_path,
                     synthetic_max_len=run.synthetic_max_len)


def _batching(run: RunConfig, cfg: ModelConfig) -> dict[str, Any]:
    return dict(max_len=cfg.max_len, buckets=run.buckets, pad_id=cfg.pad_id, bos_id=cfg.bos_id,
                eos_id=cfg.eos_id)


def evaluate(trainer: Trainer, task: TaskData, loss_batches: list[Batch], gen_batches: list[Batch],
             num_gen: int, run: RunConfig) -> dict[str, Any]:
    """Validation loss, and BLEU (rosetta/harness/evaluate.py: score_batches) of `model.generate`
    through the backend interface: greedy by default, beam search with `run.beam` > 1."""
    start = time.perf_counter()
    val_loss = trainer.eval_loss(loss_batches)
    scores = score_batches(trainer.backend_model(), task, gen_batches, num_gen, run.beam, run.alpha,
                           run.max_len_margin)
    return {"val_loss": val_loss, **scores, "eval_time_s": time.perf_counter() - start}


# -- One backend -----------------------------------------------------------------------------

class _Run:
    """One backend's training run in `out/<backend>/`; in a launch of several processes, this
    process's part of it (only process 0, `self.main`, writes)."""

    def __init__(self, run: RunConfig, backend: str, task: TaskData, cfg: ModelConfig, params0: dict,
                 env: LaunchEnv, baseline: dict[str, Any] | None = None):
        self.run, self.backend, self.task, self.cfg = run, backend, task, cfg
        self.env, self.main = env, env.is_main
        # The one-device run's median tokens/s that scaling efficiency divides by (--baseline).
        self.baseline = (baseline or {}).get(backend, {}).get("median_tgt_tokens_per_s")
        self.dir = Path(run.out) / backend
        self.ckpt_root = self.dir / "checkpoints"
        self.log_path = self.dir / "log.jsonl"
        self.train_cfg = run.train_config()
        batching = _batching(run, cfg)
        self.iterator = BatchIterator(task.train_pairs, max_tokens=run.max_tokens, seed=run.seed,
                                      packing=run.batching == "packed", **batching)
        self.total_steps = run.steps or (run.epochs * self.iterator.batches_per_epoch if run.epochs
                                         else DEFAULT_STEPS)
        self.loss_batches, _ = eval_batches(task.eval_pairs, max_tokens=run.max_tokens, **batching)
        self.num_gen = min(run.bleu_samples or len(task.eval_pairs), len(task.eval_pairs))
        self.gen_batches, _ = eval_batches(task.eval_pairs[:self.num_gen], max_tokens=run.max_tokens,
                                           **batching)
        self.params0, self.elapsed0 = params0, 0.0
        # Sums over every step since step 1, logged or not (the log holds every log_every-th step
        # only); saved with each checkpoint so that a resume continues them. None: unknown (a
        # checkpoint written before these were kept).
        self.totals: dict[str, float] | None = {"step_time_s": 0.0, "compile_s": 0.0, "compiles": 0,
                                                "src_tokens": 0, "tgt_tokens": 0}
        self.stopped = "steps"  # or "time_budget", "target_bleu": what ended the loop (_loop)

    # -- start or resume -------------------------------------------------------------------
    def _trainer(self, params: dict) -> Trainer:
        run = self.run
        cls = get_trainer(self.backend)
        return cls(self.cfg, params, self.train_cfg, device=run.device, dtype=run.dtype,
                   accumulate=run.accumulate, shard=run.shard, num_devices=run.devices, loss=run.loss,
                   compile=run.compile, compile_cache=run.compile_cache_dir())

    def start(self) -> Trainer:
        if self.run.resume:
            if self.main:
                clean_temporaries(self.ckpt_root)
            ckpt_dir = latest_checkpoint(self.ckpt_root, check=False)  # _read_checkpoint checks it
            if ckpt_dir is not None:
                return self._resume(ckpt_dir)
            log.info("%s: no checkpoint yet in %s: starting from step 0", self.backend, self.ckpt_root)
        trainer = self._trainer(self.params0)
        record = {"format": RUN_FORMAT, "backend": self.backend, "identity": self.run.identity(),
                  "model_config": self.cfg.to_dict(), "train_config": self.train_cfg.to_dict(),
                  "args": self.run.to_dict(), **_parallel_facts(trainer)}
        if self.main:
            with os_errors(self.dir, "write the run directory"):
                self.dir.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(self.dir / "run.json", json.dumps(record, indent=2).encode("utf-8"))
                if self.task.tokenizer is not None:
                    self.task.tokenizer.save(self.dir / "tokenizer.json")
                write_log(self.log_path, [])
        return trainer

    def _read_checkpoint(self, ckpt_dir: Path) -> tuple[dict[str, Any], Checkpoint, dict[str, np.ndarray]]:
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
            _, ckpt, trainer_state = self._read_checkpoint(ckpt_dir)
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
        found = list_checkpoints(self.ckpt_root)
        for step, earlier in reversed([(n, p) for n, p in found if p.name < ckpt_dir.name]):
            if self._intact(earlier):
                newer = [p.name for _, p in found if p.name > earlier.name]
                names = " and ".join(newer)
                return CheckpointError(
                    f"{what}; the previous checkpoint {earlier} is intact: move {names} out of "
                    f"{self.ckpt_root} (or delete {'it' if len(newer) == 1 else 'them'}) and run again with "
                    f"--resume to continue from step {step}")
        return CheckpointError(f"{what}; no earlier checkpoint in {self.ckpt_root} is intact to resume from")

    def _resume(self, ckpt_dir: Path) -> Trainer:
        try:
            state, ckpt, trainer_state = self._read_checkpoint(ckpt_dir)
        except RosettaError as e:
            raise self._unusable(ckpt_dir, e) from None
        if ckpt.config != self.cfg:
            raise RosettaError(f"cannot resume {self.dir}: its checkpoint's model config differs from this "
                               f"command's ({ckpt_dir / 'model.safetensors'})")
        trainer = self._trainer(ckpt.params)
        step = state["step"]
        try:
            trainer.load_state_dict(trainer_state)  # refuses non-finite optimizer moments
            if trainer.step_count != step:
                raise CheckpointError(f"{ckpt_dir}: trainer state at step {trainer.step_count}, "
                                      f"state.json {step}")
        except RosettaError as e:
            raise self._unusable(ckpt_dir, e) from None
        self.iterator.load_state_dict(state["data"])
        saved_workers = state.get("world_size", 1)
        if saved_workers != trainer.world_size:
            log.warning("%s: resuming a run saved with %s data-parallel workers on %d: the global batches "
                        "and so the updates are the same (up to rounding in the reductions); dropout masks "
                        "are drawn differently from an uninterrupted run", self.backend, saved_workers,
                        trainer.world_size)
        if self.main:
            with os_errors(self.log_path, "write"):
                write_log(self.log_path, [r for r in read_log(self.log_path) if r.get("step", 0) <= step])
        self.elapsed0 = float(state.get("elapsed_s", 0.0))
        self.totals = state.get("totals")
        log.info("%s: resumed from %s (step %d)", self.backend, ckpt_dir, step)
        return trainer

    # -- checkpoints -----------------------------------------------------------------------
    def save(self, trainer: Trainer, elapsed: float, data_state: dict[str, Any]) -> Path | None:
        """Checkpoint the current step, `data_state` the batch iterator's position after its batch.
        Every process calls it (gathering sharded weights and optimizer state is a collective);
        process 0 writes."""
        step = trainer.step_count
        params, trainer_state = trainer.params(), trainer.state_dict()
        if not self.main:
            return None
        state = {"format": "rosetta-train-checkpoint/1", "step": step, "backend": self.backend,
                 "dtype": self.run.dtype, "data": data_state, "elapsed_s": elapsed,
                 "totals": self.totals, "world_size": trainer.world_size,
                 "train_config": self.train_cfg.to_dict(), "run": self.run.to_dict()}

        def write(tmp: Path) -> None:
            save_checkpoint(tmp / "model.safetensors", self.cfg, params,
                            metadata={"step": str(step), "backend": self.backend})
            save_trainer_state(tmp / "trainer_state.safetensors", trainer_state, self.backend)
            atomic_write_bytes(tmp / "state.json", json.dumps(state, indent=2).encode("utf-8"))
            if self.task.tokenizer is not None:
                self.task.tokenizer.save(tmp / "tokenizer.json")

        # A full disk or a read-only directory: the checkpoints already there stay intact and
        # `latest` keeps naming the newest of them (save_checkpoint_dir removes its temporary).
        with os_errors(self.ckpt_root / checkpoint_name(step), "write checkpoint"):
            return save_checkpoint_dir(self.ckpt_root, step, write, self.run.keep)

    # -- the loop --------------------------------------------------------------------------
    def train(self) -> dict[str, Any] | None:
        """Train to `total_steps`; the result (None on processes other than 0)."""
        run = self.run
        trainer = self.start()
        if trainer.step_count >= self.total_steps and (self.dir / "result.json").is_file():
            log.info("%s: already at step %d of %d: nothing to do", self.backend, trainer.step_count,
                     self.total_steps)
            return read_json(self.dir / "result.json") if self.main else None
        if not self.main:
            self._loop(trainer, None, NoProgress())
            return None
        progress = progress_bar(run.progress, self.backend, self.total_steps, trainer.step_count)
        try:
            with os_errors(self.log_path, "write"), self.log_path.open("a", encoding="utf-8") as log_file:
                self._loop(trainer, log_file, progress)
        finally:
            progress.close()
        records = read_log(self.log_path)
        result = {"format": RESULT_FORMAT, "backend": self.backend, "dtype": run.dtype,
                  "stopped_by": self.stopped, **summarize(records, self.totals, run.target_bleu)}
        with os_errors(self.dir, "write the results in"):
            check_overwritable(self.dir / "result.json")
            atomic_write_bytes(self.dir / "result.json", json.dumps(result, indent=2).encode("utf-8"))
            write_plot(self.dir / "plot.png", {self.backend: records}, title=f"{run.task}: {self.backend}")
        return result

    def _loop(self, trainer: Trainer, log_file: Any, progress: Any) -> None:
        """Steps until `total_steps`: log, evaluate and checkpoint on their cadences and at the end.
        An evaluation at step s is logged before checkpoint s, so a resume never repeats it.
        `log_file` None: a process other than 0, which trains and evaluates but writes nothing."""
        run = self.run
        peak = peak_flops(trainer.device_name, run.dtype, run.peak_tflops)
        clock = time.perf_counter()

        def elapsed() -> float:  # seconds of the training loop, across resumes
            return self.elapsed0 + time.perf_counter() - clock

        def over_budget() -> bool:  # under a launcher a collective: every process asks at the same point
            return run.time_budget is not None and trainer.any_process(elapsed() >= 60 * run.time_budget)

        def emit(record: dict[str, Any]) -> None:
            if log_file is not None:
                log_file.write(json.dumps(record) + "\n")
                log_file.flush()

        stop = None  # why the loop ends before total_steps: "time_budget" or "target_bleu"
        tracer = None if run.trace is None else Tracer(  # --trace N (rosetta/diff/trace.py); process 0 writes
            self.dir / "trace" if log_file else None, self.cfg, run.trace, dict(self.train_cfg.to_dict(),
            accumulate=trainer.accumulate), f"rosetta {self.backend} trainer", trainer)
        # The device is read only at the steps below (rosetta/harness/stepping.py): between them no
        # step waits for the host, and the next batch is built while the current step runs.
        stepper = Stepper(trainer, self.iterator, partial(batch_work, self.cfg))
        while trainer.step_count < self.total_steps and stop is None:
            if stepper.next_is_new_shape and stepper.pending:
                self._read(stepper)  # a new batch shape compiles: its step is timed alone
            stepped = stepper.step(keep_grads=tracer is not None)
            if tracer is not None:  # before the check below: a trace shows a divergence
                tracer.record(trainer, stepped.batch, stepped.metrics)
            _fault_injection(self.env, stepped.metrics["step"])
            if over_budget():
                stop = "time_budget"  # this step is the last: its evaluation and checkpoint follow
            step = stepped.metrics["step"]
            last = step == self.total_steps or stop is not None
            logged = step % run.log_every == 0 or last
            evaluated = (run.eval_every and step % run.eval_every == 0) or last
            saved = (run.checkpoint_every and step % run.checkpoint_every == 0) or last
            progress.update(1)
            if logged or evaluated or saved or stepped.first_of_shape or tracer is not None:
                stretch = self._read(stepper)
                record = train_record(self.cfg, self.backend, trainer, stepped.batch, stretch.last, stretch,
                                      peak, stepped.first_of_shape, self.baseline)
                if logged:
                    emit(record | {"epoch": stepped.epoch, "elapsed_s": elapsed()})
                progress.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tgt_tokens_per_s']:,.0f}")
            if evaluated:
                result = evaluate(trainer, self.task, self.loss_batches, self.gen_batches, self.num_gen, run)
                emit({"kind": "eval", "backend": self.backend, "step": step, **result,
                      "tgt_tokens_total": (self.totals or {}).get("tgt_tokens"), "elapsed_s": elapsed()})
                if run.target_bleu is not None and trainer.any_process(result["bleu"] >= run.target_bleu):
                    stop, last = stop or "target_bleu", True  # stop at the first evaluation at the target
                elif stop is None and over_budget():
                    # This evaluation crossed the budget: the step is the last (checkpointed below),
                    # not one more step and a second evaluation of nearly the same weights.
                    stop, last = "time_budget", True
            if saved or last:
                self.save(trainer, elapsed(), stepper.data_state)
        if run.average_last and self.main:
            emit(self._evaluate_average(trainer))
        if stop is not None:
            log.info("%s: stopped at step %d of %d (%s); --resume continues the run", self.backend,
                     trainer.step_count, self.total_steps,
                     f"--time-budget {run.time_budget:g} min" if stop == "time_budget"
                     else f"validation BLEU reached --target-bleu {run.target_bleu:g}")
        self.stopped = stop or "steps"

    def _evaluate_average(self, trainer: Trainer) -> dict[str, Any]:
        """The average of the last `--average-last` checkpoints (paper §6.1), written beside them as
        averaged.safetensors and evaluated like a checkpoint (BLEU of the backend's decoding)."""
        from rosetta.average import resolve_checkpoints, write_average
        paths = resolve_checkpoints([self.dir], self.run.average_last).paths
        with os_errors(self.dir, "write the averaged checkpoint in"):
            out = write_average(paths, self.dir / "averaged.safetensors")
        ckpt = load_checkpoint(out)
        model = from_params(ckpt.config, ckpt.params, BACKENDS[self.backend].decoder, self.run.dtype)
        start = time.perf_counter()
        scores = score_batches(model, self.task, self.gen_batches, self.num_gen, self.run.beam,
                               self.run.alpha, self.run.max_len_margin)
        return {"kind": "eval_average", "backend": self.backend, "step": trainer.step_count,
                "checkpoints": [p.parent.name for p in paths], **scores,
                "eval_time_s": time.perf_counter() - start}

    def _check_finite(self, values: dict[str, Any]) -> None:
        """Stop at the first non-finite loss or gradient norm (`values["non_finite"]`, kept by the
        trainer on the device: rosetta/training.py). That step's update has already poisoned the
        weights in memory, so nothing of it may reach a checkpoint or the log, and every later step
        would only repeat it."""
        bad = values["non_finite"]
        if bad is None:
            return
        good = latest_checkpoint(self.ckpt_root)
        kept = (f"the last good checkpoint, {good.name}, stays latest" if good is not None
                else "no checkpoint was written before it")
        raise DivergedError(f"{self.backend}: training diverged at step {bad['step']} (loss {bad['loss']}, "
                            f"gradient norm {bad['grad_norm']}): stopped without saving that step; {kept} (a "
                            f"lower --lr-factor, a longer --warmup or --clip-norm may help)")

    def _read(self, stepper: Stepper) -> Stretch:
        """The device read (rosetta/harness/stepping.py): the steps since the last read, checked
        for a non-finite step, then added to the run's totals (every step since step 1, logged or
        not)."""
        stretch = stepper.flush()
        self._check_finite(stretch.last)
        if self.totals is None:
            return stretch
        for key, value in (("step_time_s", stretch.seconds), ("compile_s", stretch.compile_s),
                           ("compiles", stretch.compiles), ("src_tokens", stretch.work["src_tokens"]),
                           ("tgt_tokens", stretch.work["tgt_tokens"])):
            self.totals[key] = self.totals.get(key, 0) + value
        return stretch


def _parallel_facts(trainer: Trainer) -> dict[str, Any]:
    """How a run is spread over devices, for run.json and the summary."""
    return {"world_size": trainer.world_size, "processes": trainer.num_processes,
            "accumulate": trainer.accumulate, "shard": trainer.shard}


FAULT_VARIABLE = "ROSETTA_TEST_KILL_AT"  # "RANK:STEP": that process kills itself after that step


def _fault_injection(env: LaunchEnv, step: int) -> None:
    """For the tests of rank failure only (docs/testing.md): SIGKILL this process after `step`
    when ROSETTA_TEST_KILL_AT names it, as a crashed or OOM-killed worker dies."""
    target = os.environ.get(FAULT_VARIABLE)
    if target and target == f"{env.rank}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


# -- Several backends ------------------------------------------------------------------------

def train(run: RunConfig) -> dict[str, dict[str, Any]]:
    """Train every backend of `run` in turn on the same data, from the same initial weights, with
    the same schedule; then write the combined plot and summary. Returns each backend's result."""
    check_run(run)
    env = launch_env()
    if run.nproc > 1 and run.nproc != env.num_processes:
        raise RosettaError(f"--nproc {run.nproc}: this is process {env.rank} of {env.num_processes}; --nproc "
                           "launches its processes from the command line (rosetta train --nproc N) or give "
                           "none under torchrun")
    out = Path(run.out)
    if out.exists() and not out.is_dir():
        raise RosettaError(f"--out {out} is a file, not a directory")
    if run.resume and not out.is_dir():
        raise RosettaError(f"--resume: {out} holds no run to resume (no such directory)")
    baseline = read_json(Path(run.baseline) / "summary.json").get("backends", {}) if run.baseline else None
    check_backends(run, env)
    # The lock first, so that the checks below see what no other process is changing. Processes
    # other than 0 of a launch neither check nor change `out`: they only read a checkpoint to resume.
    with os_errors(out), (out_dir_lock(out) if env.is_main else contextlib.nullcontext()):
        doomed = check_out_dirs(run) if env.is_main else []
        task = _load_task(run)
        cfg = _model_config(run, task)
        for run_dir in doomed:  # --overwrite, and the new run's data and config are good
            shutil.rmtree(run_dir)
        params0 = init_params(cfg, run.seed)  # one initializer for every framework (SPEC §4)
        results = {}
        for backend in run.backends:
            log.info("%s: training %s (%s) for the %s task in %s", backend, run.preset, run.dtype, run.task,
                     out / backend)
            results[backend] = _Run(run, backend, task, cfg, params0, env, baseline).train()
        if env.is_main:
            with os_errors(out, "write the summary in"):
                write_combined_report(out, run.backends, run.to_dict())
    return results
