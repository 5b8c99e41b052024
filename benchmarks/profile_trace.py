"""How benchmarks/profile_step.py reads a profiler's trace: plain functions over trace events
(torch.profiler's chrome trace, jax.profiler's perfetto trace), one table of kinds for both frameworks
and both devices.
parity_tests/test_profile_step.py feeds `summarize` synthetic traces with known intervals.

How a trace is read (`summarize`: trace events in, per-step figures out):
- device work: torch on CUDA: the `kernel`, `gpu_memcpy`, `gpu_memset` events; torch on a CPU: the
  `cpu_op` events (operators); JAX on a GPU: the events on the `Stream` lines of a `/device:GPU`
  process; JAX on a CPU: XLA's thunks (events with an `hlo_op`). Each counts its self time (nested
  device events taken out, per thread), so nested operators are not counted twice.
- kind: the first KINDS entry one of whose fragments is in the event's name (lower case); for a name
  that matches none, the same look at its `hlo_op`, `tf_op`, `long_name`, `name` arguments (JAX's
  kernels). A fusion that mixes kinds counts as the first kind it names; torch's `copy_`
  (`copy_kernel` on CUDA), a cast or a layout copy, counts as a cast.
- launches: device events with no device event nested in them (on a CPU the innermost operators).
- idle: 1 - (the union of the device events' intervals) / (first start to last end of the profiled
  steps, run back to back). On a CPU: the time in no operator (Python, dispatch).
- syncs (the host waiting for the device): torch on CUDA: the runtime's cudaStreamSynchronize,
  cudaDeviceSynchronize, cudaEventSynchronize and synchronous cudaMemcpy calls; torch on a CPU:
  aten::_local_scalar_dense (.item(), bool(), int() of a tensor); JAX on a GPU: the device-to-host
  copies on its streams (MemcpyD2H); JAX on a CPU, where nothing is copied: the host's reads,
  `np.asarray(jax.Array)` (jax.Array._value: float(), jax.device_get) and `CommonPjRtBuffer::Await`
  outside one (np.asarray of an array not computed yet: a read of one already computed is not seen,
  so this count varies). A profiled stretch ends with the Stepper's flush: one read.
On a CPU, XLA's thunks run on several threads (their sum can exceed the span) and most are fusions
whose names do not say what they compute ("other"; benchmarks.profile_cpu maps them through the HLO).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

OTHER = "other elementwise and casts"
# Name fragments (lower case) -> kind; the first entry that matches wins, no match is OTHER. One
# table for torch's CUDA kernels and CPU operators, and XLA's GPU kernels and CPU thunks.
KINDS = (
    ("attention", ("sdpa", "flash", "fmha", "attention", "scaled_dot_product")),
    ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "aten::mm", "aten::addmm", "aten::bmm",
              "baddbmm", "linear", "dot")),
    ("loss and softmax", ("softmax", "nll_loss", "cross_entropy", "logsumexp")),
    ("LayerNorm", ("layer_norm", "layernorm", "gammabeta")),
    ("dropout", ("dropout", "bernoulli", "philox", "threefry", "rng", "random")),
    ("optimizer", ("adam", "multi_tensor_apply", "foreach")),
    (OTHER, ("copy_kernel", "aten::copy_", "_to_copy")),  # torch's casts, before "copy" below
    ("copies", ("memcpy", "memset", "copy", "transpose", "concatenate", "aten::cat", "index", "gather",
                "scatter", "dynamic-update-slice", "dynamic_update_slice")),
    (OTHER, ("convert",)),  # XLA's casts, after its cache writes (dynamic-update-slice_convert_fusion)
)
KIND_ORDER = ("GEMM", "attention", "loss and softmax", "LayerNorm", "dropout", OTHER, "optimizer", "copies")
CUDA_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
# JAX's host reads of device arrays on a CPU: jax.Array._value (float(), jax.device_get), and PjRt's
# wait for a buffer (NumPy's np.asarray of an array not computed yet).
JAX_READS = ("np.asarray(jax.Array)", "CommonPjRtBuffer::Await")
ARG_NAMES = ("hlo_op", "tf_op", "long_name", "name")  # what a JAX kernel's arguments say it computes
TOP = 15
TOP = 15


def kind_of(text: str) -> str:
    text = text.lower()
    return next((kind for kind, keys in KINDS if any(k in text for k in keys)), OTHER)


def classify(event: dict) -> str:
    """The kind of a device event: by its name, else by what its arguments name."""
    kind = kind_of(event["name"])
    if kind != OTHER:
        return kind
    args = event.get("args") or {}
    return kind_of(" ".join(str(args[k]) for k in ARG_NAMES if k in args))


def load_trace(path: Path) -> list[dict]:
    """The events of a trace-event JSON file, .json or .json.gz (torch.profiler's, jax.profiler's)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _names(events: list[dict]) -> tuple[dict, dict]:
    """Process names by pid and thread names by (pid, tid), from the metadata events."""
    meta = [e for e in events if e.get("ph") == "M"]
    procs = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    return procs, threads


