"""Every speed figure names its machine (issue 55): the block rosetta/machine.py and
benchmarks/machine.py build, in every results writer and in run.json, and the `--isa avx2` cap, which
each library must report back as AVX2 (asked the way a user would: oneDNN's and MKL's own verbose
banners, ATen's capability, the code XLA emitted, CTranslate2's own log)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.common import machine_line, with_machine, write_results
from rosetta.errors import RosettaError
from rosetta.machine import (
    ISA_CAPS,
    UNCAPPED_DOTS,
    cpu_facts,
    describe,
    intel_cpu,
    isa_cap,
    isa_environment,
    machine_block,
)

ROOT = Path(__file__).resolve().parent.parent
HAS_AVX2 = "avx2" in cpu_facts()["vector_flags"]


def test_isa_environment_caps_every_library_and_native_takes_every_cap_away():
    devices = "--xla_force_host_platform_device_count=2"
    capped = isa_environment("avx2", {"XLA_FLAGS": devices, "PATH": "/bin"})
    assert capped["XLA_FLAGS"].split() == [devices, "--xla_cpu_max_isa=AVX2"]
    assert {k: capped[k] for k in ISA_CAPS["avx2"] if k != "XLA_FLAGS"} == {
        "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "CT2_FORCE_CPU_ISA": "AVX2"}
    assert capped["PATH"] == "/bin" and isa_cap(capped) == "avx2"
    native = isa_environment("native", capped)
    assert native == {"XLA_FLAGS": devices, "PATH": "/bin"}
    assert isa_cap(native) == "native"
    assert isa_cap({"ONEDNN_MAX_CPU_ISA": "AVX2"}) == "partial avx2: ONEDNN_MAX_CPU_ISA"
    with pytest.raises(RosettaError, match=r"--isa avx512: not an ISA cap; give one of native, avx2"):
        isa_environment("avx512")


def test_the_block_names_the_cpu_its_dispatch_and_a_calibration():
    block = machine_block(calibrate_repeats=1)
    assert set(block["cpu"]) == {"vendor", "model", "vector_flags", "cores", "l2", "l3"}
    assert block["torch_dispatch"]["aten"] in {"DEFAULT", "AVX2", "AVX512", "ZVECTOR", "VSX", "NO AVX"}
    if block["torch_dispatch"]["mkl"] != "unknown":  # MKL's banner names an ISA on Intel's CPUs only
        assert (block["torch_dispatch"]["mkl"] == "generic") == (not intel_cpu()), block
    assert block["matmul"]["gflops"] > 0 and block["matmul"]["size"] == 1024
    line = describe(block)
    assert line.startswith(block["cpu"]["model"]) and "GFLOP/s" in line and "ATen" in line


def test_a_capped_line_says_when_xlas_dots_are_not_capped():
    """YNNPACK and XNNPACK read cpuid themselves (XNNPACK's ynnpack/base/arch.cc has no cap setting): on
    an AVX-512 CPU a capped table must not read as if JAX's matmuls ran AVX2."""
    block = {"cpu": {"model": "X", "cores": 2, "vector_flags": ["avx2", "fma", "avx512f"]}, "isa_cap": "avx2",
             "torch_dispatch": {"aten": "AVX2"}, "xla_dispatch": {"dots": "YNNPACK"}}
    assert describe(block).endswith("(ATen AVX2) but not XLA's dots (YNNPACK at AVX-512: no cap reaches it)")
    assert "dots" not in describe(block | {"isa_cap": "native"})
    assert "dots" not in describe(block | {"xla_dispatch": {"dots": "XLA's own"}})
    assert "dots" not in describe(block | {"cpu": block["cpu"] | {"vector_flags": ["avx2", "fma"]}})


def test_every_results_writer_records_the_machine_block_and_prints_it_under_the_title(tmp_path):
    """Each benchmark that writes a results file takes its environment from environment() (whose
    "machine_block" is benchmarks.machine's), and write_results puts the machine line under the title,
    once, also where the benchmark already printed it (with_machine)."""
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        calls = {node.func.id for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
        if "write_results" in calls and path.name != "common.py":
            assert "environment" in calls, f"{path.name} writes results without environment()"
    env = {"machine_block": machine_block(calibrate_repeats=1)}
    _, md = write_results("t", {"environment": env}, "# Title\n\nbody\n", tmp_path)
    text = md.read_text()
    assert text.splitlines()[:3] == ["# Title", "", machine_line(env)] and text.count("Machine:") == 1
    assert with_machine(text, env) == text
    assert json.loads((tmp_path / "t.json").read_text())["environment"]["machine_block"]["cpu"]
    assert machine_line({}) == "Machine: not recorded (a file from before issue 55)"


@pytest.mark.skipif(not HAS_AVX2, reason="this CPU has no AVX2: there is nothing to cap at")
def test_under_the_avx2_cap_every_library_reports_avx2():
    """`python -m benchmarks.machine --isa avx2 --json` in a fresh process (it starts itself again with
    the cap's environment): ATen, oneDNN, MKL, XLA's emitted code and CTranslate2 all at AVX2; XLA's dots
    where a library runs them that no cap reaches (YNNPACK on an AVX-512 CPU) named as such."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.machine", "--isa", "avx2", "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    block = json.loads(done.stdout)
    assert block["isa_cap"] == "avx2"
    dispatch = block["torch_dispatch"]
    assert dispatch["aten"] == "AVX2"  # ATen takes the capability it is given wherever AVX2 exists
    # oneDNN and MKL pick their own path at or below the cap (MKL its generic one on a CPU not Intel's,
    # whose banner names no ISA): nothing wider than AVX2, and a banner read.
    for library in ("onednn", "mkl"):
        assert dispatch[library] != "unknown" and "512" not in dispatch[library] \
            and "AMX" not in dispatch[library] and "AVX10" not in dispatch[library], dispatch
    assert block["xla_dispatch"]["max_isa"] == "AVX2"
    assert block["xla_dispatch"]["code"] in {"AVX2", "SSE (no ymm register)"}  # no zmm, no mask register
    # ...but not the dots XLA hands to a library that reads cpuid itself: the line under a table says so
    dots = block["xla_dispatch"]["dots"]
    assert dots in {"YNNPACK", "XNNPACK", "oneDNN", "XLA's own"}, block["xla_dispatch"]
    uncapped = dots in UNCAPPED_DOTS and "avx512f" in block["cpu"]["vector_flags"]
    assert ("but not XLA's dots" in describe(block)) == uncapped
    assert block["ct2_dispatch"]["isa"] == "AVX2" and block["ct2_dispatch"]["mkl_max_isa"] == "AVX2"
    assert block["calibration"]["matmul_gflops"] > 0


def test_rosetta_train_records_the_machine_in_run_json(tmp_path):
    from rosetta.cli import main

    args = ["train", "--backend", "torch", "--device", "cpu", "--steps", "1", "--train-size", "64",
            "--eval-size", "4", "--bleu-samples", "4", "--eval-every", "0", "--checkpoint-every", "0",
            "--no-progress", "--out", str(tmp_path)]
    assert main(args) == 0
    record = json.loads((tmp_path / "torch" / "run.json").read_text())
    assert record["machine"]["cpu"]["vector_flags"] == cpu_facts()["vector_flags"]
    assert record["machine"]["isa_cap"] == isa_cap() and record["machine"]["matmul"]["gflops"] > 0


def test_print_env_gives_the_shell_lines_of_the_cap_for_any_other_command():
    """`eval "$(python -m benchmarks.machine --print-env avx2)"` caps what runs after it in that shell
    (rosetta train, a user's script); --print-env native takes the cap away again, other flags kept."""
    show = "import os; from rosetta.machine import isa_cap; print(isa_cap(), os.environ.get('XLA_FLAGS'))"
    script = (f'eval "$(python -m benchmarks.machine --print-env avx2)" && python -c "{show}" && '
              f'eval "$(python -m benchmarks.machine --print-env native)" && python -c "{show}"')
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    devices = "--xla_force_host_platform_device_count=2"
    assert done.stdout.splitlines() == [f"avx2 {devices} --xla_cpu_max_isa=AVX2", f"native {devices}"]


def test_the_full_block_is_measured_once_a_process_per_cap_setting(monkeypatch):
    """benchmarks.machine.full_block measures (two probe processes and four timings) once a process for
    each setting of ISA_CAPS's variables: every later call gets a fresh copy of that block, and a
    changed cap variable measures again. The measurements are counted, not run, here."""
    from benchmarks import machine

    measured: list[str | None] = []

    def block() -> dict:
        measured.append(os.environ.get("ONEDNN_MAX_CPU_ISA"))
        return {"cpu": {"model": "x"}, "matmul": {"gflops": 1.0}}

    monkeypatch.setattr(machine, "machine_block", block)
    monkeypatch.setattr(machine, "xla_dispatch", lambda: {"compile_s": 0.1})
    monkeypatch.setattr(machine, "ct2_dispatch", dict)
    monkeypatch.setattr(machine, "python_loop_s", lambda: 0.1)
    monkeypatch.setattr(machine, "torch_step_ms", lambda: 0.1)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    machine._full_block.cache_clear()
    try:
        first = machine.full_block()
        first["cpu"]["model"] = "changed by its reader"
        again = machine.full_block()
        assert again["cpu"]["model"] == "x" and len(measured) == 1  # a copy, not measured again
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
        machine.full_block()
        assert measured == [None, "AVX2"]
    finally:
        machine._full_block.cache_clear()  # later tests measure the real machine
