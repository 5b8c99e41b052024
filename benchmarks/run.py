"""The benchmark runner: training throughput, forward latency and decoding speed of every
backend, each divided by the same measurement of a `torch.nn.Transformer` peer taken in the
same run (benchmarks/peer.py: same config, same weights, same step).

    python -m benchmarks.run --suite cpu      # tiny, and small at 250 x 24; float32 (~17 min, 2 cores)
    python -m benchmarks.run --suite gpu      # base, big, tiny; bfloat16 and float32 (TF32): 9 min
    python -m benchmarks.run --suite smoke    # tiny, one repeat: CI's check that it runs
    python -m benchmarks.run --suite gpu --presets base --dtypes bfloat16 --impls torch.compile jax peer

Training is the trainers' own `Trainer.step` (benchmarks/common.py: built through the registry as
`rosetta train` builds it, stepped by the harness's Stepper) on the batches the harness builds for
the copy task at the preset's size: `torch` (eager), `torch.compile` (`rosetta train --compile`),
`jax` (jit), the chunked loss of each, and `peer` (`--backend peer`). Each implementation runs
alone, on the CPU as on a GPU (every line the same but the clock: CUDA events on a GPU), and its
peak memory is its trainer's. `<impl> (rosetta train)` rows run the training loop itself on the
same batches and settings (`rosetta train --task copy`), alternated with the benchmark row
`Size.loop_pairs` times: their median ratio says what the loop adds around the step (paired_rows).
Forward and decoding: `numpy`, `torch`, `jax`, `peer` (`generate` itself for decoding). Warm-up
(compilation) is excluded and its duration recorded; each number is the median of repeats, with
the spread. float32 on GPUs runs with TF32 allowed in both frameworks (the trainers' default
outside parity mode), so the comparison is fair; parity runs turn it off. On a GPU each (preset,
dtype) runs in its own process. Results go to benchmarks/results/<suite>_<device>_<date>.{json,md,png},
with the commit, versions and settings.
"""

from __future__ import annotations

import datetime as dt
import json
import multiprocessing
import os
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

# Before JAX starts: allocate GPU memory on demand, so JAX and PyTorch share the device and
# JAX's peak memory is measurable (it preallocates 75% by default).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np
import torch

from benchmarks.common import (
    HARNESS,
    IMPL_ORDER,
    RESULTS,
    TRAINERS,
    attempt,
    build_trainer,
    environment,
    given_path,
    parser,
    release,
    time_training,
    with_machine,
    write_results,
)
from benchmarks.peer import make_peer
from benchmarks.report import markdown, plot
from jax_impl.backend import Model as JaxModel
from rosetta import from_params, preset
from rosetta.cli_args import positive_real
from rosetta.errors import RosettaError
from rosetta.files import atomic_write_bytes
from rosetta.flops import forward_flops, mfu, peak_flops, training_flops
from rosetta.harness.batching import BatchIterator
from rosetta.harness.loop import train
from rosetta.harness.metrics import batch_work
from rosetta.harness.report import read_log
from rosetta.harness.run_config import RunConfig
from rosetta.harness.stepping import HOST_PHASES
from rosetta.harness.tasks import load_task
from rosetta.parity import random_batch
from rosetta.training import Batch
from torch_impl.backend import Model as TorchModel
from torch_impl.backend import compute_context


@dataclass(frozen=True)
class Size:
    batch: int  # training and forward batch: [batch, length] source and target
    length: int
    decode_batch: int
    decode_len: int  # source length; the search may emit up to decode_len + margin tokens
    margin: int
    loop_pairs: int = 1  # alternations of a benchmark row and its loop row (paired_rows: their medians)


@dataclass(frozen=True)
class Suite:
    presets: dict[str, Size]
    dtypes: tuple[str, ...]
    steps: int  # timed training steps per repeat
    repeats: int
    warmup: int
    compile: tuple[tuple[str, str], ...]  # (preset, dtype) where torch.compile is measured
    harness: tuple[str, ...] = ()  # implementations also run as `rosetta train` on the same batches
    impls: tuple[str, ...] | None = None  # only these implementations (--impls); None: all
    name: str = ""
    peak_tflops: float | None = None  # --peak-tflops: the device's peak, where rosetta/flops.py has none
    tasks: tuple[str, ...] = ("train", "forward", "decode")  # --tasks: only these measurements
    packed: tuple[tuple[str, str], ...] = ()  # (preset, dtype) where PACKED_IMPLS also train on packed rows
    wide_beam: int = 0  # beam 4 also at this many sentences (issue 47: batching's share apart from a step's)


