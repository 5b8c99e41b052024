"""Data-parallel scaling: training throughput of both frameworks' `Trainer` at 1, 2, ... N workers.

    python -m benchmarks.scaling --framework torch jax --workers 1 2 4 8 --preset base --dtype bfloat16
    python -m benchmarks.scaling --preset tiny --workers 1 2 --steps 5          # this CPU: overhead only
    python -m benchmarks.scaling --max-tokens 8192 ...                          # strong scaling instead

What one measurement is: `Trainer.step(batch)` (torch_impl/train.py, jax_impl/train.py) on global
batches from the harness's own batching (rosetta.harness.batching.BatchIterator), the step that
`rosetta train` runs: forward with dropout, label-smoothed loss, backward, the gradients reduced
over the workers, Adam. The median step time over `--steps` steps after `--warmup-steps` warm-up
steps (plus one untimed step per batch shape that the warm-up did not compile: JAX compiles once
per bucket length); `step()` reads the loss, which synchronises every device and process, so the
clock around it is honest. Tokens/s counts real target tokens (labels that are not padding): the
median over the timed steps of tokens / step time, per worker that divided by N; scaling
efficiency = tokens/s at N / (N x tokens/s at 1), exactly 1 at N = 1.

Workers: PyTorch at N > 1 is `torchrun --standalone --nproc-per-node N -m benchmarks.scaling
--worker ...` (one process per device: DDP over gloo on CPUs, NCCL on GPUs); JAX at N > 1 one
process whose Mesh spans N devices (`num_devices=N`), on CPUs N host devices made by
XLA_FLAGS=--xla_force_host_platform_device_count=N. Every measurement, N = 1 included, runs in a
fresh process of its own; process 0 writes a small JSON that this program collects. N larger
than the GPUs there are is recorded as "not measured" with the reason, never estimated. On a CPU
any N runs, but the host devices (JAX) and processes (PyTorch; torchrun gives each one thread
when N > 1) all share the same cores: efficiency there measures the overhead of splitting the
batch and reducing gradients, not the gain from extra hardware.

Batches: weak scaling by default, the usual way to report DDP scaling: a global token budget of
N x `--per-worker-tokens`, so each worker's share stays the same as N grows. `--max-tokens G`
instead fixes the global budget (strong scaling): exactly the same global batches at every N, each
worker's share shrinking as N grows (and with it, per-step work per worker against fixed costs).
Full batches only (each bucket's partly filled last batch of an epoch is skipped). Sentence pairs
(at least 20,000, or as many as the global token budget) are synthetic with Multi30k-like
lengths (`pairs`): source lengths log-normal with median ~14 tokens, 4 to 40, target lengths the
source's times a log-normal ratio around 1, ids uniform over the vocabulary; the same pairs, seed
and batching at every N.

Results: benchmarks/results/scaling_<device>_<date>.{json,md} (benchmarks.common: the machine,
commit, versions and every setting; `--out-dir` elsewhere). Nothing here is committed from a
shared or busy machine: scaling numbers need a quiet one.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS, Parser, environment, given_path, parser, with_machine, write_results
from rosetta.cli_args import MAX_COUNT, core_count, count, integer_type, positive_int, positive_real
from rosetta.config import preset
from rosetta.errors import RosettaError
from rosetta.json_input import read_json
from rosetta.training import Batch

ROOT = Path(__file__).parent.parent
FRAMEWORKS = ("torch", "jax")
PRESET_NAMES = ("tiny", "small", "base", "big")
NUM_PAIRS = 20000
MIN_LEN, MAX_LEN = 4, 40
# The harness's default bucket lengths (batching.default_buckets) up to the longest pair (40 + bos/eos).
BUCKETS = (8, 16, 24, 32, 40, 48)
# Every variable a launcher sets: a worker's own launch must not inherit an outer one's.
LAUNCH_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
CPU_NOTE = ("On a CPU the host devices (JAX) and processes (PyTorch) of every N share the same cores, "
            "so efficiency there measures the overhead of splitting the batch and reducing gradients, "
            "not the gain of extra hardware.")


# -- The data ------------------------------------------------------------------------------------

def pairs(vocab_size: int, num_pairs: int = NUM_PAIRS, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Synthetic sentence pairs with Multi30k-like lengths (its sentences average 12-13 words,
    a few more subword tokens): source length round(exp(N(ln 14, 0.35))) clipped to [4, 40]
    (median 14, ~95% within 7-28), target length the source's times exp(N(0, 0.15)), clipped
    the same; ids uniform over [3, vocab_size) (0, 1, 2: pad, bos, eos)."""
    rng = np.random.default_rng(seed)
    src_len = np.clip(np.rint(np.exp(rng.normal(np.log(14.0), 0.35, num_pairs))), MIN_LEN, MAX_LEN)
    tgt_len = np.clip(np.rint(src_len * np.exp(rng.normal(0.0, 0.15, num_pairs))), MIN_LEN, MAX_LEN)
    src_len, tgt_len = src_len.astype(int), tgt_len.astype(int)
    ids = rng.integers(3, vocab_size, size=int(src_len.sum() + tgt_len.sum()))
    out, at = [], 0
    for s, t in zip(src_len.tolist(), tgt_len.tolist(), strict=True):
        out.append((ids[at:at + s].tolist(), ids[at + s:at + s + t].tolist()))
        at += s + t
    return out


