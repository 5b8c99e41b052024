"""Data-parallel training (docs/distributed.md): the framework-free split of a global batch, the
launch environment, and PyTorch's engines (DDP, FSDP2, torchrun) against one process.

Expected values come from one process training on the same global batches (no process group, no
wrapper: an independent code path) and, for the split, from the batch itself. The launched tests
run `torchrun` (gloo on this CPU) as a subprocess; JAX's mesh is in test_distributed_jax.py.
The engines' tests train in float64 (dp_case.py says why; docs/testing.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import parity_tests.dp_case as dp
from parity_tests.dp_case import DTYPE, LOSS_RTOL, STEPS, TORCH_VARIANTS, TRAIN, WEIGHTS_RTOL, case, compare
from rosetta.checkpoint import load_checkpoint
from rosetta.cli import main
from rosetta.distributed import TIMEOUT_VARIABLE, LaunchEnv, launch_env, rank_seed, split_rows
from rosetta.errors import RosettaError
from rosetta.harness.launch import torchrun_command, without_nproc

ROOT = Path(__file__).resolve().parent.parent


# -- The global batch, split --------------------------------------------------------------------

@pytest.mark.parametrize("parts", [1, 2, 3, 4, 12, 13])
def test_split_rows_cuts_the_padded_global_batch_into_equal_blocks(parts):
    cfg, _, batches = case()
    batch = batches[0]
    blocks = split_rows(batch, parts, cfg.pad_id)
    rows = batch.shape[0]
    assert len(blocks) == parts and len({b.shape for b in blocks}) == 1
    assert blocks[0].shape[0] == -(-rows // parts)  # ceil: the fewest pad rows that make it even
    for field in ("src", "tgt_in", "labels", "indices"):
        joined = np.concatenate([getattr(b, field) for b in blocks])
        np.testing.assert_array_equal(joined[:rows], getattr(batch, field))  # consecutive rows, in order
        fill = -1 if field == "indices" else cfg.pad_id
        assert (joined[rows:] == fill).all()  # and only padding after them
    # Every real token lands in exactly one block; the counts are the blocks' own.
    assert sum(b.num_tgt_tokens for b in blocks) == batch.num_tgt_tokens
    assert sum(b.num_src_tokens for b in blocks) == batch.num_src_tokens
    assert all(b.num_tgt_tokens == int((b.labels != cfg.pad_id).sum()) for b in blocks)


def test_split_rows_refuses_a_bad_count():
    cfg, _, batches = case()
    for parts in (0, -1, 1.5, True):
        with pytest.raises(RosettaError, match="whole number"):
            split_rows(batches[0], parts, cfg.pad_id)


def test_launch_env_reads_torchruns_variables_and_refuses_inconsistent_ones():
    assert launch_env({}) == LaunchEnv()
    env = launch_env({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                      "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234", "ROSETTA_DIST_TIMEOUT": "30"})
    assert env == LaunchEnv(4, 3, 1, 2, "10.0.0.1", 1234, 30.0) and env.distributed and not env.is_main
    for bad, name in [({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2"), ({"WORLD_SIZE": "x"}, "WORLD_SIZE"),
                      ({"LOCAL_RANK": "1"}, "LOCAL_RANK"), ({"MASTER_PORT": "65535"}, "MASTER_PORT"),
                      ({"ROSETTA_DIST_TIMEOUT": "nan"}, "ROSETTA_DIST_TIMEOUT"),
                      ({"ROSETTA_DIST_TIMEOUT": "-1"}, "ROSETTA_DIST_TIMEOUT")]:
        with pytest.raises(RosettaError, match=name):
            launch_env(bad)


def test_rank_seeds_keep_process_zero_and_differ_per_rank():
    assert rank_seed(7, 0) == 7
    assert len({rank_seed(7, r) for r in range(64)}) == 64
    assert rank_seed(7, 1) != rank_seed(8, 1)


def test_nproc_is_stripped_from_the_relaunched_command():
    argv = ["train", "--nproc", "2", "--steps", "5", "--nproc=2", "--out", "x"]
    assert without_nproc(argv) == ["train", "--steps", "5", "--out", "x"]
    command = torchrun_command(argv, 2)
    assert command[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m"]


# -- One process: gradient accumulation ----------------------------------------------------------

def _single(accumulate: int = 1):
    from torch_impl.train import Trainer

    cfg, params, batches = case()
    trainer = Trainer(cfg, params, TRAIN, device="cpu", dtype=DTYPE, accumulate=accumulate)
    losses = [trainer.read(trainer.step(b))["loss"] for b in batches]
    return losses, trainer.params()


@pytest.fixture(scope="module")
def single():
    """STEPS single-process updates on the case's global batches: the expected weights and losses."""
    return _single()


