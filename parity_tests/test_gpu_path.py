"""The GPU path, proven on the CPU (the same functions; only the device differs): a training step
that never waits for the host between log steps, `rosetta train --compile` as whole graphs, one per
batch shape, JAX compiling once per shape and not at all in a second run, and
`python -m benchmarks.gpu_check --preset tiny` passing.

Nothing here is timed: the counts are of reads from the device (a TorchFunctionMode; for JAX, the
array's own conversion to host values), of graphs (a counting torch.compile backend) and of
programs (JAX's own compilation events)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from rosetta import init_params, preset
from rosetta.backends import get_trainer
from rosetta.harness.batching import BatchIterator
from rosetta.harness.data import synthetic_pairs
from rosetta.harness.loop import RunConfig, train
from rosetta.harness.report import read_log
from rosetta.training import TrainConfig

ROOT = Path(__file__).parent.parent
NO_DROPOUT = {"dropout": 0.0, "attention_dropout": 0.0}
QUICK = dict(task="copy", max_tokens=512, buckets=(24,), train_size=500, eval_size=8, bleu_samples=4,
             warmup=10, progress=False, device="cpu", overrides=NO_DROPOUT)


def bucket_batches(cfg, buckets=(8, 16, 24), per_shape: int = 2) -> list:
    """`per_shape` batches of each bucket length, the harness's own (rosetta/harness/batching.py)."""
    pairs = synthetic_pairs("copy", 600, cfg.src_vocab_size, 1, max(buckets) - 2, seed=0)
    found: dict[int, list] = {}
    for batch in BatchIterator.from_config(pairs, cfg, max_tokens=384, buckets=buckets).epoch_batches():
        found.setdefault(batch.shape[1], []).append(batch)
    assert sorted(found) == sorted(buckets)
    return [b for length in buckets for b in found[length][:per_shape]]


# -- Item 3: no host stall inside a step ----------------------------------------------------------

# Tensor methods that hand a tensor's value to Python (waiting for the device to compute it), on any
# device; and the moves to the host, of a tensor that is not there already.
TORCH_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__float__,
               torch.Tensor.__int__, torch.Tensor.__bool__, torch.Tensor.__index__}
TORCH_MOVES = {torch.Tensor.cpu, torch.Tensor.to}