def global_tokens(args: argparse.Namespace, workers: int) -> int:
    """The global batch's token budget at `workers` workers: fixed (strong), or N x per worker (weak)."""
    return args.max_tokens if args.max_tokens is not None else workers * args.per_worker_tokens


def full_batches(iterator: Iterator[Batch], patience: int = 1000) -> Iterator[Batch]:
    """The batches of `iterator` whose every row holds a pair. Each bucket's last batch of an
    epoch holds what is left of it (a few rows, maybe: in a long run, rare), and one such step
    among a few timed ones would make the median a matter of luck."""
    skipped = 0
    for batch in iterator:
        if batch.num_examples == batch.shape[0]:
            skipped = 0
            yield batch
        elif (skipped := skipped + 1) >= patience:
            raise SystemExit(f"no full batch in {patience}: too few pairs for the token budget")


# -- One measurement (a worker process) ---------------------------------------------------------

def _not_measured(args: argparse.Namespace, reason: str) -> dict:
    return {"framework": args.framework[0], "workers": args.workers[0], "status": "not measured",
            "reason": reason}


def measure(args: argparse.Namespace) -> dict | None:
    """This process's part of one measurement (framework args.framework[0], N = args.workers[0]);
    the result on process 0, None on the others."""
    from rosetta import init_params
    from rosetta.harness.batching import BatchIterator
    from rosetta.training import TrainConfig

    framework, workers = args.framework[0], args.workers[0]
    if framework == "torch":
        import torch

        from torch_impl.train import Trainer
        if torch.cuda.is_available() and workers > torch.cuda.device_count():
            return _not_measured(args, f"{workers} workers need {workers} GPUs; torch sees "
                                       f"{torch.cuda.device_count()}")
        threads = torch.get_num_threads()
        num_devices = None  # one device per process, N processes
    else:
        import jax

        from jax_impl.train import Trainer
        available = len(jax.devices())
        if workers > available:
            return _not_measured(args, f"{workers} workers need {workers} {jax.default_backend()} devices; "
                                       f"JAX sees {available}")
        threads = None
        num_devices = workers
    cfg = preset(args.preset)
    budget = global_tokens(args, workers)
    # About 16 batches' worth of pairs per epoch, 20,000 at least.
    iterator = BatchIterator.from_config(pairs(cfg.src_vocab_size, max(NUM_PAIRS, budget)), cfg,
                                         max_tokens=budget, buckets=args.buckets, seed=0)
    batches = full_batches(iterator)
    trainer = Trainer(cfg, init_params(cfg, seed=0), TrainConfig(warmup_steps=4000), dtype=args.dtype,
                      parity=False, num_devices=num_devices)
    if trainer.world_size != workers:
        raise SystemExit(f"asked for {workers} workers, the {framework} trainer has {trainer.world_size}")
    warmup = [next(batches) for _ in range(args.warmup_steps)]
    timed = [next(batches) for _ in range(args.steps)]
    # One untimed step for each shape of the timed batches that the warm-up has not run: JAX
    # compiles once per shape, and a compilation is no part of a step's time.
    seen = {b.shape for b in warmup}
    extra = [b for b in timed if b.shape not in seen and not seen.add(b.shape)]
    barrier = _barrier(framework, trainer.world_size)
    start = time.perf_counter()
    losses = [trainer.read(trainer.step(b))["loss"] for b in warmup + extra]
    warmup_s = time.perf_counter() - start
    times, tokens, rows = [], [], []
    for batch in timed:
        barrier()  # every process starts the step together (outside the clock)
        start = time.perf_counter()
        out = trainer.read(trainer.step(batch))  # waits for the device: the step is done
        times.append(time.perf_counter() - start)
        tokens.append(out["num_tgt_tokens"])
        rows.append(out["worker_rows"])
        losses.append(out["loss"])
    if not trainer.is_main:
        return None
    if not all(np.isfinite(losses)):
        raise SystemExit(f"{framework} at {workers} workers: a non-finite loss {losses}")
    rate = statistics.median(n / t for n, t in zip(tokens, times, strict=True))
    return {
        "framework": framework, "workers": workers, "status": "measured",
        "device_name": trainer.device_name, "median_step_s": statistics.median(times),
        "min_step_s": min(times), "max_step_s": max(times), "tokens_per_s": rate,
        "tokens_per_s_per_worker": rate / workers, "step_s": times, "tgt_tokens": tokens,
        "global_max_tokens": global_tokens(args, workers), "global_rows": [b.shape[0] for b in timed],
        "lengths": [b.shape[1] for b in timed], "worker_rows": rows,
        "warmup_steps": len(warmup), "extra_warmup_steps": len(extra), "warmup_s": warmup_s,
        "torch_threads_per_process": threads, "xla_flags": os.environ.get("XLA_FLAGS"),
        "first_loss": losses[0], "last_loss": losses[-1],
    }


