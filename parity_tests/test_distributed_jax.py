"""Data-parallel and sharded training in the JAX trainer (jax_impl/train.py, the design in
rosetta/distributed.py): on 2 devices (one process with 2 host devices, or 2 processes joined
by jax.distributed over gloo), replicated or sharded ZeRO-3 style, with or without gradient
accumulation, 5 updates on the same global batches give the weights and losses of 5 updates on
one device. The expected values come from `jt.train_step` on one device with no mesh at all.
Every run is float64 (64-bit JAX in the workers): the question is "the same algorithm?", which
float32 rounding, amplified by Adam, answers only to a CPU-dependent bound (parity_tests/dp_case.py).

This pytest process has JAX with one CPU device; the 2-device runs are subprocesses (WORKER).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import jax_impl.train as jt
from numpy_ref.backend import Model as NumpyModel
from parity_tests.conftest import SUITE_COMPILE_FLAGS
from rosetta.config import preset
from rosetta.errors import RosettaError
from rosetta.harness.batching import BatchIterator
from rosetta.params import init_params
from rosetta.training import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
STEPS = 5
# max |a - b| / max |b|, every tensor and every loss, float64: the layouts differ only in the order of
# their sums (<= n u relative per gradient entry, u = 2^-53), which Adam passes on with gain 1 where
# |g| >> eps; the k biases (zero in exact arithmetic) go through the logits. 1e-10 leaves orders of
# magnitude for any CPU (test_distributed.py measures the same kind of case at 1.4e-14).
TOLERANCE = 1e-10

# One configuration per run, all in one 2-device subprocess (one JAX start, one compile each).
RUNS = {
    "replicated": {},
    "sharded": {"shard": True},
    "accumulate_2": {"accumulate": 2},
    "accumulate_2_one_device": {"accumulate": 2, "num_devices": 1},
    # 3 updates sharded on 2 devices, then its state_dict resumed on 1 device (2 micro-batches)
    # for the last 2: both steps are compiled already (the persistent compilation cache).
    "resumed_from_sharded": {"shard": True, "resume_at": 3},
}

# Runs the trainer on the batches of data.npz as the JSON argument says; writes out.npz.
WORKER = '''
import json, sys, time
import numpy as np
import jax
from rosetta.config import ModelConfig
from rosetta.training import Batch, TrainConfig
import jax_impl.train as jt

spec = json.loads(sys.argv[1])
data = np.load(spec["data"])
cfg, tc = ModelConfig.from_dict(spec["cfg"]), TrainConfig.from_dict(spec["train"])
params = {k[6:]: data[k] for k in data.files if k.startswith("param.")}
batches = [Batch(*(data[f"{i}.{f}"] for f in ("src", "tgt_in", "labels", "indices")),
                 int(data[f"{i}.nsrc"]), int(data[f"{i}.ntgt"])) for i in range(spec["steps"])]
out = {}
if spec.get("reference"):  # the expected values: jt.train_step on one device, no mesh at all
    from flax import nnx
    from jax_impl.backend import parity_mode
    from jax_impl.convert import build_model, to_params
    model = build_model(cfg, params, jax.numpy.float64)
    optimizer, rngs = jt.make_optimizer(model, tc), nnx.Rngs(dropout=tc.seed)
    with parity_mode():
        out["reference.loss"] = np.asarray(
            [float(jt.train_step(model, optimizer, rngs, b.src, b.tgt_in, b.labels, tc)[0]) for b in batches])
    out.update({f"reference.param.{k}": v for k, v in to_params(model, np.float64).items()})
for name, kwargs in spec["runs"].items():
    start = time.perf_counter()
    resume_at = kwargs.pop("resume_at", len(batches))
    trainer = jt.Trainer(cfg, params, tc, device="cpu", dtype="float64", **kwargs)
    logs = [trainer.read(trainer.step(b)) for b in batches[:resume_at]]
    if resume_at < len(batches):  # the rest on one device in 2 micro-batches, from the state saved here
        state, weights = trainer.state_dict(), trainer.params()
        trainer = jt.Trainer(cfg, weights, tc, device="cpu", dtype="float64", num_devices=1, accumulate=2)
        trainer.load_state_dict(state)
        logs += [trainer.read(trainer.step(b)) for b in batches[resume_at:]]
    for key in ("loss", "world_size", "worker_rows", "step"):
        out[f"{name}.{key}"] = np.asarray([log[key] for log in logs])
    for key, value in trainer.params().items():
        out[f"{name}.param.{key}"] = value
    kernel = trainer.model.encoder.layers[0].ffn.linear1.kernel.get_value()
    out[f"{name}.kernel_spec"] = np.asarray(repr(tuple(kernel.sharding.spec)))
    print(f"{name}: {time.perf_counter() - start:.1f} s", flush=True)
out["devices"] = np.asarray(jax.device_count())  # after the first trainer: it starts jax.distributed
np.savez(spec["out"], **out)  # every process: each must hold the whole weights
'''


def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / max(np.max(np.abs(b)), 1e-30))


# Across processes: replicated, and sharded with 2 micro-batches (all of it at once: each
# configuration is one more compile in each process).
TWO_PROCESS_RUNS = {"replicated": {}, "sharded_accumulate_2": {"shard": True, "accumulate": 2}}


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """A tiny model without dropout, 5 batches of 9 rows (odd: 2 devices × 2 micro-batches pad
    them to 12 with all-pad rows); every worker started at once (they run side by side), and the
    expected weights and losses from the one-device worker: `jt.train_step`, no mesh at all.
    The workers' XLA skips LLVM's optimisations: compiling is most of their time."""
    cfg = preset("tiny", dropout=0.0, src_vocab_size=24, tgt_vocab_size=24, num_encoder_layers=1,
                 num_decoder_layers=1)
    tc = TrainConfig(warmup_steps=10, clip_norm=1.0)  # clipping is active: gradient norms reach 3
    rng = np.random.default_rng(0)
    pairs = [(list(rng.integers(3, 24, rng.integers(2, 7))), list(rng.integers(3, 24, rng.integers(2, 7))))
             for _ in range(60)]
    batches = iter(BatchIterator(pairs, max_tokens=72, max_len=8, buckets=[8], seed=0))
    batches = [next(batches) for _ in range(STEPS)]
    assert all(b.shape[0] % 2 == 1 for b in batches)
    params = init_params(cfg, seed=0)

    directory = tmp_path_factory.mktemp("distributed_jax")
    data = {f"param.{k}": v for k, v in params.items()}
    for i, b in enumerate(batches):
        data.update({f"{i}.src": b.src, f"{i}.tgt_in": b.tgt_in, f"{i}.labels": b.labels,
                     f"{i}.indices": b.indices, f"{i}.nsrc": b.num_src_tokens, f"{i}.ntgt": b.num_tgt_tokens})
    np.savez(directory / "data.npz", **data)
    (directory / "worker.py").write_text(WORKER)
    spec = {"data": str(directory / "data.npz"), "cfg": cfg.to_dict(), "train": tc.to_dict(), "steps": STEPS}

    def start(runs: dict, out: str, reference: bool = False, **env: str) -> subprocess.Popen:
        command = [sys.executable, str(directory / "worker.py"),
                   json.dumps({**spec, "runs": runs, "out": str(directory / out), "reference": reference})]
        clean = {k: v for k, v in os.environ.items()
                 if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "XLA_FLAGS")}
        with open(directory / f"{out}.log", "w") as log:  # a file: a full pipe would stall the worker
            proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                    env={**clean, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
                                         "JAX_ENABLE_X64": "1", **env})
        proc.log = directory / f"{out}.log"
        return proc

    port, fast = free_port_pair(), SUITE_COMPILE_FLAGS
    procs = {
        "one_device": [start({"one_device": {}}, "one_device.npz", reference=True, XLA_FLAGS=fast)],
        "two_devices": [start(RUNS, "two_devices.npz", JAX_COMPILATION_CACHE_DIR=str(directory / "cache"),
                              XLA_FLAGS=f"{fast} --xla_force_host_platform_device_count=2")],
        # torchrun's environment: 2 processes with one CPU device each.
        "two_processes": [start(TWO_PROCESS_RUNS, f"rank{rank}.npz", XLA_FLAGS=fast, WORLD_SIZE="2",
                                RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                                MASTER_PORT=str(port), ROSETTA_DIST_TIMEOUT="120") for rank in range(2)],
    }
    case = {"cfg": cfg, "tc": tc, "batches": batches, "params": params, "dir": directory, "procs": procs}
    try:
        finish(case, "one_device")
        one = dict(np.load(directory / "one_device.npz"))
        case.update(one_device=one, losses=one["reference.loss"],
                    expected={k[16:]: v for k, v in one.items() if k.startswith("reference.param.")})
        yield case
    finally:
        for proc in (p for group in procs.values() for p in group):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def finish(case: dict, group: str) -> None:
    """Wait for the workers of `group`; a failure shows their output."""
    for proc in case["procs"][group]:
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert all(p.returncode == 0 for p in case["procs"][group]), "\n".join(
        p.log.read_text()[-4000:] for p in case["procs"][group])


def assert_same_training(case: dict, out: dict[str, np.ndarray], name: str) -> None:
    """Every weight and loss of run `name` equals the single-device run's; the attention key
    biases (zero gradient: PITFALLS 14) through the logits they produce instead."""
    np.testing.assert_array_equal(out[f"{name}.step"], np.arange(1, STEPS + 1))
    assert relative(out[f"{name}.loss"], case["losses"]) <= TOLERANCE, name
    got = {k[len(name) + 7:]: v for k, v in out.items() if k.startswith(f"{name}.param.")}
    assert list(got) == list(case["expected"])
    assert all(v.dtype == np.float64 for v in [*got.values(), *case["expected"].values()])  # float64 runs
    for key, value in case["expected"].items():
        if key.endswith(".k.bias"):
            continue
        assert relative(got[key], value) <= TOLERANCE, (name, key, relative(got[key], value))
    batch = case["batches"][0]
    ours = NumpyModel(case["cfg"], got).logits(batch.src, batch.tgt_in)
    reference = NumpyModel(case["cfg"], case["expected"]).logits(batch.src, batch.tgt_in)
    assert relative(ours, reference) <= TOLERANCE, name


@pytest.fixture(scope="module")
def two_devices(case: dict) -> dict[str, np.ndarray]:
    """Every RUNS configuration, in one process that has 2 host devices."""
    finish(case, "two_devices")
    return dict(np.load(case["dir"] / "two_devices.npz"))


def free_port_pair() -> int:
    """A port p with p + 1 also free: torch's MASTER_PORT and JAX's coordinator on p + 1."""
    for _ in range(20):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free pair of ports")


def test_single_device_trainer_is_the_plain_step_bit_for_bit(case: dict) -> None:
    """One device, no accumulation, no sharding: the trainer's mesh and global-count loss change
    nothing, to the bit (the same process compiled both)."""
    out = case["one_device"]
    assert int(out["devices"]) == 1
    np.testing.assert_array_equal(out["one_device.loss"], case["losses"])
    assert out["one_device.world_size"].tolist() == [1] * STEPS
    assert out["one_device.worker_rows"].tolist() == [b.shape[0] for b in case["batches"]]
    for key, value in case["expected"].items():
        np.testing.assert_array_equal(out[f"one_device.param.{key}"], value, err_msg=key)


@pytest.mark.parametrize("name", list(RUNS))
def test_two_devices_train_as_one(case: dict, two_devices: dict, name: str) -> None:
    assert int(two_devices["devices"]) == 2
    assert_same_training(case, two_devices, name)
    world = 1 if name == "accumulate_2_one_device" else 2
    accumulate = 2 if "accumulate_2" in name else 1
    assert two_devices[f"{name}.world_size"].tolist()[:3] == [world] * 3
    # 9 rows padded to a multiple of world × accumulate, one block per device and micro-batch.
    assert set(two_devices[f"{name}.worker_rows"].tolist()[:3]) == {-(-9 // (world * accumulate))}


def test_sharded_weights_are_split_over_the_mesh(two_devices: dict) -> None:
    """ZeRO-3: the [32, 64] kernel is split along its first axis; replicated runs keep it whole."""
    assert str(two_devices["sharded.kernel_spec"]) == "('data',)"
    assert str(two_devices["replicated.kernel_spec"]) == "()"


def test_two_processes_train_as_one(case: dict) -> None:
    """Under torchrun's environment, 2 processes with one CPU device each join through
    jax.distributed (gloo collectives): replicated, and sharded across the processes with 2
    micro-batches, both end with the single-device weights, whole on each process."""
    finish(case, "two_processes")
    for rank in range(2):
        out = dict(np.load(case["dir"] / f"rank{rank}.npz"))
        assert int(out["devices"]) == 2
        for name in TWO_PROCESS_RUNS:
            assert_same_training(case, out, name)
            assert out[f"{name}.world_size"].tolist() == [2] * STEPS
        assert out["sharded_accumulate_2.worker_rows"].tolist() == [3] * STEPS  # 9 rows -> 12 = 2 × 2 × 3
        assert str(out["sharded_accumulate_2.kernel_spec"]) == "('data',)"


@pytest.mark.parametrize("kwargs, message", [
    ({"accumulate": 0}, r"accumulate .* integer >= 1, not 0"),
    ({"accumulate": 1.5}, r"accumulate .* not 1\.5"),
    ({"num_devices": 0}, r"num_devices must be an integer >= 1, not 0"),
    ({"num_devices": 2}, r"num_devices=2: JAX sees 1 cpu device here; for more host devices set "
                         r"XLA_FLAGS=--xla_force_host_platform_device_count=N"),
])
def test_bad_arguments_are_refused_by_name(case: dict, kwargs: dict, message: str) -> None:
    with pytest.raises(RosettaError, match=message):
        jt.Trainer(case["cfg"], case["params"], case["tc"], device="cpu", **kwargs)


def test_loss_over_a_global_count() -> None:
    """`num_tokens` replaces the denominator; the count returned stays the local one."""
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 5)), jnp.float32)
    labels = jnp.asarray([[1, 2, 0], [3, 0, 0]])
    mean, count = jt.loss_fn(logits, labels, 0, 0.1)
    total, count_again = jt.loss_fn(logits, labels, 0, 0.1, num_tokens=6)
    assert int(count) == int(count_again) == 3
    assert float(total) == pytest.approx(float(mean) * 3 / 6, rel=1e-6)
