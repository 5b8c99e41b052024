"""The shared training harness (rosetta/harness/loop.py, the `Trainer` adapters, `rosetta train` and
`rosetta translate`): PyTorch and JAX trained by the same loop agree step for step; a resumed
run is bit-identical to a straight one; a SIGKILLed run resumes; a short Multi30k run learns and
translates in all three backends; the log holds every metric; bad input gets one clear line.

Expected values come from outside the code under test: the other framework, the paper's
learning-rate formula written out here, and a FLOPs count made by listing the model's matmuls.
Everything runs the `tiny` preset on tiny budgets (2 CPU cores)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from numpy_ref.model import forward as reference_forward  # noqa: E402
from parity_tests.dp_case import FIRST_STEP_RTOL, LOSS_RTOL, WEIGHTS_RTOL, compare, train_float64  # noqa: E402
from rosetta import RosettaError, init_params, load_checkpoint, preset  # noqa: E402
from rosetta.backends import get_trainer  # noqa: E402
from rosetta.cli import main  # noqa: E402
from rosetta.harness.batching import BatchIterator  # noqa: E402
from rosetta.harness.data import default_data_dir, synthetic_pairs  # noqa: E402
from rosetta.harness.loop import RunConfig, train  # noqa: E402
from rosetta.harness.metrics import batch_lengths, real_training_flops  # noqa: E402
from rosetta.harness.report import read_log  # noqa: E402
from rosetta.harness.run_dir import latest_checkpoint, list_checkpoints  # noqa: E402
from rosetta.harness.trainer_state import load_trainer_state  # noqa: E402
from rosetta.training import TrainConfig  # noqa: E402

pytestmark = pytest.mark.trainable

NO_DROPOUT = {"dropout": 0.0, "attention_dropout": 0.0}
# One bucket: one batch shape, so each framework compiles its step once (seconds on 2 cores).
# The CPU even where a GPU exists: parity mode is on there by default, never on a GPU.
COPY = dict(task="copy", max_tokens=512, buckets=(24,), train_size=2000, eval_size=32, bleu_samples=16,
            warmup=10, lr_factor=0.5, progress=False, device="cpu")
TRAIN_KEYS = {
    "kind", "backend", "step", "epoch", "loss", "lr", "src_tokens", "tgt_tokens", "src_tokens_padded",
    "tgt_tokens_padded", "step_time_s", "src_tokens_per_s", "tgt_tokens_per_s", "src_tokens_per_s_padded",
    "tgt_tokens_per_s_padded", "flops", "tflops_per_s", "mfu", "flops_padded", "mfu_padded",
    "peak_memory_bytes", "batch_shape", "first_of_shape", "device", "elapsed_s", "grad_norm", "stretch_steps",
    "compile_s", "host_step_s", "host_prepare_s", "host_work_s",
    "world_size", "worker_rows", "accumulate", "tgt_tokens_per_s_per_worker", "scaling_efficiency",
}
EVAL_KEYS = {"kind", "backend", "step", "val_loss", "bleu", "exact_match", "bleu_sentences", "sample",
             "eval_time_s", "elapsed_s", "tgt_tokens_total"}


# The two frameworks round float32 differently (~1e-7 relative in one step's loss). Adam (ε = 1e-9)
# normalises each gradient, so rounding noise in near-zero gradients becomes full-size updates and
# two float32 runs part at a rate that depends on the CPU's rounding (AMD EPYC, 2026-11-23: <= 4e-7
# through step 9, 2.3e-4 at step 28): no bound on later float32 losses holds on every CPU without
# also passing real bugs. So the float32 harness runs are compared where the computation fixes the
# bound: step 1, from the same weights, is one forward pass's rounding (FIRST_STEP_RTOL, derived in
# dp_case.py); every step has the same batches and schedule. That the two trainers take
# the same steps is test_torch_and_jax_trainers_are_one_algorithm, in float64, over as many steps.


def paper_lr(step: int, d_model: int, warmup: int, factor: float) -> float:
    """Eq. 3 by branch: linear warmup, then inverse square root decay."""
    if step <= warmup:
        return factor * step / (math.sqrt(d_model) * warmup**1.5)
    return factor / math.sqrt(d_model * step)


def train_records(run_dir: Path) -> list[dict]:
    return [r for r in read_log(run_dir / "log.jsonl") if r["kind"] == "train"]


def eval_records(run_dir: Path) -> list[dict]:
    return [r for r in read_log(run_dir / "log.jsonl") if r["kind"] == "eval"]


def checkpoint_params(ckpt_dir: Path) -> dict[str, np.ndarray]:
    return load_checkpoint(ckpt_dir / "model.safetensors").params


# -- Training parity: one loop, two frameworks -------------------------------------------------

@pytest.fixture(scope="module")
def parity_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("parity")
    train(RunConfig(backends=("torch", "jax"), out=str(out), overrides=NO_DROPOUT, steps=30, eval_every=15,
                    checkpoint_every=10, peak_tflops=1.0, **COPY))
    return out


def test_torch_and_jax_loss_curves_agree_at_every_step(parity_run):
    torch_log, jax_log = train_records(parity_run / "torch"), train_records(parity_run / "jax")
    assert [r["step"] for r in torch_log] == [r["step"] for r in jax_log] == list(range(1, 31))
    assert jax_log[0]["loss"] == pytest.approx(torch_log[0]["loss"], rel=FIRST_STEP_RTOL)
    for a, b in zip(torch_log, jax_log, strict=True):
        assert (a["tgt_tokens"], a["src_tokens"]) == (b["tgt_tokens"], b["src_tokens"])  # same batches
        assert a["lr"] == pytest.approx(paper_lr(a["step"], 32, 10, 0.5), rel=1e-12)
        assert b["lr"] == pytest.approx(paper_lr(b["step"], 32, 10, 0.5), rel=1e-6)  # float32 schedule
    for log in (torch_log, jax_log):
        assert log[-1]["loss"] < log[0]["loss"] - 0.3  # each learned something
    assert [r["step"] for r in eval_records(parity_run / "torch")] == [15, 30]
    assert [r["step"] for r in eval_records(parity_run / "jax")] == [15, 30]


def test_torch_and_jax_trainers_are_one_algorithm():
    """The harness's two trainers on the harness's batches (the copy task, bucketed), 30 updates
    through warm-up and past it, in float64: the same losses and weights (bounds: dp_case.py)."""
    cfg = preset("tiny", **NO_DROPOUT)
    params = init_params(cfg, seed=0)
    pairs = synthetic_pairs("copy", 400, 64, 1, 16, seed=0)
    batches = list(BatchIterator.from_config(pairs, cfg, max_tokens=512, buckets=[24]).epoch_batches())
    batches = (batches * 3)[:30]
    tc = TrainConfig(warmup_steps=10, lr_factor=0.5)
    runs = {backend: train_float64(backend, cfg, params, tc, batches) for backend in ("torch", "jax")}
    np.testing.assert_allclose(runs["jax"][0], runs["torch"][0], rtol=LOSS_RTOL)
    assert runs["torch"][0][-1] < runs["torch"][0][0] - 0.3  # the weights moved: not trivially equal
    worst, through_outputs = compare(cfg, runs["jax"][1], runs["torch"][1], batches[0])
    assert worst <= WEIGHTS_RTOL and through_outputs <= WEIGHTS_RTOL


def test_parity_run_writes_plots_summary_and_checkpoints(parity_run):
    summary = json.loads((parity_run / "summary.json").read_text())
    assert list(summary["backends"]) == ["torch", "jax"]
    for name, result in summary["backends"].items():
        assert result["steps"] == 30 and result["median_tgt_tokens_per_s"] > 0, name
        assert result["median_mfu"] > 0 and result["peak_memory_bytes"] > 0, name
    table = (parity_run / "summary.md").read_text()
    assert "| median target tokens/s |" in table and "| torch | jax |" in table
    for path in (parity_run / "plot.png", parity_run / "torch" / "plot.png", parity_run / "jax" / "plot.png"):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    steps = [step for step, _ in list_checkpoints(parity_run / "jax" / "checkpoints")]
    assert steps == [10, 20, 30]  # keep=3 by default
    assert latest_checkpoint(parity_run / "jax" / "checkpoints").name == "step-00000030"


# -- The adapters' interface -------------------------------------------------------------------

def reference_loss(params, cfg, batch, eps: float) -> tuple[float, int]:
    """float64 NumPy: -Σ_v q_v log p_v, q = (1-ε) onehot(y) + ε/V, summed over non-pad labels."""
    logits = reference_forward({k: v.astype(np.float64) for k, v in params.items()}, cfg, batch.src,
                               batch.tgt_in)
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    V = logits.shape[-1]
    q = (1 - eps) * np.eye(V)[batch.labels] + eps / V
    mask = batch.labels != cfg.pad_id
    return float(-(q * logp).sum(-1)[mask].sum()), int(mask.sum())


@pytest.mark.trainable
def test_trainer_adapters_share_one_interface(backend):
    Trainer = get_trainer(backend)
    cfg = preset("tiny", **NO_DROPOUT)
    params = init_params(cfg, seed=0)
    pairs = synthetic_pairs("copy", 200, 64, 1, 16, seed=0)
    batches = list(BatchIterator.from_config(pairs, cfg, max_tokens=512, buckets=[24]).epoch_batches())[:2]
    tc = TrainConfig(warmup_steps=10)
    trainer = Trainer(cfg, params, tc, device="cpu")
    assert trainer.framework == backend and trainer.device_name.startswith("cpu")
    # eval_loss: the token-weighted mean over batches, as the float64 reference computes it.
    totals = [reference_loss(params, cfg, b, tc.label_smoothing) for b in batches]
    expected = sum(t for t, _ in totals) / sum(n for _, n in totals)
    assert trainer.eval_loss(batches) == pytest.approx(expected, rel=1e-5)
    copy = trainer.params()
    copy["shared_embed.embedding"][:] = 0  # params() returns copies: the trainer is unaffected
    assert np.array_equal(trainer.params()["shared_embed.embedding"], params["shared_embed.embedding"])
    dispatched = trainer.step(batches[0])  # loss, lr, grad_norm still on the device
    assert set(dispatched) == {"step", "loss", "lr", "grad_norm", "num_src_tokens", "num_tgt_tokens",
                               "world_size", "worker_rows"}
    metrics = trainer.read(dispatched)
    assert metrics["non_finite"] is None
    assert all(type(metrics[k]) is float for k in ("loss", "lr", "grad_norm"))
    assert (metrics["world_size"], metrics["worker_rows"]) == (1, batches[0].shape[0])
    assert metrics["step"] == trainer.step_count == 1
    assert metrics["num_tgt_tokens"] == batches[0].num_tgt_tokens
    assert metrics["loss"] == pytest.approx(totals[0][0] / totals[0][1], rel=1e-5)
    assert trainer.peak_memory_bytes() > 0
    # bfloat16 compute (torch autocast, JAX model dtype): float32 weights, a loss near float32's.
    low = Trainer(cfg, params, tc, device="cpu", dtype="bfloat16")
    assert low.read(low.step(batches[0]))["loss"] == pytest.approx(metrics["loss"], rel=2e-2)
    assert all(v.dtype == np.float32 for v in low.params().values())
    with pytest.raises(RosettaError, match="float16"):
        Trainer(cfg, params, tc, device="cpu", dtype="float16")


# -- The log ------------------------------------------------------------------------------------

def hand_count_forward(d: int, f: int, V: int, heads: int, enc: int, dec: int, S: int, T: int) -> int:
    """Forward FLOPs (2 per multiply-add) of one sentence, every matmul of Figure 1 listed as
    (rows, inner, cols): an independent count of what rosetta/harness/metrics.py documents."""
    dh = d // heads
    matmuls = []
    for _ in range(enc):
        matmuls += [(S, d, d)] * 4  # q, k, v, o
        matmuls += [(S, dh, S), (S, S, dh)] * heads  # Q Kᵀ and weights · V per head
        matmuls += [(S, d, f), (S, f, d)]
    for _ in range(dec):
        matmuls += [(T, d, d)] * 4 + [(T, dh, T), (T, T, dh)] * heads  # masked self-attention
        matmuls += [(T, d, d), (S, d, d), (S, d, d), (T, d, d)]  # cross q; k, v of memory; o
        matmuls += [(T, dh, S), (T, S, dh)] * heads
        matmuls += [(T, d, f), (T, f, d)]
    matmuls.append((T, d, V))  # output projection
    return sum(2 * m * k * n for m, k, n in matmuls)


def test_flops_formula_matches_a_hand_count():
    cfg = preset("tiny", num_encoder_layers=3, num_decoder_layers=1, d_ff=48, tgt_vocab_size=70,
                 src_vocab_size=50, share_embeddings="none")
    src_lengths, tgt_lengths = np.array([5, 2, 0, 9]), np.array([3, 7, 0, 1])  # row 3: all padding
    expected = 3 * sum(hand_count_forward(32, 48, 70, 4, 3, 1, s, t)
                       for s, t in zip(src_lengths, tgt_lengths, strict=True))
    assert real_training_flops(cfg, src_lengths, tgt_lengths) == expected
    # One sentence of 1 + 1 tokens, written out in multiply-adds: d=32, f=48, V=70, 3 + 1 layers;
    # each attention is 4 heads x (1x8 @ 8x1 scores + 1x1 @ 1x8 values).
    attention = 4 * (8 + 8)
    enc = 3 * (4 * 32 * 32 + attention + 2 * 32 * 48)
    dec = 4 * 32 * 32 + attention + 4 * 32 * 32 + attention + 2 * 32 * 48  # self; cross q, k, v, o
    assert real_training_flops(cfg, [1], [1]) == 3 * 2 * (enc + dec + 32 * 70)


def test_log_records_hold_every_metric(parity_run):
    for backend in ("torch", "jax"):
        records = read_log(parity_run / backend / "log.jsonl")
        train_log = [r for r in records if r["kind"] == "train"]
        assert all(set(r) == TRAIN_KEYS for r in train_log), backend
        assert all(set(r) == EVAL_KEYS for r in records if r["kind"] == "eval"), backend
        for r in train_log:
            t = r["step_time_s"]
            assert r["tgt_tokens_per_s"] == pytest.approx(r["tgt_tokens"] / t)
            assert r["src_tokens_per_s_padded"] == pytest.approx(r["src_tokens_padded"] / t)
            assert r["tgt_tokens_padded"] == r["batch_shape"][0] * r["batch_shape"][1]
            assert r["mfu"] == pytest.approx(r["flops"] / t / 1e12)  # --peak-tflops 1
            assert r["tflops_per_s"] == pytest.approx(r["flops"] / t / 1e12)
            assert r["flops"] < r["flops_padded"] and r["peak_memory_bytes"] > 0
        assert [r["first_of_shape"] for r in train_log] == [True] + [False] * 29  # one bucket
    # The first batch, rebuilt from the public data API: its FLOPs by the hand count.
    cfg = preset("tiny", **NO_DROPOUT)
    pairs = synthetic_pairs("copy", COPY["train_size"], 64, 1, 16, seed=0)
    first = next(BatchIterator.from_config(pairs, cfg, max_tokens=512, buckets=[24], seed=0))
    src_lengths, tgt_lengths = batch_lengths(first.src, first.labels, 0)
    expected = 3 * sum(hand_count_forward(32, 64, 64, 4, 2, 2, s, t)
                       for s, t in zip(src_lengths, tgt_lengths, strict=True))
    assert train_records(parity_run / "torch")[0]["flops"] == expected
    assert train_records(parity_run / "torch")[0]["tgt_tokens"] == first.num_tgt_tokens


# -- Exact resume --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory) -> tuple[Path, Path]:
    """20 steps straight, and 10 steps then --resume to 20, dropout on (so the generator state
    matters), both frameworks."""
    straight, split = tmp_path_factory.mktemp("straight"), tmp_path_factory.mktemp("split")
    common = dict(backends=("torch", "jax"), overrides={"dropout": 0.1, "attention_dropout": 0.1},
                  eval_every=0, checkpoint_every=10, **COPY)
    train(RunConfig(out=str(straight), steps=20, **common))
    train(RunConfig(out=str(split), steps=10, **common))
    train(RunConfig(out=str(split), steps=20, resume=True, **common))
    return straight, split


@pytest.mark.trainable
def test_resume_is_bit_identical(resume_runs, parity_run, backend):
    straight, split = (run / backend for run in resume_runs)
    a, b = (checkpoint_params(run / "checkpoints" / "step-00000020") for run in (straight, split))
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), name
    # The optimizer moments and the generator state too.
    name = "checkpoints/step-00000020/trainer_state.safetensors"
    state_a, state_b = (load_trainer_state(run / name, backend) for run in (straight, split))
    assert sorted(state_a) == sorted(state_b)
    assert all(np.array_equal(state_a[k], state_b[k]) for k in state_a)
    losses_a = [r["loss"] for r in train_records(straight)]
    losses_b = [r["loss"] for r in train_records(split)]
    assert [r["step"] for r in train_records(split)] == list(range(1, 21))  # one record per step
    assert losses_a[10:] == losses_b[10:] and losses_a == losses_b
    # Dropout was on (so the generator state mattered): the same first batch from the same weights
    # gives another loss than in the dropout-free parity run.
    assert abs(losses_a[0] - train_records(parity_run / backend)[0]["loss"]) > 1e-3


def test_resume_refuses_other_settings_and_backends(resume_runs, capsys):
    _, split = resume_runs
    base = ["train", "--task", "copy", "--out", str(split), "--resume", "--steps", "30", "--device", "cpu",
            "--max-tokens", "512", "--buckets", "24", "--train-size", "2000", "--warmup", "10",
            "--lr-factor", "0.5", "--set", "dropout=0.1", "--set", "attention_dropout=0.1"]
    assert main([*base[:-4], "--backend", "torch"]) == 2  # dropout settings left out
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rosetta: error: cannot resume")
    assert "overrides=" in err
    assert main([*base, "--backend", "torch", "--max-tokens", "1024"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "max_tokens=512 (now 1024)" in err
    assert main(["train", "--backend", "torch", "--out", str(split.parent / "nothing-here"), "--resume"]) == 2
    assert "holds no run to resume" in capsys.readouterr().err


# -- A killed run --------------------------------------------------------------------------------

def test_sigkilled_run_leaves_a_loadable_checkpoint_and_resumes(tmp_path, capsys):
    out = tmp_path / "killed"
    args = [sys.executable, "-m", "rosetta.cli", "train", "--backend", "torch", "--task", "copy", "--steps",
            "200", "--checkpoint-every", "3", "--eval-every", "0", "--max-tokens", "512", "--buckets", "24",
            "--train-size", "2000", "--eval-size", "16", "--warmup", "10", "--out", str(out), "--no-progress",
            "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    checkpoints = out / "torch" / "checkpoints"
    deadline = time.monotonic() + 120
    while len(list_checkpoints(checkpoints)) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()
    proc.stderr.close()
    killed_at = train_records(out / "torch")[-1]["step"]
    assert killed_at < 200  # killed mid-training
    latest = latest_checkpoint(checkpoints)
    assert latest is not None and not (out / "torch" / "result.json").exists()
    for _, ckpt_dir in list_checkpoints(checkpoints):  # every visible checkpoint is complete
        assert load_checkpoint(ckpt_dir / "model.safetensors").config == preset("tiny")
        assert json.loads((ckpt_dir / "state.json").read_text())["step"] == int(ckpt_dir.name[5:])
    # The resume in this process (the SIGKILL above is the process boundary under test; a second
    # interpreter would only import torch again): args without `python -m rosetta.cli`.
    capsys.readouterr()
    code = main([*args[3:], "--resume"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "resumed from" in err
    steps = [r["step"] for r in train_records(out / "torch")]
    assert steps == list(range(1, 201))  # records after the checkpoint were dropped, then redone
    assert json.loads((out / "torch" / "result.json").read_text())["steps"] == 200
    assert not any(p.name.startswith(".tmp-") for p in checkpoints.iterdir())


# -- Multi30k ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def multi30k_run(tmp_path_factory) -> Path:
    if not (default_data_dir() / "train.de.gz").is_file():
        pytest.fail(f"Multi30k files not found in {default_data_dir()} (the package's bundled copy, "
                    "or $ROSETTA_DATA_DIR): a failure, not a skip", pytrace=False)
    out = tmp_path_factory.mktemp("multi30k")
    # The first 3000 training pairs, a 1000-token joint BPE, pairs up to 32 tokens (one bucket). Half
    # eq. 3's rate: at the full rate (0.028 at step 20 for d_model 64) steps 20-40 were a coin toss,
    # the validation loss rising 5.62 -> 5.69 with 2 torch threads and falling to 5.48 with 1; at half
    # it falls 5.80 -> 5.46 with either (PyTorch, this project's CPU).
    train(RunConfig(backends=("torch", "jax"), out=str(out), task="multi30k", pair="de-en", vocab_size=1000,
                    train_size=3000, eval_size=64, bleu_samples=16, steps=40, warmup=20, max_tokens=1024,
                    buckets=(32,), eval_every=20, checkpoint_every=20, lr_factor=0.5,
                    overrides={"d_model": 64, "d_ff": 128}, progress=False, device="cpu"))
    return out


@pytest.mark.trainable
def test_multi30k_validation_loss_falls(multi30k_run, backend):
    run_dir = multi30k_run / backend
    evals = eval_records(run_dir)
    assert [r["step"] for r in evals] == [20, 40]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert evals[-1]["bleu"] >= 0 and evals[-1]["bleu_sentences"] > 0 and evals[-1]["exact_match"] is None
    assert (run_dir / "plot.png").read_bytes()[:4] == b"\x89PNG"
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    assert ckpt.name == "step-00000040" and (ckpt / "tokenizer.json").is_file()
    assert load_checkpoint(ckpt / "model.safetensors").config.src_vocab_size == 1000


def test_translate_gives_one_line_per_input_line(multi30k_run, backend, monkeypatch, capsys):
    import io

    lines = "Ein Hund läuft im Park.\n\nZwei Männer spielen Fußball.\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    assert main(["translate", "--run", str(multi30k_run / "torch"), "--backend", backend, "--beam", "2",
                 "--margin", "8"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 3 and out.split("\n")[1] == ""  # the empty line stays empty


def test_decoding_defaults_to_the_runs_own_backend(multi30k_run, monkeypatch, capsys):
    """Without --backend, `translate` and `evaluate` on a run decode with the backend that trained it
    (issue 46: the float64 reference, without a cache, took 33 s a sentence), say so in one stderr
    line once done (a refusal before that stays one line), and give what naming that backend gives."""
    import io

    line = "Ein Hund läuft im Park.\n"
    for backend in ("torch", "jax"):
        args = ["translate", "--run", str(multi30k_run / backend), "--beam", "2", "--margin", "8"]
        outputs = []
        for extra in ([], ["--backend", backend]):
            monkeypatch.setattr(sys, "stdin", io.StringIO(line))
            assert main(args + extra) == 0
            outputs.append(capsys.readouterr())
        assert outputs[0].out == outputs[1].out and outputs[0].out.strip()
        checkpoint = multi30k_run / backend / "checkpoints" / "step-00000040" / "model.safetensors"
        assert outputs[0].err == (f"rosetta: decoding {checkpoint} with {backend} (the run's own, trained by "
                                  f"{backend}); --backend numpy decodes with the float64 reference\n")
        assert outputs[1].err == ""


def test_translate_names_its_backend_and_checkpoint_before_decoding(multi30k_run, monkeypatch, capsys):
    """Issue 57: the line naming the backend came only after every sentence was decoded (a slow backend
    gave no sign for minutes). It comes before the first sentence is decoded, once every check has
    passed: a refusal (a beam larger than the vocabulary) is still the only line."""
    import io

    from rosetta.backends import BackendModel

    seen = []
    generate = BackendModel.generate

    def watched(self, *args, **kwargs):
        seen.append(capsys.readouterr().err)  # what stderr held when decoding started
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(BackendModel, "generate", watched)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Ein Hund läuft im Park.\nZwei Männer.\n"))
    assert main(["translate", "--run", str(multi30k_run / "torch"), "--beam", "1", "--margin", "4",
                 "--batch-size", "1"]) == 0
    checkpoint = multi30k_run / "torch" / "checkpoints" / "step-00000040" / "model.safetensors"
    assert seen == [f"rosetta: decoding {checkpoint} with torch (the run's own, trained by torch); --backend "
                    "numpy decodes with the float64 reference\n", ""]
    monkeypatch.setattr(sys, "stdin", io.StringIO("Ein Hund läuft im Park.\n"))
    capsys.readouterr()
    assert main(["translate", "--run", str(multi30k_run / "torch"), "--beam", "100000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rosetta: error: beam_size 100000 is larger than the target vocabulary") and \
        len(err.splitlines()) == 1, err


def test_decoding_default_without_a_run(monkeypatch):
    """A model no run of ours trained: the first installed of torch, jax, numpy (both frameworks cache)."""
    from rosetta import backends

    assert backends.default_decoder(None)[0] == "torch"
    assert backends.default_decoder("peer")[0] == "torch"  # the peer's weights decode with our torch model
    monkeypatch.setattr(backends, "installed", lambda name: name in ("numpy", "jax"))
    assert backends.default_decoder("torch")[0] == "jax"  # the run's own is not installed here
    monkeypatch.setattr(backends, "installed", lambda name: name == "numpy")
    assert backends.default_decoder(None) == ("numpy", "no framework installed: the float64 reference, "
                                                        "without a cache")


# -- Bad input -----------------------------------------------------------------------------------

def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rosetta: error: "), err
    return err


def test_bad_input_gets_one_clear_line(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert main(["train", "--task", "nope", "--out", out]) == 2
    assert "unknown task 'nope'; choose one of copy, reverse, multi30k" in one_line_error(capsys)
    assert main(["train", "--task", "multi30k", "--data-dir", str(tmp_path / "missing"), "--out", out]) == 2
    assert "does not exist" in one_line_error(capsys)
    assert main(["train", "--backend", "numpy", "--out", out]) == 2
    assert "forward-only" in one_line_error(capsys)
    assert main(["train", "--steps", "0", "--out", out]) == 2
    assert "--steps must be an integer >= 1" in one_line_error(capsys)
    assert main(["translate", "--run", str(tmp_path)]) == 2
    assert "not a training run" in one_line_error(capsys)
    # A finished run is never overwritten unless asked.
    quick = ["train", "--backend", "torch", "--task", "reverse", "--epochs", "1", "--train-size", "50",
             "--eval-size", "4", "--max-tokens", "128", "--buckets", "24", "--out", out, "--no-progress",
             "--device", "cpu"]
    assert main(quick) == 0
    capsys.readouterr()
    batches = BatchIterator.from_config(synthetic_pairs("reverse", 50, 64, 1, 16, 0), preset("tiny"),
                                        max_tokens=128, buckets=[24]).batches_per_epoch
    assert train_records(Path(out) / "torch")[-1]["step"] == batches  # --epochs 1
    assert main(quick) == 2
    assert "already holds a finished run; pass --resume" in one_line_error(capsys)
    assert main([*quick, "--resume", "--overwrite"]) == 2
    one_line_error(capsys)
    assert main([*quick, "--overwrite"]) == 0