def _barrier(framework: str, world_size: int):
    if framework == "torch" and world_size > 1:
        import torch.distributed as dist
        return dist.barrier
    return lambda: None


# -- The runner --------------------------------------------------------------------------------

def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env | extra


def _xla_flags(workers: int) -> str:
    """XLA_FLAGS with N host devices (only the CPU platform reads it), the caller's other flags kept."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join(kept + [f"--xla_force_host_platform_device_count={workers}"])


def worker_command(args: argparse.Namespace, framework: str, workers: int, result: Path) -> list[str]:
    """The command of one measurement: torchrun for PyTorch at N > 1, else one Python process."""
    flags = ["--worker", "--framework", framework, "--workers", str(workers), "--preset", args.preset,
             "--dtype", args.dtype, "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps),
             "--per-worker-tokens", str(args.per_worker_tokens), "--result", str(result),
             "--buckets", *map(str, args.buckets)]
    if args.max_tokens is not None:
        flags += ["--max-tokens", str(args.max_tokens)]
    if framework == "torch" and workers > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={workers}", "-m", "benchmarks.scaling", *flags]
    return [sys.executable, "-m", "benchmarks.scaling", *flags]


def cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def gpu_count() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_name() -> str:
    import torch
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def run_one(args: argparse.Namespace, framework: str, workers: int, gpus: int) -> dict:
    """One (framework, N) measurement in its own process(es); a failure is recorded, not raised."""
    if framework == "torch" and gpus and workers > gpus:  # never start what cannot run
        return {"framework": framework, "workers": workers, "status": "not measured",
                "reason": f"{workers} workers need {workers} GPUs; this machine has {gpus}"}
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        extra = {"XLA_FLAGS": _xla_flags(workers)} if framework == "jax" else {}
        if framework == "torch" and not gpus and "OMP_NUM_THREADS" not in os.environ:
            # The cores shared out among the N processes (torchrun's default would give each one
            # thread, however many cores there are; one process alone would take them all).
            extra["OMP_NUM_THREADS"] = str(max(1, cpu_cores() // workers))
        start = time.perf_counter()
        done = subprocess.run(worker_command(args, framework, workers, result), cwd=ROOT, env=_env(extra),
                              capture_output=True, text=True, timeout=args.timeout)
        wall = time.perf_counter() - start
        if done.returncode != 0 or not result.exists():
            tail = (done.stderr or done.stdout)[-2000:]
            print(tail, file=sys.stderr)
            return {"framework": framework, "workers": workers, "status": "not measured",
                    "reason": f"the run failed (exit code {done.returncode}): {tail[-300:].strip()}"}
        try:  # the worker's own file, read as any other: bounded (rosetta/json_input.py)
            row = read_json(result, "a worker's result", nonfinite=True)
        except RosettaError as e:
            return {"framework": framework, "workers": workers, "status": "not measured", "reason": str(e)}
    row["process_wall_s"] = wall
    return row


def add_efficiency(rows: list[dict]) -> None:
    """efficiency = tokens/s at N / (N x tokens/s at 1), per framework (None without a measured N = 1)."""
    for row in rows:
        if row["status"] != "measured":
            continue
        base = next((r for r in rows if r["framework"] == row["framework"] and r["workers"] == 1
                     and r["status"] == "measured"), None)
        row["efficiency"] = (None if base is None
                             else row["tokens_per_s"] / (row["workers"] * base["tokens_per_s"]))


def markdown(result: dict) -> str:
    env, s = result["environment"], result["settings"]
    versions = ", ".join(f"{k} {env[k]}" for k in ("torch", "jax") if k in env)
    mode = (f"strong scaling: the same global batches of {s['max_tokens']} tokens at every N"
            if s["mode"] == "strong" else
            f"weak scaling: a global batch of N x {s['per_worker_tokens']} tokens")
    lines = [f"# Data-parallel scaling on {result['device']}, {env['date']}",
             "",
             f"commit {env['commit']}, {env['processor']}, {versions}; {env.get('cpu_count')} CPU cores, "
             f"{result['gpus']} GPUs",
             "",
             f"preset {s['preset']}, {s['dtype']}, {mode}; median of {s['steps']} steps after "
             f"{s['warmup_steps']} warm-up steps; tokens/s counts real target tokens; efficiency = tokens/s "
             "at N / (N x tokens/s at 1). PyTorch: DDP, one process per worker (torchrun); JAX: one process, "
             "a Mesh over N devices.",
             "",
             "| framework | N | step ms (median) [min–max] | tokens/s | tokens/s per worker | efficiency | "
             "rows per worker | note |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        if r["status"] != "measured":
            lines.append(f"| {r['framework']} | {r['workers']} | – | – | – | – | – | not measured: "
                         f"{r['reason'].replace('|', '/').splitlines()[0]} |")
            continue
        eff = "–" if r.get("efficiency") is None else f"{r['efficiency']:.2f}"
        note = (f"{r['torch_threads_per_process']} thread(s) per process"
                if r.get("torch_threads_per_process") else "")
        rows = sorted(set(r["worker_rows"]))
        lines.append(f"| {r['framework']} | {r['workers']} | {r['median_step_s'] * 1e3:.1f} "
                     f"[{r['min_step_s'] * 1e3:.1f}–{r['max_step_s'] * 1e3:.1f}] | "
                     f"{r['tokens_per_s']:,.0f} | "
                     f"{r['tokens_per_s_per_worker']:,.0f} | {eff} | {rows[0]}–{rows[-1]} | {note} |")
    lines.append("")
    if result["device"] == "cpu":
        lines += [CPU_NOTE, ""]
    return "\n".join(lines)


def results_name(device: str) -> str:
    device = re.sub(r"[^A-Za-z0-9]+", "-", device).strip("-").lower()
    return f"scaling_{device}_{dt.date.today().isoformat()}"


def run(args: argparse.Namespace) -> dict:
    """Every (framework, N) measurement, then the results dict (not yet written)."""
    # Before any JAX in this process (environment() lists JAX's devices): take GPU memory on demand,
    # so that this process holds none of what the workers need.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    started = time.perf_counter()
    gpus, device = gpu_count(), device_name()
    rows = []
    for framework in args.framework:
        for workers in args.workers:
            print(f"{framework} N={workers} ...", flush=True)
            row = run_one(args, framework, workers, gpus)
            if row["status"] == "measured":
                print(f"  {row['median_step_s'] * 1e3:.1f} ms/step, {row['tokens_per_s']:,.0f} tokens/s",
                      flush=True)
            else:
                print(f"  not measured: {row['reason']}", flush=True)
            rows.append(row)
    add_efficiency(rows)
    env = environment() | {"cpu_count": cpu_cores()}  # after the workers: JAX here starts late
    settings = {"preset": args.preset, "dtype": args.dtype, "frameworks": list(args.framework),
                "workers": list(args.workers), "steps": args.steps, "warmup_steps": args.warmup_steps,
                "mode": "strong" if args.max_tokens is not None else "weak",
                "max_tokens": args.max_tokens, "buckets": list(args.buckets),
                "per_worker_tokens": None if args.max_tokens else args.per_worker_tokens,
                "pairs": f"max({NUM_PAIRS}, global token budget) synthetic pairs, Multi30k-like lengths "
                f"{MIN_LEN}-{MAX_LEN} (benchmarks/scaling.py: pairs); full batches only",
                "parity": False,
                "torch": "DDP under torchrun at N > 1 (gloo on CPU, NCCL on GPU)",
                "jax": "one process, Mesh over N devices (XLA_FLAGS host devices on CPU)"}
    if device == "cpu":
        settings["note"] = CPU_NOTE
    return {"device": device, "gpus": gpus, "environment": env, "settings": settings, "rows": rows,
            "wall_s": time.perf_counter() - started}


def parse(argv: list[str] | None) -> tuple[Parser, argparse.Namespace]:
    cli = parser(__file__, __doc__)
    cli.add_argument("--framework", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS))
    cli.add_argument("--workers", nargs="+", type=core_count, default=[1, 2],
                     help="the Ns to measure (at most the cores: a process each)")
    cli.add_argument("--preset", choices=PRESET_NAMES, default="small")
    cli.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    budget = cli.add_mutually_exclusive_group()
    budget.add_argument("--per-worker-tokens", type=positive_int, default=4096,
                        help="weak scaling (the default): a global batch of N x this many tokens")
    budget.add_argument("--max-tokens", type=positive_int, default=None,
                        help="strong scaling: this global batch at every N (the same batches)")
    cli.add_argument("--buckets", nargs="+", type=positive_int, default=list(BUCKETS),
                     help="batch lengths (default: the harness's up to the longest pair); each one "
                          "in use is one more compilation for JAX, so one bucket (48) is quickest")
    cli.add_argument("--steps", type=count, default=10, help="timed steps")
    cli.add_argument("--warmup-steps", type=integer_type(0, MAX_COUNT), default=3)
    cli.add_argument("--out-dir", type=given_path, default=None, help="default: benchmarks/results")
    cli.add_argument("--overwrite", action="store_true", help="replace today's results file")
    cli.add_argument("--no-write", action="store_true", help="print the table only")
    cli.add_argument("--timeout", type=positive_real, default=1800, help="seconds per measurement")
    cli.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    cli.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    cli.add_isa()
    args = cli.parse_args(argv)
    cli.apply_isa(args, argv)  # --isa: the run again, every library capped (docs/benchmarks.md)
    if len(set(args.workers)) != len(args.workers):
        cli.error("argument --workers: takes distinct integers >= 1")
    if sorted(set(args.buckets)) != args.buckets or args.buckets[-1] < MAX_LEN + 1:
        cli.error(f"--buckets takes increasing lengths, the last at least {MAX_LEN + 1} "
                  "(the longest pair)")
    if args.buckets[-1] > preset(args.preset).max_len:
        cli.error(f"--buckets: {args.buckets[-1]} is longer than preset {args.preset}'s max_len")
    if (args.max_tokens if args.max_tokens is not None else args.per_worker_tokens) < args.buckets[-1]:
        cli.error(f"a token budget must be at least {args.buckets[-1]} (the longest batch shape)")
    # issue 57: the largest global batch must be one memory can hold (one float32 d_model vector a token)
    budget_flag, tokens = (("--max-tokens", args.max_tokens) if args.max_tokens is not None
                           else ("--per-worker-tokens", args.per_worker_tokens))
    share = 1 if args.max_tokens is not None else max(args.workers)
    cli.fits_memory(budget_flag, tokens, 8 * share * preset(args.preset).d_model,
                    "tokens" if share == 1 else f"tokens a worker, {share} workers")
    if args.worker and (len(args.framework) != 1 or len(args.workers) != 1 or args.result is None):
        cli.error("--worker measures one framework at one N into --result")
    return cli, args


def main(argv: list[str] | None = None) -> None:
    cli, args = parse(argv)
    if args.worker:
        row = measure(args)
        if row is not None:
            args.result.write_text(json.dumps(row))
        return
    out_dir = args.out_dir or RESULTS
    name = results_name(device_name())
    if not args.no_write and (out_dir / f"{name}.json").exists() and not args.overwrite:
        cli.error(f"{out_dir / name}.json already exists: pass --overwrite to replace it, or --out-dir")
    if not args.no_write:  # before the first measurement
        cli.check_out_dir(out_dir, [f"{name}.json", f"{name}.md"])
    result = run(args)
    text = with_machine(markdown(result), result["environment"])
    print(text)
    if not args.no_write:
        print("wrote", *write_results(name, result, text, out_dir))


if __name__ == "__main__":
    main()
