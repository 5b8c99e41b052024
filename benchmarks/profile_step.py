"""Where a step goes, both frameworks side by side (issue 45, item 1): the training step in PyTorch
eager, PyTorch compiled (`rosetta train --compile`) and JAX, and the beam-4 search in PyTorch and JAX,
each profiled by its own framework's profiler (torch.profiler; jax.profiler's perfetto trace), both
traces read by the same plain functions into the same kinds.

    python -m benchmarks.profile_step                        # a GPU: base bfloat16, within 6 minutes
    python -m benchmarks.profile_step --device cpu --preset tiny   # the CPU twin (the suite runs it smaller)

Training: the trainers' own `Trainer.step` built as `rosetta train` builds it (benchmarks/common.py
build_trainer), stepped by the harness's Stepper on the GPU suite's copy-task batches. Search:
`generate` of the backend's `Model` (rosetta.backends get_backend), beam 4, alpha 0.6, on
`--sentences` random sources. Each part: `--warmup` steps (the compiles), `--steps` timed unprofiled
(training: one Stepper stretch, as benchmarks.run times it; search: the median call), `--profiled`
steps under the profiler; JAX's parts in a fresh process (run_parts). Budget on a GPU at `base`
bfloat16 (3 + 5 + 3 steps): the compiles dominate; the run is meant to stay within 6 minutes (not
measured yet on a GPU).

Per part: the step; real-token and padded MFU (rosetta/flops.py's model FLOPs over the peak of
rosetta/harness/metrics.py peak_flops, `--peak-tflops` where it has none; on a CPU not known); device
time by kind (KINDS); the 15 largest kernels; kernel launches, idle share and host-device syncs per
step. Search FLOPs (`search_flops`): real, each sentence at its source and output length; padded, the
batch's source length and its longest output.

How a trace is read: benchmarks/profile_trace.py.
Results: runs/benchmarks/profile-step_<preset>-<dtype>_<device>_<date>.{json,md} (a user's run:
benchmarks/common.py USER_RESULTS; `--out-dir` elsewhere). GPU figures: none measured yet.
"""

from __future__ import annotations

import argparse
import datetime as dt
import multiprocessing
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # PyTorch runs in this process too

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import (
    USER_RESULTS,
    Parser,
    attempt,
    build_trainer,
    environment,
    parser,
    release,
    time_training,
    with_machine,
    write_results,
)
from benchmarks.peer import make_peer
from benchmarks.profile_trace import KIND_ORDER, load_trace, summarize
from benchmarks.run import SUITES, Size, measure, training_batches
from jax_impl import train as jax_train
from rosetta import preset
from rosetta.backends import get_backend
from rosetta.cli_args import MAX_COUNT, count, positive_int, positive_real
from rosetta.config import PRESETS
from rosetta.flops import forward_flops
from rosetta.harness.metrics import batch_work, mfu, peak_flops
from rosetta.harness.stepping import Stepper, cycle
from rosetta.parity import random_batch
from torch_impl import train as torch_train


def torch_trace(fn: Callable[[], object], device: str, folder: Path) -> list[dict]:
    """torch.profiler's trace of `fn()` (kernels and the CUDA runtime's calls on CUDA, operators on a CPU)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
    path = folder / "torch_trace.json"
    prof.export_chrome_trace(str(path))
    return load_trace(path)


def jax_trace(fn: Callable[[], object], folder: Path) -> list[dict]:
    """jax.profiler's perfetto trace of `fn()` (`fn` must wait for its results); no Python tracer."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    with jax.profiler.trace(str(folder), create_perfetto_trace=True, profiler_options=options):
        fn()
    return load_trace(max(folder.rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime))


@dataclass(frozen=True)
class Part:
    key: str  # the --parts name
    title: str
    framework: str
    impl: str  # training: a benchmarks/common.py TRAINERS name; search: a backend