def device_events(events: list[dict], framework: str, device: str) -> list[dict]:
    """The events that are the device's work (the module docstring's rule for each framework and device)."""
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    if framework == "torch":
        cats = ("kernel", "gpu_memcpy", "gpu_memset") if device == "cuda" else ("cpu_op",)
        return [e for e in spans if e.get("cat") in cats]
    if device == "cuda":  # the Stream lines; without any, every line but XLA's derived ones (XLA Ops)
        procs, threads = _names(events)
        gpu = [e for e in spans if str(procs.get(e["pid"], "")).startswith("/device:GPU")]
        line = {id(e): str(threads.get((e["pid"], e.get("tid")), "")) for e in gpu}
        streams = [e for e in gpu if line[id(e)].startswith("Stream")]
        return streams or [e for e in gpu if not line[id(e)].startswith("XLA")]
    return [e for e in spans if "hlo_op" in (e.get("args") or {})]


def host_syncs(events: list[dict], framework: str, device: str) -> int:
    """How many times the host waited for the device (the module docstring's rule)."""
    spans = [e for e in events if e.get("ph") == "X"]
    if framework == "jax" and device == "cuda":
        copies = (e["name"].lower() for e in device_events(events, "jax", device))
        return sum("d2h" in name or "dtoh" in name for name in copies)
    if framework == "jax":  # the reads, a wait inside a read not counted again
        reads, reach = 0, float("-inf")
        for e in sorted((e for e in spans if e["name"] in JAX_READS), key=lambda e: e["ts"]):
            reads += e["ts"] >= reach
            reach = max(reach, e["ts"] + e.get("dur", 0))
        return reads
    if device == "cuda":
        return sum(e.get("cat") == "cuda_runtime" and e["name"] in CUDA_SYNCS for e in spans)
    return sum(e["name"] == "aten::_local_scalar_dense" for e in spans)


def self_times(events: list[dict]) -> list[tuple[dict, float, bool]]:
    """(event, its duration less its directly nested events', whether nothing is nested in it), nesting
    taken per (pid, tid); an event that overlaps another without lying inside it is not nested."""
    found: dict[int, list] = {}
    by_thread: dict[tuple, list[dict]] = {}
    for e in events:
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for thread in by_thread.values():
        stack: list[dict] = []
        for e in sorted(thread, key=lambda e: (e["ts"], -e["dur"])):
            end = e["ts"] + e["dur"]
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            found[id(e)] = [e, float(e["dur"]), True]
            if stack and end <= stack[-1]["ts"] + stack[-1]["dur"]:
                parent = found[id(stack[-1])]
                parent[1] -= e["dur"]
                parent[2] = False
            stack.append(e)
    return [(e, max(t, 0.0), leaf) for e, t, leaf in found.values()]


def union_length(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def summarize(events: list[dict], framework: str, device: str, steps: int) -> dict:
    """A trace of `steps` steps as per-step figures: ms by kind (every kind of KIND_ORDER), device ms,
    the span and the busy time, the idle share, launches, syncs, and the TOP largest kernels."""
    work = device_events(events, framework, device)
    kinds = dict.fromkeys(KIND_ORDER, 0.0)
    kernels: dict[str, list] = {}
    launches = 0
    for event, us, leaf in self_times(work):
        kind = classify(event)
        kinds[kind] += us
        entry = kernels.setdefault(event["name"], [kind, 0.0, 0])
        entry[1] += us
        entry[2] += 1
        launches += leaf
    start = min((e["ts"] for e in work), default=0.0)
    span = max((e["ts"] + e["dur"] for e in work), default=0.0) - start
    busy = union_length([(e["ts"], e["ts"] + e["dur"]) for e in work])
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:TOP]
    per_step = 1e3 * steps  # µs over the trace -> ms per step
    return {"steps": steps, "events": len(work), "kinds_ms": {k: us / per_step for k, us in kinds.items()},
            "device_ms": sum(kinds.values()) / per_step, "span_ms": span / per_step,
            "busy_ms": busy / per_step,
            "idle_share": 1 - busy / span if span > 0 else None, "launches_per_step": launches / steps,
            "syncs_per_step": host_syncs(events, framework, device) / steps,
            "top": [{"name": name, "kind": kind, "ms_per_step": us / per_step, "calls_per_step": n / steps}
                    for name, (kind, us, n) in top]}