def test_accumulating_two_micro_batches_gives_the_update_of_the_whole_batch(single):
    cfg, _, batches = case()
    losses, weights = _single(accumulate=2)
    np.testing.assert_allclose(losses, single[0], rtol=LOSS_RTOL)
    worst, through_outputs = compare(cfg, weights, single[1], batches[0])
    assert worst <= WEIGHTS_RTOL and through_outputs <= WEIGHTS_RTOL


def test_the_bound_sees_a_forgotten_world_size(single):
    """The bounds are not vacuous: gradients halved (a mean over 2 workers taken twice) move the
    weights and the logits by orders of magnitude more than WEIGHTS_RTOL (Adam undoes most of a
    uniform scale; eps keeps the rest, 3.9e-4 and 2.9e-6 here)."""
    from torch_impl.train import Trainer

    cfg, params, batches = case()
    trainer = Trainer(cfg, params, TRAIN, device="cpu", dtype=DTYPE)
    for b in batches:
        trainer.step(dataclasses.replace(b, num_tgt_tokens=2 * b.num_tgt_tokens))
    worst, through_outputs = compare(cfg, trainer.params(), single[1], batches[0])
    assert worst > 1e4 * WEIGHTS_RTOL and through_outputs > 1e4 * WEIGHTS_RTOL


def test_torch_trainer_refuses_what_one_process_cannot_do():
    from torch_impl.train import Trainer

    cfg, params, _ = case()
    with pytest.raises(RosettaError, match="--shard shards the parameters over processes"):
        Trainer(cfg, params, TRAIN, device="cpu", shard=True)
    with pytest.raises(RosettaError, match="one device per process"):
        Trainer(cfg, params, TRAIN, device="cpu", num_devices=2)
    with pytest.raises(RosettaError, match=r"accumulate \(micro-batches per update\) must be"):
        Trainer(cfg, params, TRAIN, device="cpu", accumulate=0)


# -- Two processes under torchrun (gloo) ---------------------------------------------------------

