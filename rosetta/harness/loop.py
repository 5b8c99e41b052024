"""The training loop: PyTorch and JAX trained on the same data, from the same initial weights
(rosetta.init_params), with the same schedule (§5.1 batches, §5.3 Adam and eq. 3, §5.4 smoothing
and dropout), each through the `Trainer` the registry gives (rosetta/backends.py), stepped by
rosetta/harness/stepping.py; framework-free itself.

    from rosetta.harness.loop import RunConfig, train
    results = train(RunConfig(backends=("torch", "jax"), task="copy", steps=300, out="runs/copy"))

Per backend `b`, `out/b/` holds `run.json`, `log.jsonl` (a record per logged step and evaluation),
`checkpoints/` (rosetta/harness/resume.py), `result.json`, `plot.png`, a text task's
`tokenizer.json`, `trace/` with --trace; `out/` the combined plot and summary and `.rosetta.lock`.
Nothing the harness did not write is overwritten (rosetta/harness/out_dir.py). Many devices
(docs/distributed.md): every process runs this loop on the same global batches and calls the
collectives together; only process 0 writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from rosetta.backends import BACKENDS, get_trainer
from rosetta.config import ModelConfig
from rosetta.device import CACHE_OFF
from rosetta.diff.training.trace import Tracer
from rosetta.distributed import LaunchEnv, launch_env
from rosetta.files import atomic_write_bytes
from rosetta.harness.batching import BatchIterator, eval_batches
from rosetta.harness.budget import Budget
from rosetta.harness.evaluate import averaged, validation
from rosetta.harness.metrics import batch_work, peak_flops, train_record
from rosetta.harness.out_dir import check_out_dirs, os_errors
from rosetta.harness.preflight import check_backends, check_launch
from rosetta.harness.report import (
    RESULT_FORMAT,
    NoProgress,
    check_overwritable,
    progress_bar,
    read_json,
    read_log,
    summarize,
    write_combined_report,
    write_plot,
)
from rosetta.harness.resume import Checkpoints
from rosetta.harness.run_config import DEFAULT_STEPS, RunConfig, batching_line, check_run, resolve_batching
from rosetta.harness.run_dir import list_checkpoints, out_dir_lock
from rosetta.harness.stepping import Stepper, Stretch
from rosetta.harness.tasks import TaskData, run_batching, run_model_config, run_task
from rosetta.machine import machine_block
from rosetta.params import init_params
from rosetta.training import Trainer

log = logging.getLogger(__name__)

RUN_FORMAT = "rosetta-run/1"


# -- One backend -----------------------------------------------------------------------------

class _Run:
    """One backend's training run in `out/<backend>/`; in a launch of several processes, this
    process's part of it (only process 0, `self.main`, writes)."""

    def __init__(self, run: RunConfig, backend: str, task: TaskData, cfg: ModelConfig, params0: dict,
                 env: LaunchEnv, baseline: dict[str, Any] | None = None):
        self.run, self.backend, self.task, self.cfg = run, backend, task, cfg
        self.main = env.is_main
        # The one-device run's median tokens/s that scaling efficiency divides by (--baseline).
        self.baseline = (baseline or {}).get(backend, {}).get("median_tgt_tokens_per_s")
        self.dir = Path(run.out) / backend
        self.log_path = self.dir / "log.jsonl"
        self.checkpoints = Checkpoints(self.dir, backend, cfg, self.main, task.tokenizer)
        self.train_cfg = run.train_config()
        batching = run_batching(run, cfg)
        self.iterator = BatchIterator(task.train_pairs, max_tokens=run.max_tokens, seed=run.seed,
                                      packing=run.batching == "packed", **batching)
        if self.main:
            log.info("%s: %s", backend, batching_line(self.iterator))
        self.total_steps = run.steps or (run.epochs * self.iterator.batches_per_epoch if run.epochs
                                         else DEFAULT_STEPS)
        if self.main and run.warmup >= self.total_steps:  # eq. 3 rises until step `warmup`, then decays
            log.warning("%s: warning: --warmup %d >= the run's %d steps: the learning rate rises for the "
                        "whole run and never decays (the warm-up never ends); give --warmup below the steps",
                        backend, run.warmup, self.total_steps)
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
        # A resumed checkpoint whose evaluation never finished (it failed, or the run was killed
        # between the two): _loop evaluates it first. Known to process 0, which reads the log.
        self.unevaluated = False
        self.averaged_at: int | None = None  # the resumed step, if its --average-last record is logged

    # -- start or resume -------------------------------------------------------------------
    def _trainer(self, params: dict) -> Trainer:
        run = self.run
        return get_trainer(self.backend)(
            self.cfg, params, self.train_cfg, device=run.device, dtype=run.dtype, accumulate=run.accumulate,
            shard=run.shard, num_devices=run.devices, loss=run.loss, compile=run.compile,
            compile_cache=run.compile_cache_dir() or CACHE_OFF)  # None would keep JAX's own setting

    def start(self) -> Trainer:
        resumed = self.checkpoints.resume(self._trainer) if self.run.resume else None
        if resumed is not None:
            return self._continue(*resumed)
        if self.run.resume:
            log.info("%s: no checkpoint yet in %s: starting from step 0", self.backend, self.checkpoints.root)
        trainer = self._trainer(self.params0)
        record = {"format": RUN_FORMAT, "backend": self.backend, "identity": self.run.identity(),
                  "model_config": self.cfg.to_dict(), "train_config": self.train_cfg.to_dict(),
                  "args": self.run.to_dict(), **_parallel_facts(trainer)}
        if self.main:
            # What the run's speed was measured on (issue 55): vector ISA, each library's dispatch, the
            # cap, a short matmul calibration. run.json only: the identity (resume's check) leaves it out.
            record["machine"] = machine_block(calibrate_repeats=3)
            self.checkpoints.begin(record, self.log_path)
        return trainer

    def _continue(self, trainer: Trainer, state: dict[str, Any], ckpt_dir: Path) -> Trainer:
        """A resumed run picks up the checkpoint's batch position, clock and totals; the log's
        records after its step go (they are redone)."""
        self.iterator.load_state_dict(state["data"])
        if self.main:
            done = self.checkpoints.trim_log(self.log_path, state["step"])
            self.unevaluated = self._evaluates(state["step"]) and "eval" not in done
            self.averaged_at = state["step"] if "eval_average" in done else None
        self.elapsed0 = float(state.get("elapsed_s", 0.0))
        self.totals = state.get("totals")
        log.info("%s: resumed from %s (step %d)", self.backend, ckpt_dir, state["step"])
        return trainer

    def save(self, trainer: Trainer, elapsed: float, data_state: dict[str, Any]) -> Path | None:
        """Checkpoint the current step (rosetta/harness/resume.py), `data_state` the batch
        iterator's position after its batch. Every process calls it (a collective); process 0 writes."""
        return self.checkpoints.save(trainer, {
            "dtype": self.run.dtype, "data": data_state, "elapsed_s": elapsed, "totals": self.totals,
            "world_size": trainer.world_size, "train_config": self.train_cfg.to_dict(),
            "run": self.run.to_dict()}, self.run.keep)

    def _evaluates(self, step: int) -> bool:
        """Whether step `step` is evaluated: --eval-every's cadence, and the last step (0: none)."""
        every = self.run.eval_every
        return bool(every) and (step >= self.total_steps or step % every == 0)

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
        Checkpoint s is written before the evaluation at step s, so an evaluation that fails loses
        no training; a resume evaluates a checkpoint whose evaluation is not in the log, then goes on.
        `log_file` None: a process other than 0, which trains and evaluates but writes nothing."""
        run = self.run
        peak = peak_flops(trainer.device_name, run.dtype, run.peak_tflops)
        budget = Budget(run.time_budget, self.elapsed0, trainer)

        def emit(record: dict[str, Any]) -> None:
            if log_file is not None:
                log_file.write(json.dumps(record) + "\n")
                log_file.flush()

        def evaluate(step: int, rescue: Callable[[], Any] | None = None) -> str | None:
            """The evaluation at `step`, logged; "target_bleu" or "time_budget" if the run stops here.
            `rescue`: the checkpoint of this step, written if the evaluation fails and none was."""
            with self.checkpoints.kept_on_failure(step, "evaluation", trainer, rescue):
                result = validation(trainer, self.task, self.loss_batches, self.gen_batches, self.num_gen,
                                    run.beam, run.alpha, run.max_len_margin)
            emit({"kind": "eval", "backend": self.backend, "step": step, **result,
                  "tgt_tokens_total": (self.totals or {}).get("tgt_tokens"), "elapsed_s": budget.elapsed()})
            if run.target_bleu is not None and trainer.any_process(result["bleu"] >= run.target_bleu):
                return "target_bleu"  # stop at the first evaluation at the target
            # An evaluation that crossed the budget: its step is the last (checkpointed), not one
            # more step and a second evaluation of nearly the same weights.
            return "time_budget" if budget.spent() else None

        stop = None  # why the loop ends before total_steps: "time_budget" or "target_bleu"
        if trainer.step_count and trainer.any_process(self.unevaluated):  # resumed; the same on every process
            stop = evaluate(trainer.step_count)
        tracer = None if run.trace is None else Tracer(  # --trace N (rosetta/diff); process 0 writes
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
            if budget.spent():
                stop = "time_budget"  # this step is the last: its evaluation and checkpoint follow
            step = stepped.metrics["step"]
            last = step == self.total_steps or stop is not None
            logged = step % run.log_every == 0 or last
            evaluated = bool(run.eval_every) and (step % run.eval_every == 0 or last)  # 0: never
            saved = (run.checkpoint_every and step % run.checkpoint_every == 0) or last
            progress.update(1)
            if logged or evaluated or saved or stepped.first_of_shape or tracer is not None:
                stretch = self._read(stepper)
                record = train_record(self.cfg, self.backend, trainer, stepped.batch, stretch.last, stretch,
                                      peak, stepped.first_of_shape, self.baseline)
                if logged:
                    emit(record | {"epoch": stepped.epoch, "elapsed_s": budget.elapsed()})
                progress.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tgt_tokens_per_s']:,.0f}")
            if saved or last:  # before the evaluation: one that fails leaves this step resumable
                self.save(trainer, budget.elapsed(), stepper.data_state)
            if evaluated:
                ended = evaluate(step, None if saved or last else
                                 partial(self.save, trainer, budget.elapsed(), stepper.data_state))
                if ended is not None and not (saved or last):  # the evaluation made this step the last
                    self.save(trainer, budget.elapsed(), stepper.data_state)
                stop = stop or ended
        kept = len(list_checkpoints(self.dir / "checkpoints")) if run.average_last and self.main else 0
        if run.average_last and self.main and kept < 2:  # an average of one checkpoint is that checkpoint
            log.info("%s: --average-last %d: the run has %d checkpoint, nothing to average; no "
                     "averaged.safetensors written (more steps than --checkpoint-every %d give more)",
                     self.backend, run.average_last, kept, run.checkpoint_every)
        elif run.average_last and self.main and trainer.step_count != self.averaged_at:
            what = "averaged checkpoints' evaluation"
            with self.checkpoints.kept_on_failure(trainer.step_count, what, trainer):
                result = averaged(self.dir, run.average_last, BACKENDS[self.backend].decoder, run.dtype,
                                  self.task, self.gen_batches, self.num_gen, run.beam, run.alpha,
                                  run.max_len_margin, score=bool(run.eval_every))  # 0: written, not scored
            emit({"kind": "eval_average", "backend": self.backend, "step": trainer.step_count, **result})
        if stop is not None:
            log.info("%s: stopped at step %d of %d (%s); --resume continues the run", self.backend,
                     trainer.step_count, self.total_steps,
                     f"--time-budget {run.time_budget:g} min" if stop == "time_budget"
                     else f"validation BLEU reached --target-bleu {run.target_bleu:g}")
        self.stopped = stop or "steps"

    def _read(self, stepper: Stepper) -> Stretch:
        """The device read (rosetta/harness/stepping.py): the steps since the last read, checked
        for a non-finite step, then added to the run's totals (every step since step 1, logged or
        not)."""
        stretch = stepper.flush()
        self.checkpoints.refuse_diverged(stretch.last)
        if self.totals is not None:
            stretch.add_to(self.totals)
        return stretch


def _parallel_facts(trainer: Trainer) -> dict[str, Any]:
    """How a run is spread over devices, for run.json and the summary."""
    return {"world_size": trainer.world_size, "processes": trainer.num_processes,
            "accumulate": trainer.accumulate, "shard": trainer.shard}


# -- Several backends ------------------------------------------------------------------------

def train(run: RunConfig) -> dict[str, dict[str, Any]]:
    """Train every backend of `run` in turn on the same data, from the same initial weights, with
    the same schedule; then write the combined plot and summary. Returns each backend's result."""
    check_run(run)
    env = launch_env()
    check_launch(run, env)
    out = Path(run.out)
    baseline = read_json(Path(run.baseline) / "summary.json").get("backends", {}) if run.baseline else None
    check_backends(run, env)
    # --batching's default depends on the devices the backends train on (run_config.py: DEFAULT_BATCHING).
    devices = [get_trainer(backend).resolve_device(run.device, env) for backend in run.backends]
    run = dataclasses.replace(run, batching=resolve_batching(run.batching, run.backends, devices))
    # The lock first, so that the checks below see what no other process is changing. Processes
    # other than 0 of a launch neither check nor change `out`: they only read a checkpoint to resume.
    with os_errors(out), (out_dir_lock(out) if env.is_main else contextlib.nullcontext()):
        doomed = check_out_dirs(run) if env.is_main else []
        task = run_task(run)
        cfg = run_model_config(run, task)
        for run_dir in doomed:  # --overwrite, and the new run's data and config are good
            shutil.rmtree(run_dir)
        params0 = init_params(cfg, run.seed)  # one initializer for every framework (SPEC §4)
        results = {}
        for backend in run.backends:
            log.info("%s: training %s (%s) for the %s task in %s", backend, run.preset, run.dtype, run.task,
                     out / backend)
            if backend == "jax" and run.compile and env.is_main:
                log.info("jax: --compile changes nothing here (JAX compiles every step with jit already)")
            results[backend] = _Run(run, backend, task, cfg, params0, env, baseline).train()
        if env.is_main:
            with os_errors(out, "write the summary in"):
                write_combined_report(out, run.backends, run.to_dict())
    return results