class DeviceReads(TorchFunctionMode):
    """Counts every call of TORCH_READS, and of TORCH_MOVES to the CPU from another device, made
    while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        to_cpu = func is torch.Tensor.cpu or any(str(a) == "cpu" for a in (*args[1:], *kwargs.values()))
        moved = (func in TORCH_MOVES and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu"
                 and to_cpu)
        if func in TORCH_READS or moved:
            self.reads[func.__name__] += 1
        return func(*args, **kwargs)


@pytest.fixture
def count_reads(monkeypatch):
    """A function that counts the reads from the device (torch: DeviceReads; JAX: a jax.Array's
    `_value`, which every conversion to NumPy, float or bool goes through, and block_until_ready)
    made inside the trainer's `step` and `prepare`, per step number; `Trainer.read` is where reads
    belong and is not counted."""
    import jax._src.array as jax_array

    counts: Counter[int] = Counter()
    active = [False]
    value = jax_array.ArrayImpl._value

    def counted_value(self):
        if active[0]:
            counts[current[0]] += 1
        return value.fget(self)

    monkeypatch.setattr(jax_array.ArrayImpl, "_value", property(counted_value))
    block = jax_array.ArrayImpl.block_until_ready

    def counted_block(self):
        if active[0]:
            counts[current[0]] += 1
        return block(self)

    monkeypatch.setattr(jax_array.ArrayImpl, "block_until_ready", counted_block)
    current = [0]

    def wrap(cls):
        for name in ("step", "prepare"):
            original = getattr(cls, name)

            def wrapped(self, *args, _original=original, **kwargs):
                current[0] = self.step_count + 1  # the step this call dispatches or prepares a batch for
                active[0] = True
                mode = DeviceReads()
                try:
                    with mode:
                        return _original(self, *args, **kwargs)
                finally:
                    active[0] = False
                    counts[current[0]] += sum(mode.reads.values())

            monkeypatch.setattr(cls, name, wrapped)
    return wrap, counts


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_no_step_reads_from_the_device_between_log_steps(backend, tmp_path, count_reads, monkeypatch):
    """`rosetta train --log-every 5` for 11 steps: the trainer's steps and the preparation of the
    batches read nothing from the device (each step's loss and gradient norm stay there), and the
    trainer's `read` runs at the first step of the batch shape, at the log steps and at the end only."""
    wrap, counts = count_reads
    Trainer = get_trainer(backend)
    wrap(Trainer)
    reads_at = []
    original_read = Trainer.read

    def read(self, metrics):
        reads_at.append(metrics["step"])
        return original_read(self, metrics)

    monkeypatch.setattr(Trainer, "read", read)
    result = train(RunConfig(backends=(backend,), out=str(tmp_path / "run"), steps=11, log_every=5,
                             eval_every=0, checkpoint_every=0, **QUICK))[backend]
    assert sum(counts.values()) == 0, counts
    assert reads_at == [1, 5, 10, 11]  # step 1: its shape's first step (it compiles), timed alone
    records = [r for r in read_log(tmp_path / "run" / backend / "log.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in records] == [5, 10, 11] and [r["stretch_steps"] for r in records] == [4, 5, 1]
    assert result["steps"] == 11 and np.isfinite(result["final_loss"])


# -- Item 2: rosetta train --compile ----------------------------------------------------------------

@pytest.fixture
def graph_counter(monkeypatch):
    """torch_impl/compilation.py's backend replaced by dynamo's counting one over aot_eager: the same
    graph capture (fullgraph: a graph break raises), eager kernels instead of inductor's code."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    from torch_impl import compilation

    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(compilation, "BACKEND", counter)
    torch._dynamo.reset()
    yield counter
    torch._dynamo.reset()


@pytest.mark.parametrize("loss", ["plain", "chunked"])
def test_compiled_training_is_one_whole_graph_per_batch_shape(loss, graph_counter):
    """Two bucket shapes, two batches each, twice over: two graphs (fullgraph: no break; a shape
    seen again compiles nothing), and the compiled step's losses are the eager step's (the same graph
    run by eager kernels: equal to float32 rounding; inductor's code is checked by
    benchmarks/gpu_check.py)."""
    cfg = preset("tiny", **NO_DROPOUT)
    params = init_params(cfg, seed=0)
    batches = bucket_batches(cfg, buckets=(8, 16))
    compiled, eager = (get_trainer("torch")(cfg, params, TrainConfig(warmup_steps=10), device="cpu",
                                            loss=loss, compile=c) for c in (True, False))
    for batch in batches * 2:
        a, b = compiled.read(compiled.step(batch)), eager.read(eager.step(batch))
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    assert graph_counter.frame_count == len({b.shape for b in batches}) == 2
    seconds, graphs = compiled.compilation()
    assert graphs >= 2 and seconds > 0


def test_rosetta_train_compile_runs_and_reports_its_compilation(tmp_path, graph_counter, capsys):
    from rosetta.cli import main

    out = tmp_path / "compiled"
    assert main(["train", "--backend", "torch", "--compile", "--steps", "4", "--out", str(out),
                 "--task", "copy", "--max-tokens", "512", "--buckets", "24", "--train-size", "300",
                 "--eval-size", "4", "--bleu-samples", "4", "--eval-every", "0", "--no-progress",
                 "--device", "cpu"]) == 0
    result = json.loads((out / "torch" / "result.json").read_text())
    assert result["compiles"] == graph_counter.frame_count == 1 and result["compile_time_total_s"] > 0
    assert "| compilation, all steps (s; programs compiled) |" in (out / "summary.md").read_text()
    capsys.readouterr()
    refused = tmp_path / "x"
    assert main(["train", "--backend", "torch", "--compile", "--nproc", "2", "--out", str(refused)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["rosetta: error: --compile trains in one process for now (DDP's and FSDP2's hooks under "
                   "torch.compile are not tested here): leave out --nproc/--shard or --compile"]
    assert not refused.exists()


def test_decoding_without_compile_never_imports_the_compiler():
    """PyTorch's model built and decoding (greedy and beam) import neither dynamo nor FSDP2: about 1 s
    of CPU at the start of every `rosetta translate`, `generate` or `diff` (torch_impl/compilation.py,
    distributed.py; a training process imports dynamo with torch.optim's Optimizer); the default
    decoder chosen (backends.default_decoder: torch here) imports no JAX either. And a compiled
    graph that would grow the position table is refused while traced, not traced (a NumPy table
    recomputed inside the graph): its callers grow it first (ops.grow_positions)."""
    script = """if True:
        import sys
        from rosetta import init_params, preset
        from rosetta.backends import default_decoder, from_params
        cfg = preset("tiny")
        model = from_params(cfg, init_params(cfg, seed=0), default_decoder()[0])
        for beams in (1, 2):
            model.generate([[5, 6, 7]], beam_size=beams)
        print(sorted(m for m in ("torch._dynamo", "torch.distributed.fsdp", "sympy", "jax", "flax")
                     if m in sys.modules), type(model).__module__)
    """
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "[] torch_impl.backend", \
        out.stdout + out.stderr[-2000:]
    from torch_impl.convert import build_model

    module = build_model(preset("tiny"), init_params(preset("tiny"), seed=0))
    grow = torch.compile(lambda: module.position_table(module.positions.shape[0] + 1), fullgraph=True,
                         backend="eager")
    with pytest.raises(Exception, match="position table grows outside a compiled step"):
        grow()


# -- Item 4: JAX compiles once ---------------------------------------------------------------------

@pytest.fixture
def jax_cache_setting() -> Iterator[str | None]:
    """The process's persistent-cache directory (the suite's), set back after the test: building a
    trainer with `compile_cache` changes it for the whole process."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    setting = jax.config.jax_compilation_cache_dir
    yield setting
    jax.config.update("jax_compilation_cache_dir", setting)
    compilation_cache.reset_cache()


def test_jax_compiles_its_train_step_once_per_batch_shape(jax_cache_setting):
    """Counted with JAX's own compilation events (jax_impl/compilation.py): three shapes, three
    compilations of the step; a second pass over them compiles nothing. The persistent cache off
    (`compile_cache="off"`), so that no program another test compiled is read instead."""
    import jax

    from jax_impl.compilation import compiled_programs

    cfg = preset("tiny", **NO_DROPOUT, num_encoder_layers=1, num_decoder_layers=1)
    trainer = get_trainer("jax")(cfg, init_params(cfg, seed=0), TrainConfig(warmup_steps=10), device="cpu",
                                 compile_cache="off")
    assert jax.config.jax_compilation_cache_dir is None
    batches = bucket_batches(cfg, per_shape=1)
    before = compiled_programs()
    for batch in batches:
        trainer.step(batch)
    first = compiled_programs() - before
    assert first["jit(_train_step)"] == 3, first
    again = compiled_programs()
    for batch in batches:
        trainer.read(trainer.step(batch))
    assert compiled_programs() - again == Counter()


def test_a_trainer_built_without_a_cache_leaves_jaxs_own_setting(jax_cache_setting, tmp_path):
    """`compile_cache=None` (a library user building a trainer) keeps the persistent cache JAX was
    given (here JAX_COMPILATION_CACHE_DIR, as the suite sets it); a directory and "off" set it.
    Before issue 46 None turned it off: every later compilation in the process went uncached."""
    import jax

    cfg = preset("tiny", **NO_DROPOUT, num_encoder_layers=1, num_decoder_layers=1)
    params = init_params(cfg, seed=0)
    assert jax_cache_setting  # the suite's own (conftest.py)
    for given, expected in [(None, jax_cache_setting), (tmp_path, str((tmp_path / "jax").resolve())),
                            ("off", None), (None, None)]:
        get_trainer("jax")(cfg, params, TrainConfig(), device="cpu", compile_cache=given)
        assert jax.config.jax_compilation_cache_dir == expected, given


def test_a_second_jax_run_compiles_nothing(tmp_path):
    """Two `rosetta train --backend jax` processes with the same --compile-cache: the first compiles
    its programs (step, evaluation, decoding) and keeps them, the second reads every one back."""
    cache = tmp_path / "cache"
    args = ["--backend", "jax", "--task", "copy", "--steps", "1", "--max-tokens", "256", "--buckets", "16",
            "--train-size", "100", "--eval-size", "2", "--bleu-samples", "2", "--eval-every", "0",
            "--set", "num_encoder_layers=1", "--set", "num_decoder_layers=1", "--no-progress",
            "--device", "cpu", "--compile-cache", str(cache)]
    results = []
    for run in ("first", "second"):
        out = tmp_path / run
        subprocess.run([sys.executable, "-m", "rosetta.cli", "train", *args, "--out", str(out)], cwd=ROOT,
                       check=True, capture_output=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        results.append(json.loads((out / "jax" / "result.json").read_text()))
    assert results[0]["compiles"] > 0 and any((cache / "jax").iterdir())
    assert results[1]["compiles"] == 0
    assert results[1]["compile_time_total_s"] < results[0]["compile_time_total_s"]


@pytest.mark.parametrize("given", [None, "-1"])
def test_the_cache_bound_is_rosettas_unless_the_environment_sets_one(given, tmp_path):
    """jax_impl/compilation.configure bounds JAX's persistent cache to rosetta/device.py's
    CACHE_MAX_BYTES; a bound the environment gives (JAX_COMPILATION_CACHE_MAX_SIZE; -1: none, as the
    suite runs every process, so that no bounded writer meets an unbounded one's entries) is kept."""
    from rosetta.device import CACHE_MAX_BYTES

    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_COMPILATION_CACHE_MAX_SIZE", "JAX_COMPILATION_CACHE_DIR")}
    env |= {"JAX_PLATFORMS": "cpu"} | ({} if given is None else {"JAX_COMPILATION_CACHE_MAX_SIZE": given})
    code = ("import sys, jax; from jax_impl.compilation import configure; configure(sys.argv[1]); "
            "print(jax.config.jax_compilation_cache_max_size)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, check=True,
                         capture_output=True, text=True, env=env)
    assert int(out.stdout.split()[-1]) == (CACHE_MAX_BYTES if given is None else int(given))


def test_compile_cache_off_keeps_nothing(tmp_path, monkeypatch):
    """--compile-cache off: no directory is made, and the run's setting says so."""
    from rosetta.harness.run_config import RunConfig as Run

    monkeypatch.setenv("ROSETTA_CACHE", str(tmp_path / "default"))
    assert Run(compile_cache="off").compile_cache_dir() is None
    assert Run().compile_cache_dir() == tmp_path / "default"
    assert Run(compile_cache=str(tmp_path / "mine")).compile_cache_dir() == tmp_path / "mine"


# -- The GPU's attention path, run on the CPU -----------------------------------------------------

@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_jax_attention_as_on_a_gpu_keeps_the_parity_bounds(dtype, monkeypatch):
    """jax_impl/ops.py's attention as a GPU runs it (JAX reporting a 'gpu' backend), here: the logits
    within the contract's bound of the float64 NumPy reference. An H100 found float64 at 6.0e-8
    (bound 1e-12): XLA's dot_product_attention takes its softmax in float32."""
    import jax

    from rosetta.parity import TOLERANCES, parity_report

    cfg = preset("tiny", **NO_DROPOUT)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    jax.clear_caches()  # no program traced on the CPU's path is reused
    try:
        rows = [r for r in parity_report(cfg, init_params(cfg, seed=0), ["jax"]) if r.dtype == dtype]
    finally:
        jax.clear_caches()
    assert len(rows) == 1 and rows[0].finite
    assert rows[0].relative_error <= TOLERANCES[("jax", dtype)], rows[0]


# -- Item 7: the GPU check, on the CPU ------------------------------------------------------------

GPU_CHECK_GROUPS = {  # group -> checks it must hold; one test each, so that two workers share them
    "train": ("train torch.compile bucketed plain", "train jax packed chunked",
              "train torch.compile against eager, 3 steps"),
    "decode": ("decode torch compiled beam 4", "decode torch = jax greedy"),
    "harness": ("harness jax 20 steps",),
}


@pytest.mark.parametrize("group", sorted(GPU_CHECK_GROUPS))
def test_gpu_check_passes_on_the_cpu(group, tmp_path, capsys, monkeypatch):
    """`python -m benchmarks.gpu_check --preset tiny --only GROUP`: every check passes, one line each,
    and the results file holds them. The parity and attention groups run in test_journeys.py, as
    docs/journeys.md's CPU-sized check. The PyTorch graphs are captured as on a GPU (whole, one per
    shape) and lowered by aot_eager: inductor's CPU code is C++, not the GPU's Triton, and where its
    code generation is the subject it is tested once (test_compiled_drift: the training step in
    float64 and float32 with this check's own bound; test_decode_compiled: the beam cache update;
    test_packed_attention: FlexAttention), so the twin does not pay ~90 s to compile it again."""
    from benchmarks import gpu_check
    from torch_impl import compilation

    monkeypatch.setattr(compilation, "BACKEND", "aot_eager")
    code = gpu_check.main(["--preset", "tiny", "--device", "cpu", "--out-dir", str(tmp_path),
                           "--only", group])
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith(("PASS ", "FAIL "))]
    assert code == 0, "\n".join(line for line in lines if line.startswith("FAIL"))
    (path,) = tmp_path.glob("gpu-check_cpu_*.json")
    result = json.loads(path.read_text())
    assert result["passed"] and len(result["checks"]) == len(lines) and result["groups"] == [group]
    names = {c["name"] for c in result["checks"]}
    for expected in GPU_CHECK_GROUPS[group]:
        assert expected in names, expected
