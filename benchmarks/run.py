"""The benchmark runner: training throughput, forward latency and decoding speed of every
backend, each divided by the same measurement of a `torch.nn.Transformer` peer taken in the
same run (benchmarks/peer.py: same config, same weights, same step).

    python -m benchmarks.run --suite cpu      # tiny, and small at 250 x 24; float32 (8 min, 2 cores)
    python -m benchmarks.run --suite gpu      # base, big, tiny; bfloat16 and float32 (TF32): 9 min
    python -m benchmarks.run --suite smoke    # tiny, one repeat: CI's check that it runs

Implementations: `numpy` (forward and decoding only), `torch` (eager), `torch.compile` (forward
and loss as one graph), `jax` (jit), `peer`. Warm-up calls (compilation) are excluded and their
duration recorded; the device is synchronised before every clock read; each number is the
median of repeats, with the spread. float32 on GPUs runs with TF32 allowed in both frameworks
(JAX's default; `set_float32_matmul_precision("high")` in PyTorch), so the comparison is fair;
parity runs turn it off. On a GPU each (preset, dtype) runs in its own process. Results go to
benchmarks/results/<suite>_<device>_<date>.{json,md,png}, with the commit, versions and settings.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import multiprocessing
import os
import re
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

# Before JAX starts: allocate GPU memory on demand, so JAX and PyTorch share the device and
# JAX's peak memory is measurable (it preallocates 75% by default).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from benchmarks.common import RESULTS, environment, write_results
from benchmarks.peer import make_peer
from benchmarks.report import markdown, plot
from jax_impl import train as jax_train
from jax_impl.backend import DTYPES as JAX_DTYPES
from jax_impl.backend import Model as JaxModel
from jax_impl.convert import build_model
from rosetta import from_params, preset
from rosetta.files import atomic_write_bytes
from rosetta.flops import forward_flops, mfu, peak_flops, training_flops
from rosetta.parity import random_batch
from rosetta.training import TrainConfig
from torch_impl import train as torch_train
from torch_impl.backend import Model as TorchModel


@dataclass(frozen=True)
class Size:
    batch: int  # training and forward batch: [batch, length] source and target
    length: int
    decode_batch: int
    decode_len: int  # source length; the search may emit up to decode_len + margin tokens
    margin: int


CHUNKED = "(chunked loss)"  # the implementation-name suffix of steps with the chunked loss


@dataclass(frozen=True)
class Suite:
    presets: dict[str, Size]
    dtypes: tuple[str, ...]
    steps: int  # timed training steps per repeat
    repeats: int
    warmup: int
    compile: tuple[tuple[str, str], ...]  # (preset, dtype) where torch.compile is measured
    xla_flags: str = ""  # XLA_FLAGS for the run, unless the caller set XLA_FLAGS


SUITES = {
    "smoke": Suite({"tiny": Size(8, 16, 4, 8, 4)}, ("float32",), 2, 1, 1, ()),
    # torch.compile takes minutes per graph on 2 cores: measured on tiny only.
    # small at a real batch: 250 x 24 tokens a side, about Multi30k's 4,096-token batches.
    "cpu": Suite({"tiny": Size(32, 32, 16, 16, 16), "small": Size(250, 24, 8, 16, 16)},
                 ("float32",), 2, 5, 2, (("tiny", "float32"),)),
    # base and big first (they matter), 384 x 64 tokens a side: the paper's ~25,000 source and
    # target tokens per batch (§5.1); torch.compile on bfloat16 only, to stay < 10 min.
    "gpu": Suite({"base": Size(384, 64, 64, 32, 32), "big": Size(384, 64, 64, 32, 32),
                  "tiny": Size(64, 32, 32, 32, 32)}, ("bfloat16", "float32"), 10, 3, 3,
                 (("base", "bfloat16"), ("big", "bfloat16")),
                 # Matmuls through cuBLAS, as PyTorch's: XLA's default also autotunes Triton GEMM
                 # kernels, ~70 s per compiled step on an H100, which does not fit in 10 minutes.
                 xla_flags="--xla_gpu_enable_triton_gemm=false"),
}


def sync() -> None:
    """Wait for queued device work before reading the clock (PITFALLS 13)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def finish(outs: list) -> None:
    """Wait until the last output in `outs` (if any) is computed: JAX dispatches asynchronously."""
    if outs and isinstance(outs[-1], jax.Array):
        jax.block_until_ready(outs[-1])
    sync()


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
    return {
        "median_s": float(np.median(times)),
        "min_s": min(times),
        "max_s": max(times),
        "repeats": repeats,
        "inner": inner,
        "warmup_s": warmup_s,
    }