PARTS = (Part("train-eager", "PyTorch eager", "torch", "torch"),
         Part("train-compiled", "PyTorch compiled", "torch", "torch.compile"),
         Part("train-jax", "JAX", "jax", "jax"),
         Part("search-torch", "PyTorch beam 4", "torch", "torch"),
         Part("search-jax", "JAX beam 4", "jax", "jax"),
         Part("train-peer", "nn.Transformer peer", "torch", "peer"))  # not in the default run
DEFAULT_PARTS = tuple(p.key for p in PARTS[:5])
BEAM, ALPHA = 4, 0.6  # the paper's search (§6.1)


def search_flops(cfg, rows: int, beam: int, src_len: int, tgt_len: int) -> int:
    """Model FLOPs of a beam search over `rows` sentences (rosetta/flops.py's count): the encoder and the
    cross-attention keys and values once per sentence, the decoder and output projection for each of
    `beam` rows at `tgt_len` positions."""
    once = forward_flops(cfg, rows, src_len, 0)
    return once + beam * (forward_flops(cfg, rows, src_len, tgt_len) - once)


def profile_impl(part: Part, cfg, params, size: Size, args, folder: Path) -> dict:
    """One part measured (unprofiled), then profiled: its row of the results, with the machine's load
    (1-minute average, os.getloadavg) before and after and the part's own seconds, so that a part that
    shared the machine with other work shows it (issue 57)."""
    load_before, started = os.getloadavg()[0], time.perf_counter()
    trace = (lambda fn: jax_trace(fn, folder)) if part.framework == "jax" else \
        (lambda fn: torch_trace(fn, args.device, folder))
    if part.key.startswith("train"):
        batches = training_batches(cfg, args.preset, size)
        trainer = build_trainer(part.impl, cfg, params, args.dtype, args.device)
        t = time_training(trainer, batches, args.warmup, 1, args.steps)
        stepper = Stepper(trainer, cycle(batches))
        events = trace(lambda: stepper.run(args.profiled))
        works = [batch_work(cfg, b) for b in batches]
        flops = statistics.mean(w["flops"] for w in works)
        padded = statistics.mean(w["flops_padded"] for w in works)
        del trainer, stepper
    else:
        src, _ = random_batch(cfg, size.decode_batch, size.decode_len, 2, seed=2)
        kwargs = {"device": args.device} if part.framework == "torch" else {}
        model = get_backend(part.impl)(cfg, params, args.dtype, **kwargs)

        def search():
            return model.generate(src, BEAM, ALPHA, size.margin)

        with jax.default_device(jax.devices("gpu" if args.device == "cuda" else "cpu")[0]):
            t = measure(search, repeats=args.steps, warmup=args.warmup)
            out = search()
            events = trace(lambda: [search() for _ in range(args.profiled)])
        lengths = [len(tokens) + 1 for tokens in out.tokens]  # + eos
        sources = (src != cfg.pad_id).sum(axis=1)
        flops = sum(search_flops(cfg, 1, BEAM, int(s), n) for s, n in zip(sources, lengths, strict=True))
        padded = search_flops(cfg, len(src), BEAM, src.shape[1], max(lengths))
        del model
    release()
    peak = peak_flops(torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", args.dtype,
                      args.peak_tflops)
    row = {"part": part.key, "title": part.title, "framework": part.framework, "impl": part.impl,
           "median_s": t["median_s"], "warmup_s": t["warmup_s"], "flops": flops, "flops_padded": padded,
           "mfu": mfu(flops, t["median_s"], peak), "mfu_padded": mfu(padded, t["median_s"], peak),
           "min_s": t["min_s"], "max_s": t["max_s"], "part_s": time.perf_counter() - started,
           "load_before": load_before, "load_after": os.getloadavg()[0],
           **summarize(events, part.framework, args.device, args.profiled)}
    print(f"  {part.title}: {t['median_s'] * 1e3:.2f} ms a step, warm-up {t['warmup_s']:.1f} s, "
          f"{row['events']} device events profiled", flush=True)
    if row["events"] == 0:
        print(f"  {part.title}: no device events found in the trace: its tables are empty", flush=True)
    return row


