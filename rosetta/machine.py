"""What a speed figure ran on (issue 55): two machines that both call themselves "AMD EPYC" differ
twofold when one has AVX-512 and the other only AVX2, so every results file and every run.json records
the CPU's vector extensions, the ISA each library actually dispatches to, the cache sizes, any ISA cap
in force, and a calibration (a float32 1024 matmul's GFLOP/s). `isa_environment("avx2")` is the one
recipe that caps every library at AVX2, making an AVX2 machine of any newer x86 CPU.

Framework-free at import (torch is imported only to ask it); XLA's and CTranslate2's dispatch are
asked in their own processes by benchmarks/machine.py."""

from __future__ import annotations

import functools
import os
import platform
import re
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from rosetta.errors import RosettaError

# The CPU flags (/proc/cpuinfo's names) that decide the kernels here: AVX2 + FMA is the floor the
# libraries' fast paths need, AVX-512 doubles the float32 width, bf16/VNNI/AMX serve low precision.
VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")

# The ISA caps `--isa` takes, and for each the environment that makes every library stop there: oneDNN,
# ATen's own kernels, MKL (PyTorch's BLAS and CTranslate2's), XLA's code generator, CTranslate2's own
# kernels. Each is read when its library starts, so a cap applies to a process started with it.
ISA_CAPS: dict[str, dict[str, str]] = {
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "CT2_FORCE_CPU_ISA": "AVX2", "XLA_FLAGS": "--xla_cpu_max_isa=AVX2"},
}
# XLA's dot libraries that choose their kernels from cpuid themselves (benchmarks/machine.py's
# DOT_LIBRARIES): under a cap, JAX's matmuls still run at the CPU's widest ISA.
UNCAPPED_DOTS = ("YNNPACK", "XNNPACK")
ISA_NAMES = ("native", *ISA_CAPS)  # native: no cap, each library picks the best this CPU has
XLA_CAP_FLAG = "--xla_cpu_max_isa="


