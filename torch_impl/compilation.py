"""torch.compile in the PyTorch backend, said once: the training step (`rosetta train --compile`,
torch_impl/train.py) and the decoding step (torch_impl/decode.py) are both compiled here, whole
(`fullgraph`: a graph break is an error, not a silent fall back to Python), and the compiler's
own wall time is counted, so that the harness reports it apart from step time. Also what a step
needs to run ahead of the device and be captured whole (issue 45): inductor's mode per device
(CUDA graphs on a GPU) and the host-to-device copies that do not make the host wait.
jax_impl/compilation.py holds JAX's (jit is always on there: its persistent cache and XLA flags).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

# torch._dynamo is imported where compiling starts (here, and decode.py's compiled search), never at
# import: ~1 s of CPU (sympy included) that a process that only decodes (translate, generate, diff)
# need not pay. A training process pays it anyway: torch.optim's Optimizer imports it.

# What torch.compile lowers to. Tests swap in a counting backend
# (torch._dynamo.testing.CompileCounterWithBackend("aot_eager")): the same graph capture, no code
# generation (inductor takes ~35 s per training graph of `tiny` on this project's 2-core CPU).
BACKEND: Any = "inductor"
# Guards per compiled function before torch gives up and runs eagerly: one graph per shape seen.
# The harness's buckets (rosetta/harness/batching.py: default_buckets) stay far below it.
RECOMPILE_LIMIT = 256


def compiled(fn: Callable, *, dynamic: bool | None, mode: str | None = None,
             options: dict[str, Any] | None = None) -> Callable:
    """`torch.compile(fn)` as the backend compiles: whole graphs (`fullgraph`), `dynamic` as asked
    (False: one graph per input shape; None: torch's automatic dynamic shapes, at most two), `mode`
    for inductor ("reduce-overhead": CUDA graphs on a GPU, none on a CPU) or its `options` (one or the
    other)."""
    import torch._dynamo as dynamo

    limit = max(dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    dynamo.config.recompile_limit = limit
    dynamo.config.accumulated_recompile_limit = max(dynamo.config.accumulated_recompile_limit, limit)
    settings = {"mode": mode} if mode else {"options": options} if options else {}
    settings = settings if BACKEND == "inductor" else {}
    return torch.compile(fn, fullgraph=True, dynamic=dynamic, backend=BACKEND, **settings)


# The compiled training step's inductor options on CUDA: CUDA graphs (what mode "reduce-overhead" sets:
# cudagraph trees, one launch per graph instead of one per kernel) over unpartitioned graphs. With
# torch 2.11's graph partitions (its default) recording the forward graph failed on an H200
# (2026-11-30, benchmarks/results/gpu-session_nvidia-h200_8cb17c9.md: "These storage data ptrs are not
# allocated in pool"; its partition returned parameters as outputs). Unpartitioned, a graph holding a
# CPU operation runs without CUDA graphs (inductor logs "skipping cudagraphs") instead of failing.
CUDA_GRAPHS: dict[str, Any] = {"triton.cudagraphs": True, "graph_partition": False}


def training_options(device_type: str, accumulate: int = 1) -> dict[str, Any] | None:
    """Inductor's options for the compiled training step: CUDA_GRAPHS on CUDA (the graph's outputs are
    rewritten by its next replay, so the trainer copies the loss it keeps). None (the default mode) on
    a CPU, where no CUDA graphs exist, and with `accumulate` > 1: the second micro-batch's replay would
    overwrite the first one's gradients, which the backward graph wrote as .grad (cudagraph trees
    refuse it). GPU effect: not measured."""
    return dict(CUDA_GRAPHS) if device_type == "cuda" and accumulate == 1 else None


def host_copy(device_type: str) -> tuple[bool, bool] | None:
    """How host values reach a `device_type` device in a step: None, not copied (a CPU tensor shares
    NumPy's memory); else (pinned first, non_blocking). A GPU's copy from pageable memory makes the
    host wait for the device, and a step that waits can neither run ahead of it nor be captured."""
    return None if device_type == "cpu" else (device_type == "cuda", device_type == "cuda")


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device` as `host_copy` says (a pinned block is kept until its copy is done: torch's
    caching host allocator records the copy's stream)."""
    plan = host_copy(device.type)
    if plan is None:
        return host
    pin, non_blocking = plan
    return (host.pin_memory() if pin else host).to(device, non_blocking=non_blocking)


def compile_totals() -> tuple[float, int]:
    """(seconds, graphs): the time this process spent in torch.compile (graph capture and the backend:
    inductor's code generation, or its cache's read) and the graphs it compiled so far. From dynamo's
    own per-phase timings: "_compile.compile_inner" wraps one frame's whole compilation, backward
    graph included. Nothing compiled where dynamo was never imported (torch.compile imports it)."""
    if "torch._dynamo" not in sys.modules:
        return 0.0, 0
    from torch._dynamo.utils import compilation_time_metrics

    frames = compilation_time_metrics.get("_compile.compile_inner", ())
    return float(sum(frames)), len(frames)