def run_parts(parts: list[Part], cfg, params, size: Size, args, tmp: Path) -> list[dict]:
    """Each part's row: PyTorch's in this process, then JAX's in a fresh one, on every device (the CPU
    twin runs the GPU's path): torch.profiler (Kineto) and XLA's profiler each subscribe to CUPTI, which
    takes one subscriber a process; and JAX's allocator keeps what it took until its process ends."""
    rows, jax_parts = [], [p for p in parts if p.framework == "jax"]
    for i, part in enumerate(p for p in parts if p.framework == "torch"):
        (tmp / str(i)).mkdir()
        rows.append(attempt_part(profile_impl, part, cfg, params, size, args, tmp / str(i)))
    if jax_parts:
        with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
            def there(*a) -> dict:
                return pool.submit(profile_impl, *a).result()
            for i, part in enumerate(jax_parts, start=len(rows)):
                (tmp / str(i)).mkdir()
                rows.append(attempt_part(there, part, cfg, params, size, args, tmp / str(i)))
    return rows


def attempt_part(run: Callable[..., dict], part: Part, *args) -> dict:
    """`run(part, *args)`'s row, or where the part failed, a row with its error (common.attempt): the
    other parts still run and are written."""
    row, error = attempt(part.title, run, part, *args)
    return row if error is None else {"part": part.key, "title": part.title, "framework": part.framework,
                                      "impl": part.impl, "error": error}


def loss_timings(cfg, size: Size, dtype: str, device: str, steps: int) -> str:
    """Forward + backward of the label-smoothed loss alone, on logits of the step's shape (--loss-alone)."""
    rng = np.random.default_rng(0)
    shape = (size.batch, size.length, cfg.tgt_vocab_size)
    logits = rng.standard_normal(shape, dtype=np.float32)
    labels = rng.integers(1, cfg.tgt_vocab_size, shape[:2]).astype(np.int32)
    tdtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    z = torch.from_numpy(logits).to(device, tdtype).requires_grad_()
    y = torch.from_numpy(labels).to(device)

    def torch_loss(fn):
        def run():
            z.grad = None
            fn(z, y, cfg.pad_id, 0.1)[0].backward()
        return run

    def wall(fn) -> float:  # seconds a call, over `steps` calls after 3
        return measure(fn, repeats=1, warmup=3, inner=steps)["median_s"]
    rows = [("PyTorch eager", wall(torch_loss(torch_train.loss_fn))),
            ("torch.compile", wall(torch_loss(torch.compile(torch_train.loss_fn))))]
    grad = jax.jit(jax.value_and_grad(lambda z, y: jax_train.loss_fn(z, y, cfg.pad_id, 0.1)[0]))
    zj = jnp.asarray(logits, dtype=jnp.bfloat16 if dtype == "bfloat16" else jnp.float32)
    yj = jnp.asarray(labels)
    rows.append(("JAX (jit)", wall(lambda: jax.block_until_ready(grad(zj, yj)))))
    gb = np.prod(shape) * (2 if dtype == "bfloat16" else 4) / 1e9
    lines = [f"## The loss alone: {shape[0]} x {shape[1]} x {shape[2]:,} {dtype} logits ({gb:.1f} GB), "
             "forward + backward", "", "| implementation | ms |", "| --- | --- |"]
    lines += [f"| {name} | {t * 1e3:.2f} |" for name, t in rows]
    return "\n".join(lines) + "\n"


def _pct(x: float | None, digits: int = 1) -> str:
    return "not known" if x is None else f"{x:.{digits}%}"