def measure_interleaved(fns: dict, repeats: int, warmup: int, inner: int = 1) -> dict[str, dict]:
    """`measure` for several functions at once, paired: after every function's warm-up, each
    repeat times one block of `inner` calls of every function in turn."""
    warmup_s, times = {}, {name: [] for name in fns}
    for name, fn in fns.items():
        start = time.perf_counter()
        finish([fn() for _ in range(warmup)][-1:])
        warmup_s[name] = time.perf_counter() - start
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            finish([fn() for _ in range(inner)][-1:])
            times[name].append((time.perf_counter() - start) / inner)
    return {
        name: {"median_s": float(np.median(t)), "min_s": min(t), "max_s": max(t), "repeats": repeats,
               "inner": inner, "warmup_s": warmup_s[name]}
        for name, t in times.items()
    }


def log(what: str, t: dict) -> None:
    print(f"    {what}: warm-up {t['warmup_s']:.1f} s, median {t['median_s'] * 1e3:.2f} ms", flush=True)


def training_batch(cfg, size: Size, seed: int = 0):
    """A fixed synthetic batch with realistic padding: labels are tgt shifted left, eos after
    the last real token (SPEC §4)."""
    src, tgt = random_batch(cfg, size.batch, size.length, size.length, seed=seed)
    labels = np.full_like(tgt, cfg.pad_id)
    for b in range(len(tgt)):
        n = int((tgt[b] != cfg.pad_id).sum())
        labels[b, : n - 1] = tgt[b, 1:n]
        labels[b, n - 1] = cfg.eos_id
    return src, tgt, labels


def autocast_dtype(dtype: str) -> torch.dtype | None:
    """PyTorch computes bfloat16 under torch.autocast with float32 weights, as the trainer does."""
    return torch.bfloat16 if dtype == "bfloat16" else None


def autocast(dtype: str, device: str) -> torch.autocast:
    return torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == "bfloat16")


def peak_memory(impl: str, device: str) -> int | None:
    """Peak device memory of the last measurement; None on CPU. JAX's peak is process-wide."""
    if device != "cuda":
        return None
    if impl == "jax":
        return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    return torch.cuda.max_memory_allocated()


def bench_training(
    cfg, params, peer, size: Size, dtype: str, suite: Suite, compile_ok: bool, device: str
) -> list[dict]:
    """Every implementation's training step on the same batch from the same weights. On the CPU
    the repeats are interleaved (one block of `suite.steps` steps of each in turn), so a slow
    spell of the machine falls on all of them alike; on a GPU each runs alone (see below).
    `(chunked loss)`: the output projection and loss in chunks (docs/loss.md), the same loss."""
    tc = TrainConfig(warmup_steps=4000)
    src, tgt, labels = training_batch(cfg, size)
    flops = training_flops(cfg, size.batch, size.length, size.length)
    real_tokens = int((labels != cfg.pad_id).sum())

    def torch_runner(module, compile: bool = False, loss: str = "plain"):
        optimizer, scheduler = torch_train.make_optimizer(module, tc)
        step = torch_train.make_train_step(module, optimizer, scheduler, tc, autocast_dtype(dtype), compile,
                                           loss)
        batch = [torch.from_numpy(a).to(device) for a in (src, tgt, labels)]
        return lambda: step(*batch)[0]

    def jax_runner(loss: str = "plain"):
        model = build_model(cfg, params, JAX_DTYPES[dtype])
        optimizer, rngs = jax_train.make_optimizer(model, tc), nnx.Rngs(dropout=0)
        step = jax_train.make_train_step(model, optimizer, rngs, tc, loss=loss)
        batch = [jnp.asarray(a) for a in (src, tgt, labels)]
        return lambda: step(*batch)[0]

    def ours(compile: bool = False, loss: str = "plain"):
        return lambda: torch_runner(TorchModel(cfg, params, "float32", device).module, compile, loss)

    impls = {"torch": ours(), f"torch {CHUNKED}": ours(loss="chunked")}
    if compile_ok:
        impls["torch.compile"] = ours(compile=True)  # forward and loss
    impls["peer"] = lambda: torch_runner(copy.deepcopy(peer).to(device))  # its weights stay as given
    # JAX last: its allocator keeps what it took (see measure_group).
    impls["jax"], impls[f"jax {CHUNKED}"] = jax_runner, lambda: jax_runner("chunked")
    if device == "cuda":
        timings = {}
        for name, make in impls.items():
            # Hand back what the previous implementation's caching allocator still holds, so that
            # each peak, and JAX (which allocates outside it), start from a free device.
            torch.cuda.empty_cache()
            step = make()
            torch.cuda.reset_peak_memory_stats()
            timings[name] = measure(step, suite.repeats, suite.warmup, inner=suite.steps)
            timings[name]["peak_memory_bytes"] = peak_memory(name, device)
    else:
        timings = measure_interleaved({name: make() for name, make in impls.items()}, suite.repeats,
                                      suite.warmup, inner=suite.steps)
    rows = []
    for name, t in timings.items():
        log(f"train {name}", t)
        rows.append(
            dict(
                task="train",
                impl=name,
                **t,
                tokens_per_s=real_tokens / t["median_s"],
                padded_tokens_per_s=labels.size / t["median_s"],
                flops_per_step=flops,
                peak_memory_bytes=t.pop("peak_memory_bytes", None),
            )
        )
    return rows


