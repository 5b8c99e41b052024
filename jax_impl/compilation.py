"""Compilation in the JAX backend, said once: every step is jitted, so what matters is that each
program compiles once (jit's own cache, per input shape), that a second run compiles nothing (JAX's
persistent compilation cache, on disk), that XLA compiles with the flags our benchmarks measured,
and that the seconds spent compiling are counted apart from the steps. `rosetta train`, the
benchmarks and the backend's Model all go through `configure`; `CompileClock` reads JAX's own
compilation events. torch_impl/compilation.py holds PyTorch's (torch.compile).
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache

from rosetta.device import CACHE_MAX_BYTES, CACHE_OFF

# XLA flags of every JAX program here, GPU and CPU alike (a GPU flag is inert on a CPU). Matmuls
# through cuBLAS, as PyTorch's: XLA's default also autotunes Triton GEMM kernels, ~70 s per compiled
# `base` step on an H100 (docs/benchmarks.md). A flag the user's XLA_FLAGS already sets is kept.
XLA_FLAGS = ("--xla_gpu_enable_triton_gemm=false",)


def set_xla_flags() -> None:
    """Add XLA_FLAGS to the environment's. XLA reads them when JAX starts its backends (the first
    device query): this module runs it when imported, which jax_impl/backend.py and
    jax_impl/distributed.py do first; after JAX started it changes nothing in this process."""
    given = os.environ.get("XLA_FLAGS", "")
    missing = [flag for flag in XLA_FLAGS if flag.split("=")[0] not in given]
    if missing:
        os.environ["XLA_FLAGS"] = " ".join([given, *missing]).strip()


set_xla_flags()  # at import: every JAX module of ours imports this one before any device query


def configure(cache_dir: str | os.PathLike | None) -> None:
    """XLA's flags (set_xla_flags) and the persistent compilation cache: in `cache_dir`/jax
    (`rosetta train` gives rosetta's cache, rosetta/device.py), none for CACHE_OFF, and for None JAX's own
    setting left as it is (JAX_COMPILATION_CACHE_DIR, or the caller's jax.config: a trainer built in
    a library user's process does not undo their cache; until issue 46 it turned it off). Every
    compiled program is kept, however quick its compilation (JAX keeps only those over 1 s by
    default), so that a second run of the same settings compiles nothing; the cache bounded to
    CACHE_MAX_BYTES unless the environment bounds it (JAX_COMPILATION_CACHE_MAX_SIZE)."""
    set_xla_flags()
    if cache_dir is None:
        return
    wanted = None if cache_dir == CACHE_OFF else str((Path(cache_dir).expanduser() / "jax").resolve())
    if wanted == jax.config.jax_compilation_cache_dir:
        return
    if wanted is not None:
        Path(wanted).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", wanted)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ:  # the user's own bound (-1: none) stays
        jax.config.update("jax_compilation_cache_max_size", CACHE_MAX_BYTES)
    compilation_cache.reset_cache()  # the cache opens its directory once: reopen it at the new one


# JAX's monitoring events, summed over the process since this module was imported.
_TRACE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration")
_BACKEND_EVENT = "/jax/core/compile/backend_compile_duration"  # XLA's compilation, or a cache read
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"  # recorded just before its backend event
_seconds = [0.0]
_compiled: Counter[str] = Counter()  # function name -> programs XLA compiled for it
_hit = threading.local()
_lock = threading.Lock()


def _on_duration(event: str, seconds: float, fun_name: str = "", **_: object) -> None:
    if event in _TRACE_EVENTS or event == _BACKEND_EVENT:
        with _lock:
            _seconds[0] += seconds
            if event == _BACKEND_EVENT:
                if not getattr(_hit, "pending", False):
                    _compiled[fun_name] += 1
                _hit.pending = False


def _on_event(event: str, **_: object) -> None:
    if event == _CACHE_HIT_EVENT:
        _hit.pending = True


jax.monitoring.register_event_duration_secs_listener(_on_duration)
jax.monitoring.register_event_listener(_on_event)


def compile_totals() -> tuple[float, int]:
    """(seconds, programs): the time this process spent tracing, lowering and compiling programs (a
    program read from the persistent cache counts its read), and how many programs XLA compiled
    (those read from the cache not counted)."""
    with _lock:
        return _seconds[0], sum(_compiled.values())


def compiled_programs() -> Counter[str]:
    """Programs XLA compiled so far in this process, by the name of the function jitted."""
    with _lock:
        return Counter(_compiled)
