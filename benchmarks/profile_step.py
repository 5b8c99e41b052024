"""Where one PyTorch training step spends its time: torch.profiler over a few steps of our eager
model and of the nn.Transformer peer (benchmarks/peer.py), on the GPU suite's batch.

    python -m benchmarks.profile_step --preset base --dtype bfloat16

Prints, per implementation, wall time per step, GPU kernel time per step (their ratio: how busy
the GPU is; well under 1 means the step waits on the CPU to launch kernels) and the kernels
that take most of the GPU time. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.peer import make_peer
from benchmarks.run import SUITES, autocast_dtype, training_batch
from rosetta import preset
from rosetta.training import TrainConfig
from torch_impl import train as torch_train
from torch_impl.backend import Model as TorchModel


def profile_impl(name: str, module: torch.nn.Module, batch, dtype: str, steps: int) -> str:
    tc = TrainConfig(warmup_steps=4000)
    optimizer, scheduler = torch_train.make_optimizer(module, tc)
    step = torch_train.make_train_step(module, optimizer, scheduler, tc, autocast_dtype(dtype))
    for _ in range(3):
        step(*batch)
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(*batch)
        torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / steps
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu = sum(e.self_device_time_total for e in events) / steps / 1e6  # µs -> s
    lines = [f"## {name}: {wall * 1e3:.1f} ms per step (under the profiler), GPU kernels "
             f"{gpu * 1e3:.1f} ms per step ({gpu / wall:.0%} busy)", "",
             "| kernel | ms per step | share | calls per step |", "| --- | --- | --- | --- |"]
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:15]:
        t = e.self_device_time_total / steps / 1e6
        lines.append(f"| `{e.key[:90]}` | {t * 1e3:.2f} | {t / gpu:.0%} | {e.count // steps} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="base")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_step needs a CUDA device")
    torch.set_float32_matmul_precision("high")
    size = SUITES["gpu"].presets[args.preset]
    peer, cfg, params = make_peer(preset(args.preset, max_len=128))
    src, tgt, labels = training_batch(cfg, size)
    batch = [torch.from_numpy(a).cuda() for a in (src, tgt, labels)]
    print(f"# One training step, {args.preset} {args.dtype}, {size.batch} x {size.length} tokens, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    for name, module in (("torch (eager)", TorchModel(cfg, params, "float32", "cuda").module),
                         ("peer (nn.Transformer)", peer.cuda())):
        print(profile_impl(name, module, batch, args.dtype, args.steps), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
