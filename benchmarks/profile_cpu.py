"""Where a CPU step spends its time (issue 27): one training step of `small` on a Multi30k batch
(benchmarks/batches.py's first bucketed batch, 4,096 tokens) for our PyTorch, the nn.Transformer
peer and our JAX, and one beam-4 decode of decode_ct2's base-sized Marian model for our PyTorch
and JAX, each grouped into the same kinds of work.

    python -m benchmarks.profile_cpu               # ~3 minutes on 2 cores: results/profile_cpu_<date>.*
    python -m benchmarks.profile_cpu --what train  # or decode

PyTorch: torch.profiler, self CPU time per op, kinds by op name and shapes. JAX: jax.profiler,
the XLA CPU runtime's thunks (one per fused kernel), kinds by the optimized HLO (dumped with
--xla_dump_to before JAX starts): a thunk is a matmul when its fusion computes a dot. Thunk time is
summed over XLA's threads, so its total exceeds the wall time when they overlap; "not in a thunk"
is the executor's time outside them (dots run by Eigen, scheduling). Times are per step (training)
or per call (decoding): the mean of 2 profiled calls, after 2 warm-up and 2 timed calls without
the profiler (the wall time shown). Run it alone.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import RESULTS, environment, given_path, parser, write_results
from rosetta.cli_args import core_count, machine_cores

# The jitted functions profiled: jax_impl/train.py's step and jax_impl/decode.py's beam search.
JAX_MODULES = ("_train_step", "_beam_search")
KINDS = ("output projection matmuls (over V)", "layer matmuls", "attention matmuls",
         "loss, log-softmax over V", "dropout random bits", "top-k and beam bookkeeping",
         "head-layout copies, cache writes and reorders", "other elementwise, norms, reductions, copies",
         "not in a thunk (JAX)")


def torch_kind(name: str, shapes: list, vocab: int) -> str:
    over_v = any(vocab in s for s in shapes if isinstance(s, list))
    if name in ("aten::mm", "aten::addmm", "aten::linear", "mkldnn::_linear_pointwise"):
        return KINDS[0] if over_v else KINDS[1]
    if name in ("aten::bmm", "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::baddbmm"):
        return KINDS[2]
    if over_v and any(k in name for k in ("softmax", "gather", "fill_", "div", "add", "mean", "sum", "exp",
                                          "topk", "sort")):
        return KINDS[5] if any(k in name for k in ("topk", "sort")) else KINDS[3]
    if name in ("aten::random_", "aten::bernoulli_", "aten::uniform_"):
        return KINDS[4]
    if name in ("aten::topk", "aten::sort", "aten::argsort"):
        return KINDS[5]
    cache_ops = ("aten::index", "aten::index_select", "aten::index_copy_", "aten::copy_")
    if name in cache_ops and shapes and len(shapes[0]) == 4:
        return KINDS[6]
    return KINDS[7]


def _wall(fn, calls: int) -> float:
    """Seconds per call without a profiler: the mean of `calls` calls after 2 warm-up calls."""
    for _ in range(2):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def profile_torch(fn, vocab: int, calls: int = 2) -> tuple[float, Counter]:
    from torch.profiler import ProfilerActivity, profile

    wall = _wall(fn, calls)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(calls):
            fn()
    kinds: Counter = Counter()
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key.startswith(("aten::", "mkldnn::")):
            kinds[torch_kind(e.key, e.input_shapes, vocab)] += e.self_cpu_time_total / 1e6 / calls
    return wall, kinds


def _hlo_instructions(module: str, hlo_dir: Path) -> dict[str, tuple[str, bool]]:
    """Thunk name -> (the instruction's line, whether it computes a dot, itself or in its fused
    computation), from the newest optimized HLO dump of the jitted function `module`."""
    found: dict[str, tuple[str, bool]] = {}
    dumps = sorted(hlo_dir.glob(f"*jit_{module}*after_optimizations.txt"), key=lambda p: p.stat().st_mtime)
    for path in dumps[-1:]:
        text = path.read_text()
        computations = dict(re.findall(r"^%?([\w.\-]+) \(.*?\n((?:.+\n)*?)\}", text, re.M))
        dots = {name: body for name, body in computations.items() if " dot(" in body}
        for line in text.splitlines():
            m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = \S+ ([\w\-]+)\(", line)
            if m:
                called = re.search(r"calls=%?([\w.\-]+)", line)
                body = dots.get(called.group(1)) if called else None
                found.setdefault(m.group(1), (line if body is None else line + "\n" + body,
                                              m.group(2) == "dot" or body is not None))
    return found


def jax_kind(line: str, is_dot: bool, vocab: int) -> str:
    """`line`: the instruction, and for a fused dot its computation (operand shapes included)."""
    shape = line.split("=", 1)[1][:80] if "=" in line else ""
    over_v = re.search(rf"\b{vocab}\b", line if is_dot else shape) is not None
    op = (re.search(r'op_name="([^"]*)"', line) or [None, ""])[1]
    if is_dot:
        return KINDS[0] if over_v else (KINDS[2] if re.search(r"\[\d+,\d+,\d+,\d+\]", shape) else KINDS[1])
    if over_v:
        return KINDS[5] if any(k in op for k in ("top_k", "sort", "argmax")) else KINDS[3]
    unsigned = re.match(r"\s*u(?:8|16|32)\[([\d,]+)\]", shape)
    if unsigned and math.prod(map(int, unsigned[1].split(","))) >= 1024:  # large unsigned arrays: random
        return KINDS[4]  # bits only (of any layout: a row's draws are [rows, width], ops.cpu_dropout)
    if any(k in op for k in ("top_k", "sort")) or "TopK" in line:
        return KINDS[5]
    if any(k in op for k in ("dynamic_update_slice", "gather")) or "dynamic-update-slice" in line:
        return KINDS[6]
    return KINDS[7]


def profile_jax(fn, vocab: int, module: str, hlo_dir: Path, calls: int = 2) -> tuple[float, Counter]:
    import jax
    from jax.profiler import ProfileData

    wall = _wall(lambda: jax.block_until_ready(fn()), calls)
    with tempfile.TemporaryDirectory(prefix="profile-cpu-trace-") as trace:
        jax.profiler.start_trace(trace)
        for _ in range(calls):
            jax.block_until_ready(fn())
        jax.profiler.stop_trace()
        data = ProfileData.from_file(str(next(Path(trace).rglob("*.xplane.pb"))))
    instructions = _hlo_instructions(module, hlo_dir)
    kinds: Counter = Counter()
    executing = 0
    for plane in data.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLA"):  # XLA's threads: its pool's, the client's
                continue
            for event in line.events:
                seconds = event.duration_ns / 1e9 / calls
                if event.name == "ThunkExecutor::Execute":
                    executing += seconds
                elif event.name in instructions:
                    kinds[jax_kind(*instructions[event.name], vocab)] += seconds
    kinds[KINDS[8]] = max(executing - sum(kinds.values()), 0.0)
    return wall, kinds


def train_cases(quick: bool) -> dict:
    from benchmarks.batches import length_pairs, runners, sample_batches
    from benchmarks.peer import make_peer
    from rosetta import preset

    name, lengths, tokens = ("tiny", "wmt", 512) if quick else ("small", "multi30k", 4096)
    _, cfg, params = make_peer(preset(name))  # the peer's weights, canonical: every trainer starts there
    batch = sample_batches(length_pairs(lengths, cfg.src_vocab_size, None), cfg, tokens, None, 1)
    fns = runners(cfg, params, batch, "float32", "cpu", with_peer=True)
    return {"what": f"one `{name}` training step, batch {batch[0].src.shape} ({lengths} lengths, bucketed)",
            "vocab": cfg.tgt_vocab_size,
            "cases": [("torch", "torch", fns["torch"]), ("peer", "torch", fns["peer"]),
                      ("jax", JAX_MODULES[0], fns["jax"])]}


def decode_cases(quick: bool) -> dict:
    from benchmarks.decode_ct2_models import BASE, QUICK, marian_model
    from rosetta import from_params

    B, L = (4, 8) if quick else (32, 24)
    with tempfile.TemporaryDirectory(prefix="profile-cpu-model-") as folder:  # the weights: in memory
        cfg, params = marian_model(QUICK if quick else BASE, Path(folder) / "marian")
    rng = np.random.default_rng(0)
    src = np.concatenate([rng.integers(2, cfg.src_vocab_size - 1, (B, L - 1)), np.full((B, 1), cfg.eos_id)],
                         axis=1)
    cases = []
    for name, module in (("torch", "torch"), ("jax", JAX_MODULES[1])):
        model = from_params(cfg, params, name, "float32")
        cases.append((name, module, lambda m=model: m.generate(src, 4, 1.0, L, "hf", max_new_tokens=L)))
    return {"what": f"one beam-4 decode of {B} x {L} source tokens, {L} target tokens each, "
                    f"d_model {cfg.d_model} Marian (benchmarks/decode_ct2.py's setup)",
            "vocab": cfg.tgt_vocab_size, "cases": cases}


def table(title: str, wall: float, kinds: Counter) -> str:
    total = sum(kinds.values())
    lines = [f"### {title}: {wall * 1e3:.0f} ms a call unprofiled; {total * 1e3:.0f} ms of work profiled", "",
             "| kind of work | ms | share |", "| --- | --- | --- |"]
    for kind in KINDS:
        if kinds.get(kind, 0) > 0:
            lines.append(f"| {kind} | {kinds[kind] * 1e3:.{0 if kinds[kind] >= 0.01 else 1}f} | "
                         f"{kinds[kind] / total:.0%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    cli = parser(__file__, __doc__)
    cli.add_argument("--what", choices=("train", "decode", "both"), default="both")
    cli.add_argument("--threads", type=core_count, default=min(2, machine_cores()),
                     help="torch threads, at most the cores (XLA takes every core)")
    cli.add_argument("--out-dir", type=given_path, default=RESULTS)
    cli.add_argument("--no-write", action="store_true", help="print only")
    cli.add_argument("--quick", action="store_true", help="tiny models (the smoke test); nothing written")
    cli.add_isa()
    args = cli.parse_args(argv)
    cli.apply_isa(args, argv)  # --isa: the run again, every library capped (docs/benchmarks.md)
    name = f"profile_cpu_{dt.date.today().isoformat()}"
    if not args.no_write and not args.quick:  # before the minutes of profiling
        cli.check_out_dir(args.out_dir, [f"{name}.json", f"{name}.md"])
    if "jax" in sys.modules:  # XLA reads XLA_FLAGS once, when JAX starts; JAX is imported only below
        cli.error("JAX is already imported in this process: run `python -m benchmarks.profile_cpu` "
                  "on its own")
    # The optimized HLO, for the thunk names; like the traces and the decode case's model, removed here.
    with tempfile.TemporaryDirectory(prefix="profile-cpu-hlo-") as hlo_dir:
        _profile(args, name, Path(hlo_dir))


def _profile(args, name: str, hlo_dir: Path) -> None:
    # The profiled programs' HLO only (their LLVM IR with it): dumping every module JAX compiles took
    # a third of a --quick run's CPU time (22.0 -> 15.5 s user, the 2-core Intel Xeon, issue 56).
    modules = "|".join(JAX_MODULES)
    flags = f"--xla_dump_to={hlo_dir} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=^jit_({modules})$"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}"
    torch.set_num_threads(args.threads)
    env = environment()
    parts = [f"# Where a CPU step's time goes, {env['date']} (commit {env['commit']}, {env['processor']}, "
             f"{env['cpus']} cores, torch {env.get('torch')}, jax {env.get('jax')})", ""]
    result = {"environment": env, "threads": args.threads, "profiles": []}
    for what in (("train", "decode") if args.what == "both" else (args.what,)):
        setup = train_cases(args.quick) if what == "train" else decode_cases(args.quick)
        parts += [f"## {setup['what']}", ""]
        for impl, module, fn in setup["cases"]:  # module: the jitted function's name for JAX
            if module == "torch":
                wall, kinds = profile_torch(fn, setup["vocab"])
            else:
                wall, kinds = profile_jax(fn, setup["vocab"], module, hlo_dir)
            parts.append(table(impl, wall, kinds))
            result["profiles"].append({"what": what, "impl": impl, "wall_s": wall, "kinds_s": dict(kinds)})
            print(parts[-1], flush=True)
    text = "\n".join(parts)
    if not args.no_write and not args.quick:
        print("wrote", *write_results(name, result, text, args.out_dir))


if __name__ == "__main__":
    main()