# The table's words by device (issue 57): a CPU has no device to sit idle, no kernels to launch and
# nothing to copy back, so its rows say what was measured there (profile_trace.py: the operators' or
# thunks' self time, the time in none, the host's reads); launches, an ATen operator against an XLA
# thunk, compare nothing on a CPU and are left out of its table (the JSON keeps the count).
WORDS = {"cuda": {"time": "device time", "idle": "device idle", "launches": "kernel launches per step",
                  "syncs": "host-device syncs per step"},
         "cpu": {"time": "operator time", "idle": "time in no operator (Python, dispatch)", "launches": None,
                 "syncs": "host reads of a result per step"}}


def side_by_side(rows: list[dict], device: str) -> str:
    """The one table: ms per step and share of the device (CPU: operator) time by kind, one column per
    part; then the step, MFU, idle, launches and syncs in `device`'s words (WORDS), and each part's own
    seconds and the machine's load around it."""
    words, rows = WORDS[device], [r for r in rows if "error" not in r]
    if not rows:
        return "No part ran to the end (each part's error is below).\n"
    head = "| kind | " + " | ".join(r["title"] for r in rows) + " |"
    lines = [head, "|" + " --- |" * (len(rows) + 1)]
    for kind in KIND_ORDER:
        cells = [f"{r['kinds_ms'][kind]:.2f} ({r['kinds_ms'][kind] / max(r['device_ms'], 1e-12):.0%})"
                 for r in rows]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    summary = [(f"**{words['time']}, ms**", lambda r: f"{r['device_ms']:.2f}"),
               ("**step, unprofiled, ms**", lambda r: f"{r['median_s'] * 1e3:.2f}"),
               ("real-token MFU", lambda r: _pct(r["mfu"])), ("padded MFU", lambda r: _pct(r["mfu_padded"])),
               (words["idle"], lambda r: _pct(r["idle_share"], 0)),
               (words["launches"], lambda r: f"{r['launches_per_step']:,.0f}"),
               (words["syncs"], lambda r: f"{r['syncs_per_step']:.2f}"),
               ("the part's seconds (warm-up, timed, profiled)", lambda r: _seconds(r.get("part_s"))),
               ("machine load, 1-min average, before → after", _load)]
    lines += [f"| {label} | " + " | ".join(fmt(r) for r in rows) + " |" for label, fmt in summary if label]
    return "\n".join(lines) + "\n"


def _seconds(s: float | None) -> str:
    return "not recorded" if s is None else f"{s:.1f}"


def _load(row: dict) -> str:
    if "load_before" not in row:  # a results file from before issue 57
        return "not recorded"
    return f"{row['load_before']:.2f} → {row['load_after']:.2f}"


def load_warnings(rows: list[dict], cores: int) -> list[str]:
    """A line for each part during which the machine's load exceeded its cores: other work shared the
    CPU, and that part's times do not compare with the others' (issue 57: JAX 79x faster on a busy
    machine)."""
    return [f"warning: the machine's load reached {max(r['load_before'], r['load_after']):.1f} around "
            f"{r['title']}, above its {cores} cores: other work shared the CPU, and this part's times do not "
            "compare with the others'" for r in rows
            if "load_before" in r and max(r["load_before"], r["load_after"]) > cores]


