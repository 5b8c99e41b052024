"""torch.compile in the PyTorch backend, said once: the training step (`rosetta train --compile`,
torch_impl/train.py) and the decoding step (torch_impl/decode.py) are both compiled here, whole
(`fullgraph`: a graph break is an error, not a silent fall back to Python), and the compiler's
own wall time is counted, so that the harness reports it apart from step time.
jax_impl/compilation.py holds JAX's (jit is always on there: its persistent cache and XLA flags).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo

# What torch.compile lowers to. Tests swap in a counting backend
# (torch._dynamo.testing.CompileCounterWithBackend("aot_eager")): the same graph capture, no code
# generation (inductor takes ~35 s per training graph of `tiny` on this project's 2-core CPU).
BACKEND: Any = "inductor"
# Guards per compiled function before torch gives up and runs eagerly: one graph per shape seen.
# The harness's buckets (rosetta/harness/batching.py: default_buckets) stay far below it.
RECOMPILE_LIMIT = 256


def compiled(fn: Callable, *, dynamic: bool | None, mode: str | None = None) -> Callable:
    """`torch.compile(fn)` as the backend compiles: whole graphs (`fullgraph`), `dynamic` as asked
    (False: one graph per input shape; None: torch's automatic dynamic shapes, at most two), `mode`
    for inductor ("reduce-overhead": CUDA graphs on a GPU, none on a CPU)."""
    limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    torch._dynamo.config.recompile_limit = limit
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit,
                                                           limit)
    options = {"mode": mode} if BACKEND == "inductor" and mode is not None else {}
    return torch.compile(fn, fullgraph=True, dynamic=dynamic, backend=BACKEND, **options)


def compile_totals() -> tuple[float, int]:
    """(seconds, graphs): the time this process spent in torch.compile (graph capture and the backend:
    inductor's code generation, or its cache's read) and the graphs it compiled so far. From dynamo's
    own per-phase timings: "_compile.compile_inner" wraps one frame's whole compilation, backward
    graph included."""
    from torch._dynamo.utils import compilation_time_metrics

    frames = compilation_time_metrics.get("_compile.compile_inner", ())
    return float(sum(frames)), len(frames)
