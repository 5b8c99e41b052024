"""The benchmark runner: training throughput, forward latency and decoding speed of every
backend, each divided by the same measurement of a `torch.nn.Transformer` peer taken in the
same run (benchmarks/peer.py: same config, same weights, same step).

    python -m benchmarks.run --suite cpu      # tiny and small presets, float32 (< 10 min, 2 cores)
    python -m benchmarks.run --suite gpu      # tiny, base, big; float32 (TF32) and bfloat16
    python -m benchmarks.run --suite smoke    # tiny, one repeat: CI's check that it runs

Implementations: `numpy` (forward and decoding only), `torch` (eager), `torch.compile`, `jax`
(jit), `peer`. Warm-up steps (compilation) are excluded; the device is synchronised before every
clock read; each number is the median of repeats, with the spread. float32 on GPUs runs with
TF32 allowed in both frameworks (JAX's default; `set_float32_matmul_precision("high")` in
PyTorch), so the comparison is fair; parity runs turn it off. Results go to
benchmarks/results/<suite>_<device>_<date>.{json,md}, with the commit, versions and settings.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import re
import time
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
from jax_impl import train as jax_train
from jax_impl.backend import Model as JaxModel
from jax_impl.convert import build_model
from rosetta import from_params, preset
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


@dataclass(frozen=True)
class Suite:
    presets: dict[str, Size]
    dtypes: tuple[str, ...]
    steps: int  # timed training steps per repeat
    repeats: int
    warmup: int
    compile: tuple[tuple[str, str], ...]  # (preset, dtype) where torch.compile is measured


SUITES = {
    "smoke": Suite({"tiny": Size(8, 16, 4, 8, 4)}, ("float32",), 2, 1, 1, ()),
    # torch.compile takes minutes per graph on 2 cores: measured on tiny only.
    "cpu": Suite({"tiny": Size(32, 32, 16, 16, 16), "small": Size(16, 32, 8, 16, 16)},
                 ("float32",), 5, 3, 2, (("tiny", "float32"),)),
    # base and big first (they matter); torch.compile where it counts, bfloat16, to stay < 10 min.
    "gpu": Suite({"base": Size(256, 64, 64, 32, 32), "big": Size(256, 64, 64, 32, 32),
                  "tiny": Size(64, 32, 32, 32, 32)}, ("bfloat16", "float32"), 10, 3, 3,
                 (("base", "bfloat16"), ("big", "bfloat16"))),
}

def sync() -> None:
    """Wait for queued device work before reading the clock (PITFALLS 13)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(fn, repeats: int, warmup: int, inner: int = 1) -> dict:
    """Median seconds per call of fn over `repeats` blocks of `inner` calls, after `warmup`."""
    for _ in range(warmup):
        fn()
    sync()
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
    }


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