# The trainers also timed on packed rows (docs/packing.md); the peer has no segment masks.
PACKED_IMPLS = ("torch", "torch.compile", "jax")
SUITES = {
    "smoke": Suite({"tiny": Size(8, 16, 4, 8, 4)}, ("float32",), 2, 1, 1, (), ("torch", "jax"), name="smoke",
                   packed=(("tiny", "float32"),), wide_beam=8),
    # torch.compile takes minutes per graph on 2 cores: measured on tiny only. small at a real batch:
    # 250 x 24 tokens a side, about Multi30k's 4,096-token batches. Loop pairs: one alone moved by a third.
    "cpu": Suite({"tiny": Size(32, 32, 16, 16, 16, 7), "small": Size(250, 24, 8, 16, 16, 5)},
                 ("float32",), 2, 5, 2, (("tiny", "float32"),), ("torch", "jax"), name="cpu",
                 packed=(("tiny", "float32"), ("small", "float32"))),
    # base and big first (they matter), 384 x 64 tokens a side: the paper's ~25,000 source and
    # target tokens per batch (§5.1); torch.compile on bfloat16 only, to stay < 10 min. The XLA
    # flags JAX compiles with are the trainers' own (jax_impl/compilation.py). Packed rows on base
    # bfloat16 only: each is one more compilation (~40 s at base on the H100 of 2026-11-22).
    "gpu": Suite({"base": Size(384, 64, 64, 32, 32), "big": Size(384, 64, 64, 32, 32),
                  "tiny": Size(64, 32, 32, 32, 32)}, ("bfloat16", "float32"), 10, 3, 3,
                 (("base", "bfloat16"), ("big", "bfloat16")), ("torch.compile", "jax"), name="gpu",
                 packed=(("base", "bfloat16"),), wide_beam=256),
}


