"""Where one training step spends its time on a GPU: torch.profiler over a few steps of the
trainers' own `Trainer.step` (benchmarks/common.py: built through the registry as `rosetta train`
builds them) for our eager PyTorch model and the nn.Transformer peer (benchmarks/peer.py), on the
GPU suite's batches (benchmarks/run.py: training_batches), kernels grouped by kind; and the
label-smoothed loss over the vocabulary timed alone (forward + backward) in eager PyTorch,
torch.compile and JAX.

    python -m benchmarks.profile_step --preset base --dtype bfloat16 > profile.md
    python -m benchmarks.profile_step --preset tiny --device cpu --steps 2   # the same code on a CPU

On a CPU the profiler records operators instead of kernels (most land in "other").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import build_trainer, environment, parser, release, time_training
from benchmarks.peer import make_peer
from benchmarks.run import SUITES, measure, training_batches
from jax_impl import train as jax_train
from rosetta import preset
from rosetta.cli_args import positive_int
from rosetta.flops import training_flops
from rosetta.harness.stepping import Stepper, cycle
from rosetta.training import Batch
from torch_impl import train as torch_train

# Kernel name fragments -> kind; the first match wins, anything else is "other".
KINDS = (
    ("matmul (cuBLAS)", ("nvjet", "gemm", "cutlass", "xmma", "cublas")),
    ("attention (cuDNN/flash SDPA)", ("sdpa", "flash", "fmha", "attention")),
    ("softmax over the vocabulary (loss)", ("SoftMax",)),
    ("LayerNorm", ("layer_norm", "GammaBeta", "LayerNorm")),
    ("dropout", ("dropout",)),
    ("Adam", ("adam", "Adam")),
    ("casts and copies", ("copy_kernel",)),
)


def kind_of(kernel: str) -> str:
    kinds = (kind for kind, keys in KINDS if any(k in kernel for k in keys))
    return next(kinds, "other elementwise, reductions")


def wall_time(fn, steps: int) -> float:
    """Mean seconds per call over `steps` calls after 3 warm-up calls (benchmarks/run.py's timer)."""
    return measure(fn, repeats=1, warmup=3, inner=steps)["median_s"]


def profile_impl(name: str, cfg, params, batches: list[Batch], dtype: str, device: str, steps: int,
                 flops: int) -> str:
    """torch.profiler over `steps` of the trainer's own steps (after a timed, unprofiled run of as
    many), device kernels (operators on a CPU) grouped by kind."""
    trainer = build_trainer(name, cfg, params, dtype, device)
    wall = time_training(trainer, batches, warmup=3, repeats=1, steps=steps)["median_s"]
    stepper = Stepper(trainer, cycle(batches))
    cuda = device == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        stepper.run(steps)
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    kernels = [e for e in prof.key_averages() if e.device_type == kind]
    per_kind: dict[str, list[float]] = {}
    for e in kernels:
        entry = per_kind.setdefault(kind_of(e.key), [0.0, 0])
        entry[0] += (e.self_device_time_total if cuda else e.self_cpu_time_total) / steps / 1e3  # µs -> ms
        entry[1] += e.count // steps
    del trainer, stepper
    release()
    gpu = sum(ms for ms, _ in per_kind.values())
    lines = [f"## {name}: {wall * 1e3:.1f} ms per step, {flops / wall / 1e12:.2f} TFLOP/s; "
             f"{'GPU kernels' if cuda else 'CPU operators'} {gpu:.1f} ms per step", "",
             "| kernels | ms per step | share of the time | launches per step |", "| --- | --- | --- | --- |"]
    for kind_name, (ms, count) in sorted(per_kind.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"| {kind_name} | {ms:.2f} | {ms / max(gpu, 1e-9):.0%} | {count} |")
    return "\n".join(lines) + "\n"


def loss_timings(cfg, size, dtype: str, device: str, steps: int) -> str:
    """Forward + backward of the label-smoothed loss alone, on logits of the step's shape."""
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

    rows = [("PyTorch eager", wall_time(torch_loss(torch_train.loss_fn), steps)),
            ("torch.compile", wall_time(torch_loss(torch.compile(torch_train.loss_fn)), steps))]
    grad = jax.jit(jax.value_and_grad(lambda z, y: jax_train.loss_fn(z, y, cfg.pad_id, 0.1)[0]))
    zj = jnp.asarray(logits, dtype=jnp.bfloat16 if dtype == "bfloat16" else jnp.float32)
    yj = jnp.asarray(labels)
    rows.append(("JAX (jit)", wall_time(lambda: jax.block_until_ready(grad(zj, yj)), steps)))
    gb = np.prod(shape) * (2 if dtype == "bfloat16" else 4) / 1e9
    lines = [f"## The loss alone: {shape[0]} x {shape[1]} x {shape[2]:,} {dtype} logits ({gb:.1f} GB), "
             "forward + backward", "", "| implementation | ms |", "| --- | --- |"]
    lines += [f"| {name} | {t * 1e3:.2f} |" for name, t in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    cli = parser(__file__, __doc__)
    cli.add_argument("--preset", default="base", choices=sorted(SUITES["gpu"].presets))
    cli.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    cli.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    cli.add_argument("--steps", type=positive_int, default=5)
    cli.add_argument("--no-loss", action="store_true", help="leave out the loss-alone timings")
    args = cli.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        cli.error("argument --device: no CUDA device here (--device cpu runs the same code on the CPU)")
    env = environment()
    size = SUITES["gpu"].presets[args.preset]
    _, cfg, params = make_peer(preset(args.preset, max_len=128))
    batches = training_batches(cfg, args.preset, size)
    flops = training_flops(cfg, size.batch, size.length, size.length)
    print(f"# One training step, {args.preset} {args.dtype}, {size.batch} x {size.length} tokens\n\n"
          f"{env['date']}, {env.get('gpu', env['processor'])}, commit {env['commit']}, "
          f"torch {env.get('torch')}, "
          f"jax {env.get('jax')}. Wall time: median of {args.steps} steps after 3 warm-up "
          f"steps, unprofiled; kernel times from torch.profiler over {args.steps} more steps. "
          f"{flops / 1e12:.2f} model TFLOP per step at the padded shape (rosetta/flops.py).\n", flush=True)
    for name in ("torch", "peer"):
        print(profile_impl(name, cfg, params, batches, args.dtype, args.device, args.steps, flops),
              flush=True)
    if not args.no_loss:
        print(loss_timings(cfg, size, args.dtype, args.device, args.steps), flush=True)


if __name__ == "__main__":
    main()