def details(row: dict, device: str) -> str:
    """One part's line of figures and its TOP largest kernels (CPU: operators or thunks); a part that
    failed, its error."""
    if "error" in row:
        return f"### {row['title']}\n\n**Failed**: `{row['error']}`\n"
    figures = (f"device busy {row['busy_ms']:.2f} of {row['span_ms']:.2f} ms a step, idle "
               f"{_pct(row['idle_share'], 0)}, {row['launches_per_step']:,.0f} launches and "
               f"{row['syncs_per_step']:.2f} syncs a step" if device == "cuda" else
               f"in operators {row['busy_ms']:.2f} of {row['span_ms']:.2f} ms a step, in none "
               f"{_pct(row['idle_share'], 0)}, {row['syncs_per_step']:.2f} host reads a step")
    lines = [f"### {row['title']}", "",
             f"{row['median_s'] * 1e3:.2f} ms a step unprofiled (warm-up {row['warmup_s']:.1f} s); profiled: "
             f"{figures}; MFU {_pct(row['mfu'])} real-token, {_pct(row['mfu_padded'])} padded.", "",
             f"| {'kernel' if device == 'cuda' else 'operator'} | kind | ms per step | calls per step |",
             "| --- | --- | --- | --- |"]
    for k in row["top"]:
        name = k["name"] if len(k["name"]) <= 90 else k["name"][:87] + "..."
        lines.append(f"| `{name.replace('|', '/')}` | {k['kind']} | {k['ms_per_step']:.3f} | "
                     f"{k['calls_per_step']:g} |")
    return "\n".join(lines) + "\n"


def markdown(result: dict) -> str:
    env, s = result["environment"], result["settings"]
    device = s["device"]
    text = (f"# Where a step goes: {s['preset']} {s['dtype']}, {env.get('gpu') or env['processor']}\n\n"
            f"{env['date']}, commit {env['commit']}, torch {env.get('torch')}, jax {env.get('jax')}; "
            f"{result['wall_s']:.0f} s. Training: {s['batch']} x {s['length']} tokens a side "
            f"({s['real_share']:.0%} real target tokens), the trainers' own step; search: beam {BEAM} over "
            f"{s['sentences']} sentences of {s['decode_len']} tokens, `generate`. {s['warmup']} warm-up, "
            f"{s['steps']} timed and {s['profiled']} profiled steps a part "
            "(benchmarks/profile_step.py says how each figure is read).\n\n"
            + "".join(f"**{line}**\n\n" for line in result.get("warnings", []))
            + ("## Device time by kind, ms per step (share of the device time)\n\n" if device == "cuda" else
               "## Operator time by kind (XLA: thunks), ms per step (share of the operator time)\n\n"))
    text += side_by_side(result["rows"], device)
    text += "\n## Each part\n\n" + "\n".join(details(r, device) for r in result["rows"])
    return text + (f"\n{result['loss_alone']}" if result.get("loss_alone") else "")


def results_name(preset_name: str, dtype: str, device: str, partial: bool) -> str:
    """profile-step_<preset>-<dtype>_<device>_<date>; a run of some parts only: profile-step-partial_..."""
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    prefix = "profile-step-partial" if partial else "profile-step"
    return f"{prefix}_{preset_name}-{dtype}_{slug}_{dt.date.today().isoformat()}"


def sizes(cli: Parser, args: argparse.Namespace) -> Size:
    """The run's shapes: the GPU suite's for the preset, each flag given in its place, bounded (issue
    57): --length by the preset's max_len, --batch and --sentences by what this machine's memory
    holds at one float32 vector of d_model per token (the embeddings alone; a step holds far more)."""
    base = SUITES["gpu"].presets.get(args.preset, SUITES["gpu"].presets["base"])
    cfg = preset(args.preset)
    length = cli.bound("--length", args.length or base.length, cfg.max_len, f"preset {args.preset}'s max_len")
    size = Size(args.batch or base.batch, length, args.sentences or base.decode_batch,
                min(base.decode_len, length), min(base.margin, length))
    token = 4 * cfg.d_model
    cli.fits_memory("--batch", size.batch, 2 * length * token, f"rows of {length} tokens a side")
    cli.fits_memory("--sentences", size.decode_batch, BEAM * (size.decode_len + size.margin) * token,
                    f"sentences of {BEAM} beams")
    return size