def bench_forward(cfg, params, peer, size: Size, dtype: str, suite: Suite, device: str) -> list[dict]:
    src, tgt, _ = training_batch(cfg, size, seed=1)
    rows = []
    torch_module = TorchModel(cfg, params, "float32", device).module
    src_t, tgt_t = torch.from_numpy(src).to(device), torch.from_numpy(tgt).to(device)

    def torch_fwd(module):
        def run():
            with torch.inference_mode(), autocast(dtype, device):
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
        rows.append(
            dict(
                task="forward",
                impl=name,
                **t,
                sentences_per_s=size.batch / t["median_s"],
                flops=forward_flops(cfg, size.batch, size.length, size.length),
            )
        )
    return rows


def bench_decoding(cfg, params, peer, size: Size, suite: Suite, device: str) -> list[dict]:
    src, _ = random_batch(cfg, size.decode_batch, size.decode_len, 2, seed=2)
    rows = []
    models = {"torch": TorchModel(cfg, params, "float32", device), "jax": JaxModel(cfg, params, "float32")}
    if device == "cpu":
        models["numpy"] = from_params(cfg, params, "numpy", "float32")
    for beam in (1, 4):
        for name, model in models.items():
            start = time.perf_counter()
            out = model.generate(src, beam, 0.6, size.margin)  # the warm-up (compilation) call
            warmup_s = time.perf_counter() - start
            tokens = sum(len(t) + 1 for t in out.tokens)
            t = measure(
                lambda model=model, beam=beam: model.generate(src, beam, 0.6, size.margin),
                max(1, suite.repeats),
                warmup=0,
            ) | {"warmup_s": warmup_s}
            log(f"decode {name} beam {beam}", t)
            rows.append(
                dict(
                    task="decode",
                    impl=name,
                    search="greedy" if beam == 1 else f"beam {beam}",
                    **t,
                    tokens=tokens,
                    tokens_per_s=tokens / t["median_s"],
                    sentences_per_s=len(src) / t["median_s"],
                )
            )
    # The peer: greedy only (nn.Transformer has no beam search), to the longest limit.
    peer.to(device).eval()
    src_t = torch.from_numpy(src).to(device)
    length = size.decode_len + size.margin
    t = measure(lambda: peer.greedy(src_t, length), max(1, suite.repeats), warmup=1)
    rows.append(
        dict(
            task="decode",
            impl="peer",
            search="greedy",
            **t,
            tokens=len(src) * length,
            tokens_per_s=len(src) * length / t["median_s"],
            sentences_per_s=len(src) / t["median_s"],
        )
    )
    return rows


def add_ratios(rows: list[dict]) -> None:
    """ratio_vs_peer = peer time / our time for the same task, preset, dtype and search (> 1:
    we are faster). The peer has greedy decoding only."""
    for row in rows:
        peers = [
            p
            for p in rows
            if p["impl"] == "peer"
            and row["impl"] != "peer"
            and all(p.get(k) == row.get(k) for k in ("task", "preset", "dtype", "search"))
        ]
        if peers:
            per_unit = "tokens" if row["task"] == "decode" else None  # decode: emitted tokens differ
            ours = row["median_s"] / row[per_unit] if per_unit else row["median_s"]
            theirs = peers[0]["median_s"] / peers[0][per_unit] if per_unit else peers[0]["median_s"]
            row["ratio_vs_peer"] = theirs / ours