def isa_environment(isa: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` (default os.environ) with every library capped at `isa`, or ("native") every cap of
    ISA_CAPS taken away. XLA_FLAGS keeps the flags already given (a cap there is replaced)."""
    if isa not in ISA_NAMES:
        raise RosettaError(f"--isa {isa}: not an ISA cap; give one of {', '.join(ISA_NAMES)}")
    env = dict(os.environ if env is None else env)
    kept = [f for f in env.pop("XLA_FLAGS", "").split() if not f.startswith(XLA_CAP_FLAG)]
    for settings in ISA_CAPS.values():
        for name in settings:
            if name != "XLA_FLAGS":
                env.pop(name, None)
    for name, value in ISA_CAPS.get(isa, {}).items():
        if name == "XLA_FLAGS":
            kept.append(value)
        else:
            env[name] = value
    return env | ({"XLA_FLAGS": " ".join(kept)} if kept else {})


def isa_cap(env: Mapping[str, str] | None = None) -> str:
    """The cap in force in `env` (default os.environ): "native" when none of ISA_CAPS's settings is
    there, the cap's name when all are; a partial cap is named for what it sets ("partial: ...")."""
    env = os.environ if env is None else env
    for isa, settings in ISA_CAPS.items():
        present = [k for k, v in settings.items() if _has(env, k, v)]
        if len(present) == len(settings):
            return isa
        if present:
            return f"partial {isa}: {', '.join(present)}"
    return "native"


def _has(env: Mapping[str, str], name: str, value: str) -> bool:
    if name == "XLA_FLAGS":
        return value in env.get("XLA_FLAGS", "").split()
    return env.get(name, "").lower() == value.lower()


def cpu_facts() -> dict:
    """The CPU's vendor and model, the VECTOR_FLAGS it has, its L2 and L3 sizes and its logical core count."""
    vendor, model, flags = _cpuinfo()
    return {"vendor": vendor, "model": model, "vector_flags": [f for f in VECTOR_FLAGS if f in flags],
            "cores": os.cpu_count(), **_cache_sizes()}


def intel_cpu() -> bool:
    """Whether the CPU is Intel's: MKL runs its ISA-specific kernels there only (elsewhere its generic
    path, 160 GFLOP/s for a float32 GEMM on the 2-core AVX-512 AMD EPYC where oneDNN ran 455)."""
    return _cpuinfo()[0] == "GenuineIntel"


@functools.cache
def _cpuinfo() -> tuple[str, str, frozenset[str]]:
    """/proc/cpuinfo's vendor_id, model name and flags of the first CPU; without it, platform's processor
    string (Windows: "Intel64 Family 6 ..., GenuineIntel") and no flags."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
            if key.strip() == "flags":
                break
    except OSError:
        processor = platform.processor()
        vendor = next((v for v in ("GenuineIntel", "AuthenticAMD") if v in processor), "unknown")
        return vendor, processor or platform.machine(), frozenset()
    return (fields.get("vendor_id", "unknown"), fields.get("model name") or platform.machine(),
            frozenset(fields.get("flags", "").split()))


def _cache_sizes() -> dict:
    """L2 (per core) and L3 sizes as sysfs gives them ("2048K"), None where it does not."""
    sizes: dict[str, str | None] = {"l2": None, "l3": None}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level, kind = (index / "level").read_text().strip(), (index / "type").read_text().strip()
            if level in ("2", "3") and kind in ("Unified", "Data"):
                sizes[f"l{level}"] = (index / "size").read_text().strip()
        except OSError:
            continue
    return sizes


def _captured_stdout(fn: Callable[[], object]) -> str:
    """What `fn` wrote to file descriptor 1 (oneDNN's and MKL's verbose lines come from C, not Python)."""
    sys.stdout.flush()
    with tempfile.TemporaryFile() as sink:
        saved = os.dup(1)
        os.dup2(sink.fileno(), 1)
        try:
            fn()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        sink.seek(0)
        return sink.read().decode(errors="replace")


def _first(pattern: str, text: str) -> str | None:
    match = re.search(pattern, text)
    return match[1].strip() if match else None


@functools.cache
def torch_dispatch() -> dict:
    """The ISA PyTorch's three CPU libraries dispatch to in this process: ATen's own kernels
    (get_cpu_capability), oneDNN's (its verbose banner) and MKL's (its verbose banner). None where
    PyTorch is not installed; a library that printed no banner is "unknown". Asked once a process."""
    try:
        import torch
    except ImportError:
        return {}
    out = {"aten": torch.backends.cpu.get_cpu_capability(), "onednn": "unknown", "mkl": "unknown"}

    def onednn() -> None:  # a convolution goes through oneDNN at every ISA (a matmul may not)
        with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
            torch.ops.aten.mkldnn_convolution(torch.ones(1, 8, 4, 4), torch.ones(8, 8, 3, 3), None,
                                              [0, 0], [1, 1], [1, 1], 1)

    def mkl() -> None:
        with torch.backends.mkl.verbose(torch.backends.mkl.VERBOSE_ON):
            torch.ones(8, 8) @ torch.ones(8, 8)

    if torch.backends.mkldnn.is_available():
        out["onednn"] = _first(r"onednn_verbose,[^\n]*?isa:([^\n]*)", _captured_stdout(onednn)) or "unknown"
    if torch.backends.mkl.is_available():
        banner = _first(r"(MKL_VERBOSE oneMKL[^\n]*)", _captured_stdout(mkl)) or ""
        isa = _first(r"architecture Intel\(R\) [^(]*\(Intel\(R\) ([^)]+)\)", banner)
        if isa:
            out["mkl"] = isa + (" + AMX" if "AMX" in banner else "")
        elif "Intel(R) Architecture processors" in banner:  # no ISA named: MKL's generic path (not Intel)
            out["mkl"] = "generic"
    return out


def matmul_gflops(size: int = 1024, repeats: int = 7) -> dict:
    """The calibration: a float32 [size, size] @ [size, size] in PyTorch on its threads (2 size^3
    flops), the median GFLOP/s over `repeats` after one warm-up call, and the slowest and fastest."""
    import torch

    a, b = torch.rand(size, size), torch.rand(size, size)
    a @ b
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        rates.append(2 * size**3 / (time.perf_counter() - start) / 1e9)
    rates.sort()
    return {"gflops": rates[len(rates) // 2], "min": rates[0], "max": rates[-1], "size": size,
            "threads": torch.get_num_threads()}


def machine_block(calibrate_repeats: int = 7) -> dict:
    """What every results file and run.json records beside its figures: the CPU, the cap in force,
    what PyTorch's libraries dispatch to, and the matmul calibration over `calibrate_repeats` calls
    (0: none)."""
    block = {"cpu": cpu_facts(), "isa_cap": isa_cap(), "torch_dispatch": torch_dispatch(),
             "xla_flags": os.environ.get("XLA_FLAGS", "")}
    if calibrate_repeats and block["torch_dispatch"]:
        block["matmul"] = matmul_gflops(repeats=calibrate_repeats)
    return block


def describe(block: Mapping) -> str:
    """One line for a table's head: the CPU, its widest vector ISA, the cap and the calibration."""
    cpu = block.get("cpu", {})
    flags = cpu.get("vector_flags", [])
    widest = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "below AVX2"
    amx = " + AMX" if "amx_tile" in flags else ""
    cap = block.get("isa_cap", "native")
    line = f"{cpu.get('model', 'unknown CPU')}, {cpu.get('cores')} cores, {widest}{amx}"
    line += f", capped at {cap}" if cap != "native" else ", no ISA cap"
    aten = block.get("torch_dispatch", {}).get("aten")
    line += f" (ATen {aten})" if aten else ""
    dots = block.get("xla_dispatch", {}).get("dots")
    if cap != "native" and dots in UNCAPPED_DOTS and widest == "AVX-512":  # cpuid read by the library itself
        line += f" but not XLA's dots ({dots} at {widest}: no cap reaches it)"
    if "matmul" in block:
        m = block["matmul"]
        line += f"; float32 {m['size']} matmul {m['gflops']:.0f} GFLOP/s ({m['min']:.0f}-{m['max']:.0f})"
    return line
