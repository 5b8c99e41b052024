"""Training throughput on the batches users train on: built by the harness's own batching
(rosetta/harness/batching.py), bucketed and packed, from two realistic length distributions,
with MFU counted on real tokens only (padding is not useful work).

    python -m benchmarks.batches                      # small, 4,096-token batches, CPU: ~6 min on 2 cores
    python -m benchmarks.batches --preset base --dtype bfloat16 --max-tokens 25000   # on a GPU

Length distributions:
- `multi30k`: the Multi30k task-1 training pairs (de→en), tokenised by the harness's joint BPE
  (8,000 tokens, as the multi30k recipe): real sentences, short (mean ~15 tokens).
- `wmt`: a WMT-like histogram of source lengths in BPE tokens, written down below (WMT_HISTOGRAM:
  an approximation of WMT'14 en-de under a 32k joint BPE, not measured here: no WMT data on this
  machine), each target 0.8-1.25 times its source; token ids drawn uniformly.

For each (distribution, batching), the same few batches (the first of the epoch's shuffled
order; bucketed batches mix bucket lengths) go to every implementation's own `Trainer.step`
(benchmarks/common.py: built through the registry as `rosetta train` builds it, stepped by the
harness's Stepper): PyTorch eager, JAX (jit; one compilation per shape, in the warm-up), and the
`torch.nn.Transformer` peer on the bucketed batches (nn.Transformer has no segment masks: packed
rows would attend across sentences, so the peer is shown on the bucketed batches of the same
pairs, its usual input). The passes over the batches are interleaved between implementations, the
same code on a CPU and a GPU (a pass's time: CUDA events on a GPU, the host's clock elsewhere).
"real tokens/s" counts target tokens that are not padding; "real MFU" divides the FLOPs of the
sentences alone (rosetta/flops.py per sentence at its own lengths: no padding, no cross-sentence
attention) by the step time and the device's peak (unknown on CPUs: "–").
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # as benchmarks/run.py

import numpy as np
import torch

from benchmarks.common import (
    RESULTS,
    build_trainer,
    environment,
    given_path,
    isa_sections,
    parser,
    with_machine,
    write_results,
)
from benchmarks.peer import make_peer
from benchmarks.run import device_name
from rosetta import preset
from rosetta.cli_args import count, nonempty_path, positive_int
from rosetta.config import PRESETS
from rosetta.files import atomic_write_bytes
from rosetta.flops import mfu, peak_flops
from rosetta.harness.batching import BatchIterator
from rosetta.harness.metrics import batch_work
from rosetta.harness.stepping import Stepper, cycle
from rosetta.harness.tasks import load_task
from rosetta.training import Batch

# (lowest, highest source length in BPE tokens, share of sentences): the WMT-like histogram.
WMT_HISTOGRAM = ((3, 10, 0.12), (11, 20, 0.24), (21, 30, 0.22), (31, 40, 0.16), (41, 50, 0.10),
                 (51, 70, 0.10), (71, 100, 0.05), (101, 150, 0.01))
DISTRIBUTIONS = ("multi30k", "wmt")
# Packed row length per distribution: above its longest pair (src + eos), as Flax's WMT example
# packs into rows of 256.
PACK_LENGTH = {"multi30k": 128, "wmt": 256}
BATCHINGS = ("bucketed", "packed")


def wmt_like_pairs(n: int, vocab_size: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """`n` random-id pairs whose source lengths follow WMT_HISTOGRAM, targets 0.8-1.25x as long
    (ids 4.. so that none is pad, bos, eos or unk)."""
    rng = np.random.default_rng(seed)
    bins = rng.choice(len(WMT_HISTOGRAM), size=n, p=[share for *_, share in WMT_HISTOGRAM])
    pairs = []
    for b in bins:
        low, high, _ = WMT_HISTOGRAM[b]
        src_len = int(rng.integers(low, high + 1))
        tgt_len = max(1, round(src_len * rng.uniform(0.8, 1.25)))
        pairs.append((rng.integers(4, vocab_size, src_len).tolist(),
                      rng.integers(4, vocab_size, tgt_len).tolist()))
    return pairs


def length_pairs(distribution: str, vocab_size: int, data_dir: str | None) -> list:
    if distribution == "multi30k":
        task = load_task("multi30k", vocab_size=vocab_size, bpe_vocab_size=vocab_size, data_dir=data_dir)
        return task.train_pairs
    return wmt_like_pairs(30000, vocab_size)


def sample_batches(pairs: list, cfg, max_tokens: int, pack_length: int | None, count: int) -> list[Batch]:
    """The first `count` batches of epoch 0 of the harness's iterator (shuffled order); packed
    into rows of `pack_length` unless it is None."""
    iterator = BatchIterator.from_config(pairs, cfg, max_tokens=max_tokens, packing=pack_length is not None,
                                         pack_length=pack_length)
    return [next(iterator) for _ in range(count)]


def runners(cfg, params, batches: list[Batch], dtype: str, device: str, with_peer: bool) -> dict:
    """name -> one pass over `batches`: a `Trainer.step` on each, read back at the end (the pass's
    rosetta.harness.stepping.Stretch: its `seconds` are the device's)."""
    names = ["torch", *(["peer"] if with_peer else []), "jax"]
    steppers = {name: Stepper(build_trainer(name, cfg, params, dtype, device), cycle(batches))
                for name in names}
    return {name: (lambda s=stepper: s.run(len(batches))) for name, stepper in steppers.items()}


def measure_passes(fns: dict, repeats: int) -> dict[str, list[float]]:
    """One warm-up pass each (compilation: one per batch shape), then `repeats` interleaved
    timed passes; seconds per pass."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(fn().seconds)
    return times


def run(args: argparse.Namespace, pairs: dict[str, list]) -> dict:
    """Every (distribution, batching) of `args` timed on `pairs[distribution]` (length_pairs)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32, as JAX's default (benchmarks/run.py)
    _, cfg, params = make_peer(preset(args.preset))  # the weights every implementation starts from
    peak = peak_flops(device_name(), args.dtype)
    rows = []
    for distribution in args.distributions:
        for batching in args.batchings:
            pack_length = min(PACK_LENGTH[distribution], cfg.max_len) if batching == "packed" else None
            batches = sample_batches(pairs[distribution], cfg, args.max_tokens, pack_length, args.batches)
            flops = sum(batch_work(cfg, b)["flops"] for b in batches)
            real = sum(b.num_tgt_tokens for b in batches)
            slots = sum(b.labels.size for b in batches)
            shapes = sorted({b.src.shape for b in batches})
            print(f"{distribution} {batching}: {len(batches)} batches, shapes {shapes}, "
                  f"{real / slots:.0%} real target tokens", flush=True)
            fns = runners(cfg, params, batches, args.dtype, device, with_peer=batching == "bucketed")
            times = measure_passes(fns, args.repeats)
            for impl, t in times.items():
                median = float(np.median(t))
                rows.append(dict(distribution=distribution, batching=batching, impl=impl, median_s=median,
                                 min_s=min(t), max_s=max(t), passes_s=list(t), repeats=args.repeats,
                                 batches=len(batches),
                                 shapes=shapes, real_fraction=real / slots,
                                 real_tokens_per_s=real / median, real_flops=flops,
                                 real_mfu=mfu(flops, median, peak)))
                print(f"    {impl}: {median / len(batches) * 1e3:.0f} ms per batch, "
                      f"{real / median:,.0f} real target tokens/s", flush=True)
    for row in rows:  # vs the peer on the bucketed batches of the same distribution: same pairs' tokens
        peer_row = next((r for r in rows if r["impl"] == "peer" and r["distribution"] == row["distribution"]),
                        None)
        if peer_row is not None and row["impl"] != "peer":
            row["ratio_vs_peer"] = row["real_tokens_per_s"] / peer_row["real_tokens_per_s"]
            if row["batching"] == "bucketed":  # the same batches, passes interleaved: each pass's ratio
                paired = [p / s for p, s in zip(peer_row["passes_s"], row["passes_s"], strict=True)]
                row["paired_ratio_median"] = float(np.median(paired))
                row["paired_ratio_range"] = [min(paired), max(paired)]
    return dict(suite="batches", device=device_name(), preset=args.preset, dtype=args.dtype,
                max_tokens=args.max_tokens, rows=rows)


def markdown(result: dict) -> str:
    env, s = result["environment"], result["settings"]
    title = f"# Training on harness-built batches: {result['preset']} {result['dtype']}, {result['device']}"
    lines = [title, "",
             f"{env.get('date')}, commit {env.get('commit')}, torch {env.get('torch')}, "
             f"jax {env.get('jax')}; "
             f"{s}; the whole run took {result['wall_s']:.0f} s. Median of {result['rows'][0]['repeats']} "
             "interleaved passes over the same batches (spread in brackets). ratio vs peer: real target "
             "tokens/s over the peer's on the bucketed batches of the same distribution; paired: the "
             "median of each pass's ratio (the peer's pass time over this one's: the same batches), "
             "its range.",
             "", "| lengths | batching | real tokens | impl | ms per batch | real target tokens/s | real MFU "
             "| ratio vs peer | paired ratio [range] |", "| --- | --- | --- | --- | --- | --- | --- | --- "
             "| --- |"]
    for r in result["rows"]:
        per = 1e3 / r["batches"]
        ratio = r.get("ratio_vs_peer")
        lines.append(f"| {r['distribution']} | {r['batching']} | {r['real_fraction']:.0%} | {r['impl']} | "
                     f"{r['median_s'] * per:.0f} [{r['min_s'] * per:.0f}–{r['max_s'] * per:.0f}] | "
                     f"{r['real_tokens_per_s']:,.0f} | "
                     f"{'–' if r['real_mfu'] is None else format(r['real_mfu'], '.1%')} | "
                     f"{'–' if ratio is None else format(ratio, '.2f')} | {_paired(r)} |")
    return "\n".join(lines) + "\n"


def _paired(row: dict) -> str:
    if "paired_ratio_median" not in row:  # the peer's own row, packed rows, files before issue 55
        return "–"
    low, high = row["paired_ratio_range"]
    return f"{row['paired_ratio_median']:.2f} [{low:.2f}–{high:.2f}]"


def main(argv: list[str] | None = None) -> None:
    cli = parser(__file__, __doc__)
    cli.add_argument("--preset", default="small", choices=sorted(PRESETS))
    cli.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    cli.add_argument("--max-tokens", type=positive_int, default=4096, help="tokens a batch (default 4096)")
    cli.add_argument("--batches", type=count, default=3, help="batches a (distribution, batching)")
    cli.add_argument("--repeats", type=count, default=3, help="timed passes over them")
    cli.add_argument("--distributions", nargs="+", choices=DISTRIBUTIONS, default=list(DISTRIBUTIONS))
    cli.add_argument("--batchings", nargs="+", choices=BATCHINGS, default=list(BATCHINGS))
    cli.add_argument("--data-dir", type=nonempty_path, help="Multi30k directory (default: the harness's)")
    cli.add_argument("--out-dir", type=given_path, default=RESULTS)
    cli.add_argument("--no-write", action="store_true", help="print the table only")
    cli.add_isa(both=True)
    args = cli.parse_args(argv)
    # issue 57: a budget whose batch cannot be held (one float32 d_model vector a token, a side)
    cli.fits_memory("--max-tokens", args.max_tokens, 8 * preset(args.preset).d_model, "tokens")
    device = "".join(c if c.isalnum() else "-" for c in device_name().lower()).strip("-")
    name = f"batches_{args.preset}_{args.dtype}_{device}_{dt.date.today().isoformat()}"
    if not args.no_write and not args.part:  # the files it writes, before the first measurement
        cli.check_out_dir(args.out_dir, [f"{name}.json", f"{name}.md"])
    if args.isa == "both":  # each ISA in a process of its own (a library reads its cap when it starts)
        parts = cli.run_isas(argv)
        text = isa_sections(parts, markdown)
        print(text)
        if not args.no_write:
            print("wrote", *write_results(name, {"environment": parts["native"]["environment"],
                                                 "isas": parts}, text, args.out_dir))
        return
    cli.apply_isa(args, argv)  # --isa: the run again, every library capped (docs/benchmarks.md)
    with cli.refusing("--data-dir" if args.data_dir else None):
        vocab = preset(args.preset).src_vocab_size
        pairs = {d: length_pairs(d, vocab, args.data_dir) for d in args.distributions}
    started = time.perf_counter()
    env = environment()
    result = run(args, pairs)
    result |= {"environment": env, "wall_s": time.perf_counter() - started,
               "settings": f"{args.max_tokens} tokens per batch, {args.batches} batches, packed rows of "
                           + ", ".join(f"{n} ({d})" for d, n in PACK_LENGTH.items())}
    if args.part:  # a part of --isa both: the parent writes
        atomic_write_bytes(args.part, json.dumps(result).encode())
        return
    text = with_machine(markdown(result), env)
    print(text)
    if not args.no_write:
        print("wrote", *write_results(name, result, text, args.out_dir))


if __name__ == "__main__":
    main()