def measure_group(suite_name: str, preset_name: str, dtype: str) -> list[dict]:
    """Every measurement of one preset and dtype: training, forward latency and (float32)
    decoding, each with the peer; every implementation starts from the same weights."""
    suite, size = SUITES[suite_name], SUITES[suite_name].presets[preset_name]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32, as JAX's default on GPUs
    peer, cfg, params = make_peer(preset(preset_name, max_len=max(128, size.decode_len + size.margin + 1)))
    compile_ok = (preset_name, dtype) in suite.compile
    found = bench_training(cfg, params, peer, size, dtype, suite, compile_ok, device)
    found += bench_forward(cfg, params, peer, size, dtype, suite, device)
    if dtype == "float32":
        found += bench_decoding(cfg, params, peer, size, suite, device)
    peak = peak_flops(torch.cuda.get_device_name(0) if device == "cuda" else "cpu", dtype)
    for row in found:
        row.update(preset=preset_name, dtype=dtype)
        if row["task"] == "train":
            row["mfu"] = mfu(row["flops_per_step"], row["median_s"], peak)
    return found


def run(suite_name: str, partial: Path | None = None) -> tuple[dict, str]:
    """All measurements of a suite; after each (preset, dtype), the rows so far go to `partial`.
    On a GPU each (preset, dtype) runs in a fresh process: JAX's allocator keeps the memory it
    took until the process ends, and PyTorch's measurements after it would run out."""
    suite = SUITES[suite_name]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    started = time.perf_counter()
    for preset_name in suite.presets:
        for dtype in suite.dtypes:
            t0 = time.perf_counter()
            print(f"{preset_name} {dtype}:", flush=True)
            if device == "cuda":
                spawn = multiprocessing.get_context("spawn")
                with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
                    found = pool.submit(measure_group, suite_name, preset_name, dtype).result()
            else:
                found = measure_group(suite_name, preset_name, dtype)
            rows += found
            if partial is not None:
                atomic_write_bytes(partial, json.dumps(rows, indent=1).encode())
            print(
                f"[{time.perf_counter() - started:6.1f}s] {preset_name} {dtype}: "
                f"{len(found)} rows in {time.perf_counter() - t0:.1f}s",
                flush=True,
            )
    add_ratios(rows)
    return dict(
        suite=suite_name,
        device=device_name(),
        rows=rows,
        sizes={k: v.__dict__ for k, v in suite.presets.items()},
    ), device_name()


def device_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def results_name(suite_name: str) -> str:
    """<suite>_<device>_<date>: what a run writes, as .json, .md and .png."""
    device = re.sub(r"[^A-Za-z0-9]+", "-", device_name()).strip("-").lower()
    return f"{suite_name}_{device}_{dt.date.today().isoformat()}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--suite", choices=sorted(SUITES), default="cpu")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument("--out-dir", type=Path, default=None, help="default: benchmarks/results")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace today's results file of this suite and device")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    suite = SUITES[args.suite]
    out_dir = args.out_dir or RESULTS
    name = results_name(args.suite)
    if not args.no_write and (out_dir / f"{name}.json").exists() and not args.overwrite:
        parser.error(f"{out_dir / name}.json already exists: pass --overwrite to replace it, or "
                     "--out-dir to write elsewhere")
    if suite.xla_flags and "XLA_FLAGS" not in os.environ:  # before JAX starts, here and in workers
        os.environ["XLA_FLAGS"] = suite.xla_flags
    env = environment()
    partial = None if args.no_write else out_dir / f"{args.suite}.partial.json"
    if partial is not None:
        partial.parent.mkdir(parents=True, exist_ok=True)
    measured, device = run(args.suite, partial)
    settings = {"steps per repeat": suite.steps, "warm-up calls": suite.warmup}
    if os.environ.get("XLA_FLAGS"):
        settings["XLA_FLAGS"] = os.environ["XLA_FLAGS"]
    if device != "cpu":
        settings["float32 matmuls"] = "TF32 in both frameworks"
    # The run's seconds (all but the imports' few): each suite must stay under 10 minutes.
    result = {"environment": env, "settings": settings, "wall_s": time.perf_counter() - started, **measured}
    text = markdown(result)
    print(text)
    if not args.no_write:
        json_path, md_path = write_results(name, result, text, out_dir)
        print("wrote", json_path, md_path, plot(result, json_path.with_suffix(".png")))
        partial.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
