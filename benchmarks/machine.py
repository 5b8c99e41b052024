"""The machine a figure ran on, and a calibration (issue 55): every results file carries this block.

    python -m benchmarks.machine               # a few seconds: the facts and the calibration, as a table
    python -m benchmarks.machine --isa avx2    # the same with every library capped at AVX2
    python -m benchmarks.machine --json        # the block every results file records

Two machines of one name ("AMD EPYC") differed twofold here: one had AVX-512, the other AVX2 only. So
the block records the CPU's vector extensions and cache sizes (rosetta/machine.py), the ISA each library
dispatches to (ATen, oneDNN and MKL asked in this process; XLA and CTranslate2 each in a process of its
own, since a library reads its cap when it starts), the cap in force, and four timings that place the
machine: a float32 1024 matmul in PyTorch (GFLOP/s), a fixed pure-Python loop, a fixed tiny PyTorch
eager training step and one small JAX compile.

`--isa avx2` (on this and every benchmark that takes it) reruns the command in a process whose
environment caps oneDNN, ATen, MKL, XLA and CTranslate2 at AVX2 (rosetta/machine.py: ISA_CAPS), so an
AVX-512 machine measures what an AVX2-only one would run (its clock and caches stay its own).
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rosetta.machine import ISA_CAPS, ISA_NAMES, describe, isa_environment, machine_block

# XLA's probe, run in its own process (its XLA_FLAGS must name the dump folder before JAX starts): one
# small program compiled with the persistent cache off, timed, and its object code kept for reading.
XLA_PROBE = """
import time, jax, jax.numpy as jnp
jax.config.update("jax_enable_compilation_cache", False)
x = jnp.linspace(0.0, 1.0, 256 * 256).reshape(256, 256)
start = time.perf_counter()
fn = jax.jit(lambda a: jnp.tanh(a @ a) * 2.0 + jnp.exp(a)).lower(x).compile()
print(time.perf_counter() - start)
fn(x).block_until_ready()
"""
# The fusion kinds XLA's CPU backend gives a dot it hands to a library. YNNPACK and XNNPACK pick their
# kernels from cpuid themselves (XNNPACK's ynnpack/base/arch.cc): --xla_cpu_max_isa does not reach them.
DOT_LIBRARIES = {"__ynn_fusion": "YNNPACK", "__xnn_fusion": "XNNPACK", "__onednn_fusion": "oneDNN"}
# CTranslate2 reports its CPU and ISA as a Translator starts, before it finds the model missing.
CT2_PROBE = """
import ctranslate2, sys
try:
    ctranslate2.Translator(sys.argv[1], device="cpu")
except Exception:
    pass
"""


def _probe(code: str, env: dict, *args: str, timeout: float = 120) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                              timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None


def xla_dispatch() -> dict:
    """What XLA's CPU code generator emitted for one small program (from its object files: AVX-512 where
    any zmm or mask register is used, AVX2 where only ymm registers are), its cap flag, the library its
    dot ran in (from the optimized HLO: DOT_LIBRARIES) and the seconds that program took to compile.
    "unknown" where JAX or objdump is missing."""
    out: dict = {"max_isa": _xla_cap(), "code": "unknown", "dots": "unknown", "compile_s": None}
    dump = Path(tempfile.mkdtemp(prefix="rosetta-xla-probe-"))
    try:
        env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump}".strip())
        done = _probe(XLA_PROBE, env)
        if done is None or done.returncode != 0:
            return out | {"code": "unknown (JAX did not run)"}
        out["compile_s"] = float(done.stdout.split()[0])
        # Nothing dumped: XLA did not read --xla_dump_to (it stops reading XLA_FLAGS at a word without "--").
        hlo = "".join(o.read_text(errors="replace") for o in dump.glob("*after_optimizations.txt"))
        objects = list(dump.glob("*.o"))
        if not hlo or not objects:
            return out | {"code": "unknown (XLA dumped nothing)", "dots": "unknown (XLA dumped nothing)"}
        out["dots"] = next((name for kind, name in DOT_LIBRARIES.items() if f'"{kind}"' in hlo), "XLA's own")
        objdump = shutil.which("objdump")
        if objdump is None:
            return out | {"code": "unknown (objdump not found)"}
        text = "".join(subprocess.run([objdump, "-d", str(o)], capture_output=True, text=True).stdout
                       for o in objects)
        out["code"] = ("AVX-512" if re.search(r"%zmm|%k[1-7]", text) else "AVX2" if "%ymm" in text
                       else "SSE (no ymm register)")
        return out
    finally:
        shutil.rmtree(dump, ignore_errors=True)


def _xla_cap() -> str:
    found = re.search(r"--xla_cpu_max_isa=(\S+)", os.environ.get("XLA_FLAGS", ""))
    return found[1] if found else "none"


def ct2_dispatch() -> dict:
    """CTranslate2's own report (CT2_VERBOSE=1, printed when a Translator starts): the ISA it selected
    for its kernels and its SGEMM backend; {} where CTranslate2 is not installed."""
    with tempfile.TemporaryDirectory(prefix="rosetta-ct2-probe-") as missing:
        done = _probe(CT2_PROBE, dict(os.environ, CT2_VERBOSE="1"), str(Path(missing) / "none"))
    if done is None or "No module named" in done.stderr:
        return {}
    isa = re.search(r"Selected ISA: (\S+)", done.stderr)
    sgemm = re.search(r"SGEMM backend: ([^\n]+)", done.stderr)
    return {"isa": isa[1] if isa else "unknown", "sgemm": sgemm[1].strip() if sgemm else "unknown",
            "mkl_max_isa": os.environ.get("MKL_ENABLE_INSTRUCTIONS", "none")}


def python_loop_s(n: int = 2_000_000, repeats: int = 5) -> float:
    """The median seconds of a fixed pure-Python loop (the interpreter's speed: the harness's host work)."""
    times = []
    for _ in range(repeats):
        start, total = time.perf_counter(), 0
        for i in range(n):
            total += i * i
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def torch_step_ms(repeats: int = 20) -> float:
    """The median milliseconds of a fixed tiny eager training step in PyTorch: a 2-layer 256-wide MLP,
    batch 64, forward, backward and an SGD update (small kernels: dispatch and memory, not the GEMM peak)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256, generator=gen)
    times = []
    for i in range(repeats + 3):
        start = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        if i >= 3:  # the first steps allocate
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def full_block() -> dict:
    """rosetta.machine's block with XLA's and CTranslate2's dispatch and the four timings: measured once
    a process for each setting of the caps' variables (ISA_CAPS; the probes start two processes, about
    1.5 s of CPU: the suite wrote 20 results files a run), a fresh copy each call."""
    names = sorted({name for settings in ISA_CAPS.values() for name in settings})
    return copy.deepcopy(_full_block(tuple(os.environ.get(name) for name in names)))