def main(argv: list[str] | None = None) -> None:
    cli = parser(__file__, __doc__)
    cli.add_argument("--preset", default="base", choices=sorted(PRESETS))
    cli.add_argument("--dtype", choices=("bfloat16", "float32"),
                     help="default: bfloat16 on cuda, float32 on cpu")
    cli.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    cli.add_argument("--parts", nargs="+", choices=[p.key for p in PARTS], default=list(DEFAULT_PARTS),
                     help="the parts to run (default: all but train-peer)")
    cli.add_argument("--warmup", type=count, default=3,
                     help=f"unprofiled steps first (compiles; at most {MAX_COUNT:,})")
    cli.add_argument("--steps", type=count, default=5, help="timed steps, unprofiled")
    cli.add_argument("--profiled", type=count, default=3, help="steps under the profiler")
    cli.add_argument("--batch", type=positive_int,
                     help="training rows (default: the GPU suite's; at most what memory holds)")
    cli.add_argument("--length", type=positive_int,
                     help="training tokens a side (default: the GPU suite's; at most the preset's max_len)")
    cli.add_argument("--sentences", type=positive_int,
                     help="sentences searched (default: the GPU suite's; at most what memory holds)")
    cli.add_argument("--peak-tflops", type=positive_real, default=None,
                     help="the device's peak TFLOP/s in the run's dtype, for MFU (default: "
                          "rosetta/flops.py's table of known GPUs)")
    cli.add_argument("--loss-alone", action="store_true",
                     help="also time the loss alone (forward + backward)")
    cli.add_out_dir(USER_RESULTS)
    cli.add_argument("--no-write", action="store_true", help="print only")
    cli.add_isa()
    args = cli.parse_args(argv)
    cli.apply_isa(args, argv)  # --isa: the run again, every library capped (docs/benchmarks.md)
    if args.device == "cuda" and not torch.cuda.is_available():
        cli.error("argument --device: no CUDA device here (--device cpu runs the same code on the CPU)")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    parts = [p for p in PARTS if p.key in args.parts]
    name = results_name(args.preset, args.dtype, args.device, set(args.parts) != set(DEFAULT_PARTS))
    size = sizes(cli, args)  # refused in one line before anything is built
    if not args.no_write:  # before the minutes of compiling
        cli.check_out_dir(args.out_dir, [f"{name}.json", f"{name}.md"])
    started = time.perf_counter()
    env = environment()
    max_len = max(128, size.length, size.decode_len + size.margin + 1)
    _, cfg, params = make_peer(preset(args.preset, max_len=max_len))
    batches = training_batches(cfg, args.preset, size)
    print(f"profile_step: {args.preset} {args.dtype} on {args.device}, parts "
          f"{' '.join(p.key for p in parts)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="profile-step-") as tmp:
        rows = run_parts(parts, cfg, params, size, args, Path(tmp))
    rows.sort(key=lambda r: [p.key for p in PARTS].index(r["part"]))
    settings = {"preset": args.preset, "dtype": args.dtype, "device": args.device, "batch": size.batch,
                "length": size.length, "sentences": size.decode_batch, "decode_len": size.decode_len,
                "beam": BEAM, "warmup": args.warmup, "steps": args.steps, "profiled": args.profiled,
                "real_share": sum(b.num_tgt_tokens for b in batches) / sum(b.labels.size for b in batches)}
    result = {"environment": env, "settings": settings, "rows": rows,
              "warnings": load_warnings(rows, os.cpu_count() or 1)}
    for line in result["warnings"]:
        print(f"profile_step: {line}", file=sys.stderr, flush=True)
    if args.loss_alone:
        result["loss_alone"] = loss_timings(cfg, size, args.dtype, args.device, args.steps)
    result["wall_s"] = time.perf_counter() - started
    text = with_machine(markdown(result), env)
    print(text, flush=True)
    if not args.no_write:
        print("wrote", *write_results(name, result, text, args.out_dir))
    failed = [r["title"] for r in rows if "error" in r]
    if failed:
        raise SystemExit(f"profile_step: {len(failed)} of {len(rows)} parts failed ({', '.join(failed)}): "
                         "their errors are in the results")


if __name__ == "__main__":
    main()