def sync() -> None:
    """Wait for queued device work before reading the clock (PITFALLS 13)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(fn, repeats: int, warmup: int, inner: int = 1) -> dict:
    """Median seconds per call of fn over `repeats` blocks of `inner` calls, after `warmup`
    calls; `warmup_s` (not part of the numbers) is what the warm-up took: mostly compilation."""
    start = time.perf_counter()
    for _ in range(warmup):
        out = fn()
    jax.block_until_ready(out) if warmup and isinstance(out, jax.Array) else sync()
    warmup_s = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            out = fn()
        jax.block_until_ready(out) if isinstance(out, jax.Array) else sync()
        times.append((time.perf_counter() - start) / inner)
    return {"median_s": float(np.median(times)), "min_s": min(times), "max_s": max(times), "repeats": repeats,
            "inner": inner, "warmup_s": warmup_s}


def log(what: str, t: dict) -> None:
    print(f"    {what}: warm-up {t['warmup_s']:.1f} s, median {t['median_s'] * 1e3:.2f} ms", flush=True)


def autocast(dtype: str, module: torch.nn.Module):
    """The forward benchmark's bfloat16 as the trainer computes (torch_impl/backend.py's one policy:
    ours casts its float32 weights once per pass, the nn.Transformer peer runs under autocast)."""
    return compute_context(module, torch.bfloat16 if dtype == "bfloat16" else None)


def harness_run(cfg, preset_name: str, size: Size) -> RunConfig:
    """`rosetta train` on the copy task at this size: one bucket of `size.length`, `size.batch`
    rows a batch (--max-tokens batch x length), the model `cfg` (the preset and what differs)."""
    base = preset(preset_name).to_dict()
    overrides = {k: v for k, v in cfg.to_dict().items() if base.get(k) != v and "vocab" not in k}
    return RunConfig(task="copy", preset=preset_name, overrides=overrides, synthetic_max_len=size.length - 1,
                     max_tokens=size.batch * size.length, buckets=(size.length,), progress=False,
                     eval_size=4, bleu_samples=4, eval_every=0, checkpoint_every=0, warmup=4000,
                     batching="bucketed")


def training_batches(cfg, preset_name: str, size: Size, count: int = 4, packing: bool = False) -> list[Batch]:
    """The first `count` batches `rosetta train` trains on at this size (`harness_run`): the same
    pairs, the same iterator (rosetta/harness/batching.py), every one [size.batch, size.length];
    `packing`: packed rows (`--batching packed`: the longest pair, size.length, rounded up to 16, at
    most the bucket size.length), as many rows."""
    run = harness_run(cfg, preset_name, size)
    task = load_task("copy", vocab_size=min(cfg.src_vocab_size, cfg.tgt_vocab_size), seed=run.seed,
                     synthetic_max_len=run.synthetic_max_len)
    batches = BatchIterator.from_config(task.train_pairs, cfg, max_tokens=run.max_tokens, buckets=run.buckets,
                                        seed=run.seed, packing=packing)
    return [next(batches) for _ in range(count)]


def train_impls(suite: Suite, preset_name: str, dtype: str) -> list[str]:
    """The training implementations of this (preset, dtype): torch.compile where the suite says."""
    names = [name for name in TRAINERS
             if name != "torch.compile" or (preset_name, dtype) in suite.compile]
    return [name for name in names if suite.impls is None or name in suite.impls]


def bench_training(cfg, params, batches: list[Batch], dtype: str, suite: Suite, impls: list[str],
                   device: str, batching: str = "bucketed") -> list[dict]:
    """Every implementation's `Trainer.step` on the same batches from the same weights, each alone
    (benchmarks/common.py time_training): built, warmed up, timed, released. `(chunked loss)`: the
    output projection and loss in chunks (docs/loss.md), the same loss. JAX last: its allocator
    keeps what it took. Each row's real-token share: the batches' real target tokens over their
    label slots (rows x L), and its real FLOPs: their sentences' alone (rosetta/harness/metrics.py)."""
    real_tokens = sum(b.num_tgt_tokens for b in batches) / len(batches)
    slots = sum(b.labels.size for b in batches) / len(batches)
    rows = []
    for name in sorted(impls, key=lambda n: TRAINERS[n][0] == "jax"):
        trainer = build_trainer(name, cfg, params, dtype, device)
        t = time_training(trainer, batches, suite.warmup, suite.repeats, suite.steps)
        del trainer
        release()
        log(f"train {name}", t)
        rows.append(dict(task="train", impl=name, **t, tokens_per_s=real_tokens / t["median_s"],
                         padded_tokens_per_s=slots / t["median_s"], batching=batching,
                         real_token_share=real_tokens / slots,
                         real_flops_per_step=sum(batch_work(cfg, b)["flops"] for b in batches) / len(batches),
                         flops_per_step=training_flops(cfg, *batches[0].shape, batches[0].shape[1])))
    return rows


def bench_harness(cfg, preset_name: str, size: Size, dtype: str, suite: Suite, impls: list[str],
                  device: str) -> list[dict]:
    """`rosetta train` itself (rosetta/harness/loop.py) on the batches of bench_training: a warm-up
    stretch, then `suite.repeats` stretches of `suite.steps` steps as the benchmark row times them
    (the loop's summary would also take a shorter last one); their median step from the run's log,
    and the host's seconds per step by phase (rosetta/harness/stepping.py: host-bound if they reach it)."""
    rows = []
    for name in [n for n in suite.harness if n in impls]:
        backend, settings = TRAINERS[name]
        run = replace(harness_run(cfg, preset_name, size), backends=(backend,), dtype=dtype, device=device,
                      steps=(1 + suite.repeats) * suite.steps, log_every=suite.steps,
                      peak_tflops=suite.peak_tflops, **settings)
        with tempfile.TemporaryDirectory() as out:
            result = train(replace(run, out=out))[backend]
            timed = [r for r in read_log(Path(out) / backend / "log.jsonl")
                     if r.get("kind") == "train" and r["step"] > suite.steps]
        release()
        t = {"median_s": statistics.median(r["step_time_s"] for r in timed), "repeats": len(timed),
             "inner": suite.steps, "peak_memory_bytes": result["peak_memory_bytes"],
             "compile_s": result["compile_time_total_s"],
             "host_s": {p: statistics.median(r[f"host_{p}_s"] for r in timed) for p in HOST_PHASES}}
        log(f"train {name}{HARNESS}", t | {"warmup_s": result["compile_time_total_s"]})
        real, pad = (statistics.median(r[f"tgt_tokens_per_s{k}"] for r in timed) for k in ("", "_padded"))
        rows.append(dict(task="train", impl=name + HARNESS, **t, tokens_per_s=real, padded_tokens_per_s=pad,
                         batching="bucketed", real_token_share=real / pad,  # real over padded tokens/s
                         flops_per_step=training_flops(cfg, size.batch, size.length, size.length)))
    return rows