def autocast(dtype: str, device: str):
    if dtype == "bfloat16":
        return torch.autocast(device, dtype=torch.bfloat16)
    return contextlib.nullcontext()


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
    tc = TrainConfig(warmup_steps=4000)
    src, tgt, labels = training_batch(cfg, size)
    flops = training_flops(cfg, size.batch, size.length, size.length)
    real_tokens = int((labels != cfg.pad_id).sum())
    rows = []

    def torch_runner(module):
        optimizer, scheduler = torch_train.make_optimizer(module, tc)
        batch = [torch.from_numpy(a).to(device) for a in (src, tgt, labels)]

        def step():
            with autocast(dtype, device):
                return torch_train.train_step(module, optimizer, scheduler, *batch, tc)[0]

        return step

    impls = {"torch": lambda: torch_runner(TorchModel(cfg, params, "float32", device).module)}
    if compile_ok:
        impls["torch.compile"] = lambda: torch_runner(
            torch.compile(TorchModel(cfg, params, "float32", device).module)
        )
    jax_dtype = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32

    def jax_runner():
        model = build_model(cfg, params, jax_dtype)
        optimizer, rngs = jax_train.make_optimizer(model, tc), nnx.Rngs(dropout=0)
        batch = [jnp.asarray(a) for a in (src, tgt, labels)]
        return lambda: jax_train.train_step(model, optimizer, rngs, *batch, tc)[0]

    impls["jax"] = jax_runner
    impls["peer"] = lambda: torch_runner(peer.to(device))
    for name, make in impls.items():
        if device == "cuda":
            # Hand back what the previous implementation's caching allocator still holds: JAX
            # allocates outside it and ran out of memory on `big` without this.
            torch.cuda.empty_cache()
        step = make()
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t = measure(step, suite.repeats, suite.warmup, inner=suite.steps)
        peak = peak_memory(name, device)
        rows.append(
            dict(
                task="train",
                impl=name,
                **t,
                tokens_per_s=real_tokens / t["median_s"],
                padded_tokens_per_s=labels.size / t["median_s"],
                flops_per_step=flops,
                peak_memory_bytes=peak,
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
    impls = {
        "torch": torch_fwd(torch_module),
        "jax": lambda: _logits(jax_model.graphdef, jax_model.state, src_j, tgt_j),
        "peer": torch_fwd(peer.to(device).eval()),
    }
    if dtype == "float32" and device == "cpu":
        numpy_model = from_params(cfg, params, "numpy", "float32")
        impls["numpy"] = lambda: numpy_model.logits(src, tgt)
    for name, fn in impls.items():
        t = measure(fn, suite.repeats, suite.warmup, inner=max(1, suite.steps // 2))
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
            out = model.generate(src, beam, 0.6, size.margin)
            tokens = sum(len(t) + 1 for t in out.tokens)
            t = measure(
                lambda model=model, beam=beam: model.generate(src, beam, 0.6, size.margin),
                max(1, suite.repeats),
                warmup=1 if name != "numpy" else 0,
            )
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


def run(suite_name: str, partial: Path | None = None) -> tuple[dict, str]:
    """All measurements of a suite; after each (preset, dtype), the rows so far go to `partial`."""
    suite = SUITES[suite_name]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    device_name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    if device == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32, as JAX's default on GPUs
    rows = []
    started = time.perf_counter()
    for preset_name, size in suite.presets.items():
        base_cfg = preset(preset_name, max_len=max(128, size.decode_len + size.margin + 1))
        peer, cfg, params = make_peer(base_cfg)
        for dtype in suite.dtypes:
            tag = dict(preset=preset_name, dtype=dtype)
            t0 = time.perf_counter()
            found = bench_training(
                cfg, params, peer, size, dtype, suite, (preset_name, dtype) in suite.compile, device
            )
            found += bench_forward(cfg, params, peer, size, dtype, suite, device)
            if dtype == "float32":
                found += bench_decoding(cfg, params, peer, size, suite, device)
            peak = peak_flops(device_name, dtype)
            for row in found:
                row.update(tag)
                if row["task"] == "train":
                    row["mfu"] = mfu(row["flops_per_step"], row["median_s"], peak)
            rows += found
            if partial is not None:
                partial.write_text(json.dumps(rows, indent=1))
            print(
                f"[{time.perf_counter() - started:6.1f}s] {preset_name} {dtype}: "
                f"{len(found)} rows in {time.perf_counter() - t0:.1f}s",
                flush=True,
            )
    add_ratios(rows)
    return dict(
        suite=suite_name,
        device=device_name,
        rows=rows,
        sizes={k: v.__dict__ for k, v in suite.presets.items()},
    ), device_name


def markdown(result: dict, env: dict) -> str:
    def fmt(x, spec=".3g"):
        return "–" if x is None else format(x, spec)

    lines = [
        f"# Benchmarks: {result['suite']} suite on {result['device']}",
        "",
        f"{env['date']}, commit {env['commit']}, torch {env.get('torch')}, jax {env.get('jax')}, "
        f"flax {env.get('flax')}. Median of {result['rows'][0]['repeats']} repeats (spread in "
        "brackets); ratio vs peer = peer time / our time for the same work (torch.nn.Transformer, "
        "same weights; > 1 means faster than the peer; decoding: per emitted token). Sizes: "
        + "; ".join(
            f"{k}: train/forward {v['batch']}x{v['length']}, decode {v['decode_batch']} "
            f"sentences x {v['decode_len']} + {v['margin']}"
            for k, v in result["sizes"].items()
        ),
        "",
        "## Training (one optimizer step, dropout on)",
        "",
        "| preset | dtype | impl | step ms | target tokens/s (real) | padded tokens/s | MFU | "
        "peak mem GB | ratio vs peer |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in (r for r in result["rows"] if r["task"] == "train"):
        mem = None if r.get("peak_memory_bytes") is None else r["peak_memory_bytes"] / 1e9
        lines.append(
            f"| {r['preset']} | {r['dtype']} | {r['impl']} | {r['median_s'] * 1e3:.1f} "
            f"[{r['min_s'] * 1e3:.1f}–{r['max_s'] * 1e3:.1f}] | {r['tokens_per_s']:,.0f} | "
            f"{r['padded_tokens_per_s']:,.0f} | {fmt(r.get('mfu') and 100 * r['mfu'], '.1f')}"
            f"{'%' if r.get('mfu') else ''} | {fmt(mem, '.2f')} | {fmt(r.get('ratio_vs_peer'), '.2f')} |"
        )
    lines += [
        "",
        "## Forward latency (one batch)",
        "",
        "| preset | dtype | impl | ms | sentences/s | ratio vs peer |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in (r for r in result["rows"] if r["task"] == "forward"):
        lines.append(
            f"| {r['preset']} | {r['dtype']} | {r['impl']} | {r['median_s'] * 1e3:.2f} "
            f"[{r['min_s'] * 1e3:.2f}–{r['max_s'] * 1e3:.2f}] | {r['sentences_per_s']:,.0f} | "
            f"{fmt(r.get('ratio_vs_peer'), '.2f')} |"
        )
    lines += [
        "",
        "## Decoding (float32, cached; peer: nn.Transformer re-decoding the prefix)",
        "",
        "| preset | impl | search | s | sentences/s | tokens/s | ratio vs peer |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in (r for r in result["rows"] if r["task"] == "decode"):
        lines.append(
            f"| {r['preset']} | {r['impl']} | {r['search']} | {r['median_s']:.3f} | "
            f"{r['sentences_per_s']:,.1f} | {r['tokens_per_s']:,.0f} | {fmt(r.get('ratio_vs_peer'), '.2f')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--suite", choices=sorted(SUITES), default="cpu")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument("--out-dir", type=Path, default=None, help="default: benchmarks/results")
    args = parser.parse_args(argv)
    env = environment()
    partial = None if args.no_write else (args.out_dir or RESULTS) / f"{args.suite}.partial.json"
    if partial is not None:
        partial.parent.mkdir(parents=True, exist_ok=True)
    result, device_name = run(args.suite, partial)
    text = markdown(result, env)
    print(text)
    if not args.no_write:
        device = re.sub(r"[^A-Za-z0-9]+", "-", device_name).strip("-").lower()
        name = f"{args.suite}_{device}_{dt.date.today().isoformat()}"
        print("wrote", *write_results(name, {"environment": env, **result}, text, args.out_dir))
        partial.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