@functools.cache
def _full_block(caps: tuple) -> dict:
    block = machine_block()
    block["xla_dispatch"] = xla_dispatch()
    block["ct2_dispatch"] = ct2_dispatch()
    block["calibration"] = {"matmul_gflops": block.get("matmul", {}).get("gflops"),
                            "python_loop_s": python_loop_s(), "torch_step_ms": torch_step_ms(),
                            "jax_compile_s": block["xla_dispatch"]["compile_s"]}
    return block


def table(block: dict) -> str:
    """The block as a short markdown table, under one line of describe()."""
    cpu, torch_isa = block["cpu"], block.get("torch_dispatch", {})
    xla, ct2, cal = block.get("xla_dispatch", {}), block.get("ct2_dispatch", {}), block.get("calibration", {})
    ct2_line = f"ISA {ct2.get('isa')}, SGEMM {ct2.get('sgemm')}, MKL cap {ct2.get('mkl_max_isa')}"
    rows = [("CPU", f"{cpu['model']}, {cpu['cores']} cores, L2 {cpu['l2']}, L3 {cpu['l3']}"),
            ("vector extensions", " ".join(cpu["vector_flags"]) or "none of AVX2 and above"),
            ("ISA cap", block["isa_cap"]),
            ("ATen / oneDNN / MKL",
             f"{torch_isa.get('aten')} / {torch_isa.get('onednn')} / {torch_isa.get('mkl')}"),
            ("XLA", f"code {xla.get('code')}, dots {xla.get('dots')}, "
                    f"--xla_cpu_max_isa {xla.get('max_isa')}"),
            ("CTranslate2", ct2_line if ct2 else "not installed")]
    if cal:
        rows += [("float32 1024 matmul (PyTorch)", f"{cal['matmul_gflops']:.0f} GFLOP/s"),
                 ("pure-Python loop (2M iterations)", f"{cal['python_loop_s']:.3f} s"),
                 ("tiny PyTorch eager step", f"{cal['torch_step_ms']:.3f} ms"),
                 ("one small JAX compile", "not run" if cal["jax_compile_s"] is None
                  else f"{cal['jax_compile_s']:.3f} s")]
    lines = [describe(block), "", "| | |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in rows)]
    return "\n".join(lines) + "\n"


def env_lines(isa: str) -> str:
    """POSIX shell lines that put this process's environment at `isa` (rosetta.machine.isa_environment):
    an export for each variable it sets or changes, an unset for each cap it takes away."""
    now, wanted = dict(os.environ), isa_environment(isa)
    lines = [f"export {k}={shlex.quote(v)}" for k, v in sorted(wanted.items()) if now.get(k) != v]
    lines += [f"unset {k}" for k in sorted(set(now) - set(wanted))]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from benchmarks.common import parser

    cli = parser(__file__, __doc__)
    cli.add_isa()
    cli.add_argument("--json", action="store_true", help="print the block as JSON instead of a table")
    cli.add_argument("--print-env", choices=ISA_NAMES, metavar="ISA",
                     help="print the shell lines that cap (avx2) or uncap (native) every library, for any "
                          "other command: eval \"$(python -m benchmarks.machine --print-env avx2)\"; "
                          "nothing is measured")
    args = cli.parse_args(argv)
    if args.print_env:
        print(env_lines(args.print_env))
        return
    cli.apply_isa(args, argv)
    block = full_block()
    print(json.dumps(block, indent=2) if args.json else table(block), end="" if not args.json else "\n")


if __name__ == "__main__":
    main()