def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Every TORCH_VARIANTS entry trained by two processes (one torchrun launch)."""
    out = tmp_path_factory.mktemp("dp") / "weights.npz"
    command = torchrun_command([], 2)[:-1] + ["parity_tests.dp_case", "torch", str(out)]
    done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(np.load(out))


@pytest.mark.parametrize("variant", [*TORCH_VARIANTS, "fsdp2_resumed"])
def test_two_processes_train_the_weights_of_one(variant, launched, single):
    """DDP and FSDP2, with and without --accumulate 2, on two gloo processes: STEPS updates on the
    global batches give one process's weights (k biases through the outputs: PITFALLS 14).
    fsdp2_resumed: 3 sharded steps, state_dict, a new sharded trainer, 2 more."""
    cfg, _, batches = case()
    weights = {k.split("/", 1)[1]: v for k, v in launched.items() if k.startswith(variant + "/")}
    assert all(v.dtype == np.float64 for v in weights.values())
    worst, through_outputs = compare(cfg, weights, single[1], batches[0])
    assert worst <= WEIGHTS_RTOL, f"{variant}: a tensor differs by {worst:.2e} relative"
    assert through_outputs <= WEIGHTS_RTOL, f"{variant}: logits differ by {through_outputs:.2e} relative"
    if variant in TORCH_VARIANTS:
        assert int(launched[f"{variant}.world_size"]) == 2
        np.testing.assert_allclose(launched[f"{variant}.loss"], single[0], rtol=LOSS_RTOL)


def test_with_dropout_two_torch_processes_draw_other_masks_than_one(launched):
    """What docs/distributed.md says of PyTorch with dropout on: each process draws its block's masks
    from its own generator (process 0 the one-process seed, process 1 another), so two processes do
    not take one process's updates: the first losses already differ by far more than rounding (with
    dropout 0 they agree to LOSS_RTOL, test_two_processes_train_the_weights_of_one). JAX draws the
    same masks on any mesh (test_dropout_streams.py)."""
    from rosetta.config import preset
    from torch_impl.train import Trainer

    cfg, params, batches = case()
    trainer = Trainer(preset("tiny", dropout=dp.DROPOUT), params, TRAIN, device="cpu", dtype=DTYPE)
    one = np.array([trainer.read(trainer.step(b))["loss"] for b in batches])
    two = launched["ddp_dropout.loss"]
    assert np.isfinite(two).all() and np.max(np.abs(two - one) / one) > 1e6 * LOSS_RTOL, (one, two)


# -- The harness under `rosetta train --nproc 2`: a killed rank, and the resume ---------------------

TRAIN_ARGS = ["train", "--backend", "torch", "--steps", str(STEPS), "--set", "dropout=0",
              "--max-tokens", "264", "--buckets", "24", "--eval-every", "0", "--checkpoint-every", "2",
              "--eval-size", "8", "--bleu-samples", "4", "--warmup", "10"]


def _rosetta_process(args: list[str], **env: str) -> subprocess.CompletedProcess:
    """`python -m rosetta.cli ARGS` in a new process: for a run whose XLA_FLAGS JAX must read as it starts."""
    return subprocess.run([sys.executable, "-m", "rosetta.cli", *args], cwd=ROOT, env=_env() | env,
                          capture_output=True, text=True, timeout=300)


def _rosetta(args: list[str], **env: str) -> int:
    """`rosetta ARGS` through the CLI's main in this process, with _env()'s variables and `env` for this
    call only (its output goes to the test's capture: capfd). A second interpreter would only import
    torch again: `--nproc 2`'s torchrun and its two workers, what these tests are about, are still
    processes of their own, launched by main as from the command line."""
    with pytest.MonkeyPatch.context() as m:
        for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", TIMEOUT_VARIABLE):  # cmd_train sets the timeout's
            m.delenv(name, raising=False)
        for name, value in ({"PYTHONPATH": _env()["PYTHONPATH"]} | env).items():
            m.setenv(name, value)
        m.chdir(ROOT)
        return main(args)


def _log(out: Path, backend: str) -> list[dict]:
    return [json.loads(line) for line in (out / backend / "log.jsonl").read_text().splitlines()]


def _weights(out: Path, backend: str, step: int = STEPS) -> dict[str, np.ndarray]:
    return load_checkpoint(out / backend / "checkpoints" / f"step-{step:08d}" / "model.safetensors").params


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory) -> Path:
    """`rosetta train --nproc 2` (PyTorch, DDP on gloo), uninterrupted."""
    out = tmp_path_factory.mktemp("nproc2") / "run"
    assert _rosetta([*TRAIN_ARGS, "--out", str(out), "--nproc", "2"]) == 0  # its stderr: the setup's capture
    return out


def test_two_process_run_records_its_workers(two_process_run):
    train = [r for r in _log(two_process_run, "torch") if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert {(r["world_size"], r["worker_rows"]) for r in train} == {(2, 6)}  # 11 rows padded to 12, halved
    run = json.loads((two_process_run / "torch" / "run.json").read_text())
    assert (run["world_size"], run["processes"], run["accumulate"], run["shard"]) == (2, 2, 1, False)
    summary = json.loads((two_process_run / "summary.json").read_text())["backends"]["torch"]
    assert summary["world_size"] == 2 and summary["median_tgt_tokens_per_s_per_worker"] > 0


def test_a_two_process_trace_shows_no_difference_from_one_process(tmp_path, capfd):
    """The training diff's clean pair (docs/training_diff.md): `rosetta train --trace` in float64
    under DDP on 2 gloo processes, and in one process (this one): `rosetta diff` finds no difference
    at any step, whole (gradients, updated weights) or by norms."""
    for n in (1, 2):
        code = _rosetta([*TRAIN_ARGS, "--out", str(tmp_path / f"p{n}"), "--nproc", str(n),
                         "--dtype", "float64", "--trace", "3"])
        assert code == 0, capfd.readouterr().err[-3000:]
    capfd.readouterr()
    code = _rosetta(["diff", str(tmp_path / "p2" / "torch"), str(tmp_path / "p1" / "torch")])
    out, err = capfd.readouterr()
    assert code == 0, out + err[-3000:]
    assert f"no difference at any of {STEPS} steps (tolerance 1e-09)" in out


def test_two_device_torch_and_jax_runs_agree_step_by_step(two_process_run, tmp_path):
    """The cross-framework check of test_harness.py, at 2 workers each (float32, as `rosetta train`
    runs): 2 gloo processes against 2 JAX host devices see the same batches, split alike, and step 1
    (same weights) agrees to forward rounding; the later steps' identity is the float64 tests'."""
    pytest.importorskip("jax")
    jax_out = tmp_path / "jax"
    done = _rosetta_process([*TRAIN_ARGS, "--out", str(jax_out), "--backend", "jax"],
                            XLA_FLAGS="--xla_force_host_platform_device_count=2")
    assert done.returncode == 0, done.stderr[-3000:]
    torch_train = [r for r in _log(two_process_run, "torch") if r["kind"] == "train"]
    jax_train = [r for r in _log(jax_out, "jax") if r["kind"] == "train"]
    assert {r["world_size"] for r in jax_train} == {2}
    for a, b in zip(torch_train, jax_train, strict=True):
        assert [a[k] for k in ("step", "tgt_tokens", "worker_rows")] == [b[k] for k in ("step", "tgt_tokens",
                                                                                       "worker_rows")]
    assert jax_train[0]["loss"] == pytest.approx(torch_train[0]["loss"], rel=dp.FIRST_STEP_RTOL)


def test_a_killed_rank_ends_the_launch_with_its_name_and_the_run_resumes(two_process_run, tmp_path, capfd):
    out = tmp_path / "run"
    # Process 1 dies (SIGKILL, as the OOM killer would) after step 3: torchrun stops process 0. The
    # fault is the test's own (parity_tests/fault_injection/sitecustomize.py, first on PYTHONPATH:
    # imported by torchrun and its workers, which this process starts after setting it).
    injected = os.pathsep.join([str(ROOT / "parity_tests" / "fault_injection"), _env()["PYTHONPATH"]])
    capfd.readouterr()
    code = _rosetta([*TRAIN_ARGS, "--out", str(out), "--nproc", "2"], ROSETTA_TEST_KILL_AT="1:3",
                    PYTHONPATH=injected)
    stderr = capfd.readouterr().err  # torchrun's report (its file descriptor 2), then main's line
    assert code == 2
    assert "rank      : 1" in stderr and "SIGKILL" in stderr  # torchrun's report names it
    assert "rosetta: error: the launch of 2 processes failed" in stderr.splitlines()[-1]
    assert (out / "torch" / "checkpoints" / "latest").read_text().strip() == "step-00000002"
    code = _rosetta([*TRAIN_ARGS, "--out", str(out), "--nproc", "2", "--resume"])
    assert code == 0, capfd.readouterr().err[-3000:]
    assert [r["step"] for r in _log(out, "torch") if r["kind"] == "train"] == list(range(1, STEPS + 1))
    # The resumed run ends where the uninterrupted one ends, bit for bit: same processes, same order.
    got, want = _weights(out, "torch"), _weights(two_process_run, "torch")
    assert all(np.array_equal(got[k], want[k]) for k in want)


def test_nproc_under_a_launch_of_another_size_is_refused(tmp_path, capfd):
    capfd.readouterr()
    code = _rosetta([*TRAIN_ARGS, "--out", str(tmp_path / "x"), "--nproc", "3"], WORLD_SIZE="2", RANK="1",
                    LOCAL_WORLD_SIZE="2", LOCAL_RANK="1")
    assert code == 2
    last = capfd.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("rosetta: error [process 1 of 2]: --nproc 3")


@pytest.mark.parametrize("flag, value", [("--nproc", "0"), ("--accumulate", "0"), ("--accumulate", "-2"),
                                         ("--devices", "0"), ("--dist-timeout", "-1"),
                                         ("--dist-timeout", "nan"), ("--batching", "zigzag"),
                                         ("--loss", "fused"), ("--baseline", "/nonexistent")])
def test_bad_many_device_flags_are_refused_by_name_before_anything_runs(flag, value, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), flag, value]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and flag in error[0]  # one line, naming the flag
    assert not out.exists()  # refused before the output directory is touched