def alternate(cfg, params, batches: list[Batch], preset_name: str, size: Size, dtype: str, suite: Suite,
              name: str, device: str, pairs: int) -> list[tuple[dict, list[dict]]]:
    """`pairs` alternations of `name`'s benchmark row and its loop row (none if the suite runs none),
    the loop first in every other pair: a machine that slows or speeds up over minutes then tilts no
    ratio one way (the rows ABBA ordered, as a paired comparison on a drifting instrument is)."""
    measure = {"step": lambda: bench_training(cfg, params, batches, dtype, suite, [name], device)[0],
               "loop": lambda: bench_harness(cfg, preset_name, size, dtype, suite, [name], device)}
    found = [{kind: measure[kind]() for kind in (("loop", "step") if i % 2 else ("step", "loop"))}
             for i in range(pairs)]
    return [(row["step"], row["loop"]) for row in found]


def paired_rows(pairs: list[tuple[dict, list[dict]]]) -> list[dict]:
    """The benchmark row and the loop row of `alternate`'s pairs: each the row of the median step
    (the lower middle one); the loop's `vs_benchmark`: the median of the pairs' loop/step ratios, with
    their range (one pair alone moved by a third on the 2-core CPU: results/loop_overhead_*)."""
    def middle(rows: list[dict]) -> dict:
        return sorted(rows, key=lambda r: r["median_s"])[(len(rows) - 1) // 2] | {"pairs": len(rows)}

    bench, loops = middle([b for b, _ in pairs]), [loop for _, found in pairs for loop in found]
    ratios = [found[0]["median_s"] / b["median_s"] for b, found in pairs if found]
    return [bench] + [middle(loops) | {"vs_benchmark": statistics.median(ratios),
                                       "vs_benchmark_range": [min(ratios), max(ratios)]} for _ in loops[:1]]


def bench_forward(cfg, params, peer, size: Size, dtype: str, suite: Suite, device: str) -> list[dict]:
    src, tgt = random_batch(cfg, size.batch, size.length, size.length, seed=1)  # realistic padding
    rows = []
    torch_module = TorchModel(cfg, params, "float32", device).module
    src_t, tgt_t = torch.from_numpy(src).to(device), torch.from_numpy(tgt).to(device)

    def torch_fwd(module):
        def run():
            with torch.inference_mode(), autocast(dtype, module):
                return module(src_t, tgt_t)

        return run

    jax_model = JaxModel(cfg, params, dtype)
    from jax_impl.backend import _logits

    src_j, tgt_j = jnp.asarray(src), jnp.asarray(tgt)
    impls = {"torch": torch_fwd(torch_module), "peer": torch_fwd(peer.to(device).eval())}
    if dtype == "float32" and device == "cpu":
        numpy_model = from_params(cfg, params, "numpy", "float32")
        impls["numpy"] = lambda: numpy_model.logits(src, tgt)
    impls["jax"] = lambda: _logits(jax_model.graphdef, jax_model.state, src_j, tgt_j)
    for name, fn in impls.items():
        t = measure(fn, suite.repeats, suite.warmup, inner=max(1, suite.steps // 2))
        log(f"forward {name}", t)
        rows.append(dict(task="forward", impl=name, **t, sentences_per_s=size.batch / t["median_s"],
                         flops=forward_flops(cfg, size.batch, size.length, size.length)))
    return rows


def bench_decoding(cfg, params, peer, size: Size, dtype: str, suite: Suite, device: str) -> list[dict]:
    rows = []
    models = {"torch": TorchModel(cfg, params, dtype, device), "jax": JaxModel(cfg, params, dtype)}
    if device == "cpu" and dtype == "float32":
        models["numpy"] = from_params(cfg, params, "numpy", "float32")
    searches = [(1, size.decode_batch, "greedy"), (4, size.decode_batch, "beam 4")]
    searches += [(4, suite.wide_beam, f"beam 4, {suite.wide_beam} sentences")] if suite.wide_beam else []
    for beam, sentences, search in searches:
        src, _ = random_batch(cfg, sentences, size.decode_len, 2, seed=2)
        for name, model in models.items():
            if name == "numpy" and sentences != size.decode_batch:
                continue  # the float64 reference's speed is not what the wide row asks
            start = time.perf_counter()
            out = model.generate(src, beam, 0.6, size.margin)  # the warm-up (compilation) call
            warmup_s = time.perf_counter() - start
            tokens = sum(len(t) + 1 for t in out.tokens)
            t = measure(lambda model=model, beam=beam, src=src: model.generate(src, beam, 0.6, size.margin),
                        max(1, suite.repeats), warmup=0) | {"warmup_s": warmup_s}
            log(f"decode {name} {search}", t)
            rows.append(dict(task="decode", impl=name, search=search, **t, tokens=tokens,
                             tokens_per_s=tokens / t["median_s"], sentences_per_s=len(src) / t["median_s"]))
    if dtype != "float32":  # the peer: greedy (nn.Transformer has no beam), float32, to the longest limit
        return rows
    src, _ = random_batch(cfg, size.decode_batch, size.decode_len, 2, seed=2)
    peer.to(device).eval()
    src_t = torch.from_numpy(src).to(device)
    length = size.decode_len + size.margin
    t = measure(lambda: peer.greedy(src_t, length), max(1, suite.repeats), warmup=1)
    tokens = len(src) * length
    rows.append(dict(task="decode", impl="peer", search="greedy", **t, tokens=tokens,
                     tokens_per_s=tokens / t["median_s"], sentences_per_s=len(src) / t["median_s"]))
    return rows


def add_ratios(rows: list[dict]) -> None:
    """ratio_vs_peer = peer time / our time for the same task, preset, dtype and search (> 1:
    we are faster); a packed row's: real target tokens/s over the peer's on the bucketed batches.
    The peer has greedy decoding only (a `(rosetta train)` row's vs_benchmark: paired_rows)."""
    def same(a: dict, b: dict) -> bool:
        return all(a.get(k) == b.get(k) for k in ("task", "preset", "dtype", "search"))

    for row in rows:
        peers = [p for p in rows if p["impl"] == "peer" and row["impl"] != "peer" and same(p, row)]
        if peers and row.get("batching") == "packed":  # more pairs per batch than the peer's
            row["ratio_vs_peer"] = row["tokens_per_s"] / peers[0]["tokens_per_s"]
        elif peers:
            per_unit = "tokens" if row["task"] == "decode" else None  # decode: emitted tokens differ
            ours = row["median_s"] / row[per_unit] if per_unit else row["median_s"]
            theirs = peers[0]["median_s"] / peers[0][per_unit] if per_unit else peers[0]["median_s"]
            row["ratio_vs_peer"] = theirs / ours


def measure_group(suite: Suite, preset_name: str, dtype: str) -> list[dict]:
    """Every measurement of one preset and dtype: training (the benchmark's and the loop's),
    forward latency and decoding (the peer's greedy search in float32 only), each with the peer;
    every implementation starts from the same weights and trains on the same batches."""
    size = suite.presets[preset_name]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 in forward and decoding, as JAX's default
    peer, cfg, params = make_peer(preset(preset_name, max_len=max(128, size.decode_len + size.margin + 1)))
    batches = training_batches(cfg, preset_name, size)
    impls = train_impls(suite, preset_name, dtype)
    found = []

    def guarded(task: str, impl: str, run: Callable[[], list[dict]]) -> list[dict]:
        """run()'s rows, or one row with its error (common.attempt): the other measurements still run."""
        rows, error = attempt(f"{task} {impl}", run)
        return rows if error is None else [dict(task=task, impl=impl, error=error)]

    if "train" in suite.tasks:  # JAX last (its allocator keeps what it took); each loop row right after
        packed = training_batches(cfg, preset_name, size, packing=True)  # the same pairs (docs/packing.md)
        for name in sorted(impls, key=lambda n: TRAINERS[n][0] == "jax"):  # its step's, alternated
            pairs = size.loop_pairs if name in suite.harness else 1
            found += guarded("train", name, lambda name=name, pairs=pairs: paired_rows(alternate(
                cfg, params, batches, preset_name, size, dtype, suite, name, device, pairs)))
            if (preset_name, dtype) in suite.packed and name in PACKED_IMPLS:
                found += guarded("train", f"{name} packed", lambda name=name: bench_training(
                    cfg, params, packed, dtype, suite, [name], device, "packed"))
    if "forward" in suite.tasks:
        found += guarded("forward", "all", lambda: bench_forward(cfg, params, peer, size, dtype, suite,
                                                                 device))
    if "decode" in suite.tasks:
        found += guarded("decode", "all", lambda: bench_decoding(cfg, params, peer, size, dtype, suite,
                                                                 device))
    peak = (suite.peak_tflops * 1e12 if suite.peak_tflops is not None
            else peak_flops(torch.cuda.get_device_name(0) if device == "cuda" else "cpu", dtype))
    real_flops = sum(batch_work(cfg, b)["flops"] for b in batches) / len(batches)
    for row in found:
        row.update(preset=preset_name, dtype=dtype)
        if row["task"] == "train" and "error" not in row:  # real-token MFU: the batches' sentences alone
            row.setdefault("real_flops_per_step", real_flops)  # the loop's rows: the bucketed batches'
            row["mfu"] = mfu(row["real_flops_per_step"], row["median_s"], peak)
    return found


def run(suite: Suite | str, partial: Path | None = None) -> tuple[dict, str]:
    """All measurements of a suite (or its name); after each (preset, dtype), the rows so far go to
    `partial`. On a GPU each (preset, dtype) runs in a fresh process: JAX's allocator keeps the
    memory it took until the process ends, and PyTorch's measurements after it would run out."""
    suite = SUITES[suite] if isinstance(suite, str) else suite
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows, failed = [], []
    started = time.perf_counter()
    for preset_name in suite.presets:
        for dtype in suite.dtypes:
            t0 = time.perf_counter()
            print(f"{preset_name} {dtype}:", flush=True)
            if device == "cuda":
                spawn = multiprocessing.get_context("spawn")
                with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
                    found = pool.submit(measure_group, suite, preset_name, dtype).result()
            else:
                found = measure_group(suite, preset_name, dtype)
            rows += [r for r in found if "error" not in r]
            failed += [r for r in found if "error" in r]
            if partial is not None:
                atomic_write_bytes(partial, json.dumps(rows, indent=1).encode())
            print(f"[{time.perf_counter() - started:6.1f}s] {preset_name} {dtype}: {len(found)} rows in "
                  f"{time.perf_counter() - t0:.1f}s", flush=True)
    add_ratios(rows)
    sizes = {k: v.__dict__ for k, v in suite.presets.items()}
    return dict(suite=suite.name, device=device_name(), rows=rows, failed=failed, sizes=sizes), device_name()


def select(suite: Suite, presets: list[str] | None, dtypes: list[str] | None,
           impls: list[str] | None) -> Suite:
    """The suite narrowed to the presets, dtypes and implementations asked for (None: the suite's)."""
    for given, known, flag in ((presets, list(suite.presets), "--presets"), (dtypes, list(suite.dtypes),
                                                                              "--dtypes")):
        unknown = sorted(set(given or ()) - set(known))
        if unknown:
            raise RosettaError(f"argument {flag}: {' '.join(unknown)}: suite {suite.name} has "
                               f"{', '.join(known)}")
    return replace(suite, presets={k: v for k, v in suite.presets.items() if presets is None or k in presets},
                   dtypes=tuple(d for d in suite.dtypes if dtypes is None or d in dtypes),
                   impls=None if impls is None else tuple(impls))


def device_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def results_name(suite_name: str, tasks: tuple[str, ...] = Suite.tasks) -> str:
    """<suite>_<device>_<date>: what a run writes, as .json, .md and .png; a run of some tasks only
    is <suite>-<tasks>_..., which the docs' tables (benchmarks/report.py: <suite>_*) do not take."""
    device = re.sub(r"[^A-Za-z0-9]+", "-", device_name()).strip("-").lower()
    part = "" if set(tasks) == set(Suite.tasks) else "-" + "-".join(tasks)
    return f"{suite_name}{part}_{device}_{dt.date.today().isoformat()}"


def main(argv: list[str] | None = None) -> None:
    cli = parser(__file__, __doc__)
    cli.add_argument("--suite", choices=sorted(SUITES), default="cpu")
    cli.add_argument("--presets", nargs="+", help="only these presets of the suite")
    cli.add_argument("--dtypes", nargs="+", help="only these dtypes of the suite")
    cli.add_argument("--impls", nargs="+", choices=IMPL_ORDER,
                     help="only these implementations (training rows, and the `(rosetta train)` rows of "
                          "those the suite runs so); forward and decoding keep theirs")
    cli.add_argument("--tasks", nargs="+", choices=Suite.tasks, default=list(Suite.tasks),
                     help="only these measurements (default: all)")
    cli.add_argument("--peak-tflops", type=positive_real, default=None,
                     help="the device's peak TFLOP/s in the run's dtype, for MFU (default: "
                          "rosetta/flops.py's table of known GPUs)")
    cli.add_argument("--no-write", action="store_true", help="print the table only")
    cli.add_argument("--out-dir", type=given_path, default=None, help="default: benchmarks/results")
    cli.add_argument("--overwrite", action="store_true",
                     help="replace today's results file of this suite and device")
    cli.add_isa()
    args = cli.parse_args(argv)
    cli.apply_isa(args, argv)  # --isa: the run again, every library capped (docs/benchmarks.md)
    started = time.perf_counter()
    with cli.refusing():
        suite = replace(select(SUITES[args.suite], args.presets, args.dtypes, args.impls),
                        peak_tflops=args.peak_tflops, tasks=tuple(t for t in Suite.tasks if t in args.tasks))
    out_dir = args.out_dir or RESULTS
    name = results_name(args.suite, suite.tasks)
    if not args.no_write and (out_dir / f"{name}.json").exists() and not args.overwrite:
        cli.error(f"{out_dir / name}.json already exists: pass --overwrite to replace it, or "
                  "--out-dir to write elsewhere")
    if not args.no_write:  # every file the run writes, before its first measurement
        cli.check_out_dir(out_dir, [f"{name}.json", f"{name}.md", f"{name}.png",
                                    f"{args.suite}.partial.json"])
    env = environment()
    partial = None if args.no_write else out_dir / f"{args.suite}.partial.json"
    if partial is not None:
        partial.parent.mkdir(parents=True, exist_ok=True)
    measured, device = run(suite, partial)
    settings = {"steps per repeat": suite.steps, "warm-up calls": suite.warmup,
                **({"tasks": " ".join(suite.tasks)} if suite.tasks != Suite.tasks else {}),
                **({"XLA_FLAGS": os.environ["XLA_FLAGS"]} if os.environ.get("XLA_FLAGS") else {})}
    if device != "cpu":
        settings["float32 matmuls"] = "TF32 in both frameworks"
    # The run's seconds (all but the imports' few): gpu under 10 minutes, cpu under 20 (its loop pairs).
    result = {"environment": env, "settings": settings, "wall_s": time.perf_counter() - started, **measured}
    text = with_machine(markdown(result), env)
    print(text)
    if not args.no_write:
        json_path, md_path = write_results(name, result, text, out_dir, replace=args.overwrite)
        png = plot(result, json_path.with_suffix(".png"))
        print("wrote", json_path, md_path, *([png] if png else []))
        partial.unlink(missing_ok=True)
    if measured["failed"]:
        raise SystemExit(f"benchmarks.run: {len(measured['failed'])} measurements failed (" + ", ".join(
            f"{r['preset']} {r['dtype']} {r['task']} {r['impl']}" for r in measured["failed"])
            + "): their errors are in the results")


if __name__ == "__main__":
    main()
