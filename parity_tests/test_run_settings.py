"""Issue 39, items 1, 2 and 5: every setting a run will use checked before its first step, nothing
trained lost when an evaluation fails, and device names read one way by every backend.

- Devices: rosetta/device.py is the one parser of --device; every trainer, the torch model and the
  CLI read a name through it, so a bad name gets the same one line from every backend, before OUT
  is touched (`--device meta` was a traceback from torch after training began; `cpu:7` passed
  torch and failed JAX; `''` passed all three).
- dtypes: `train --backend jax --dtype float64 --trace 3` (the documented way to trace a JAX
  reference run) and a PyTorch bfloat16 run on the CPU finish with checkpoints that translate in
  every backend; a Marian directory translates in bfloat16 (oneDNN's packed linear has no
  bfloat16 primitive on CPUs without it).
- A failure after training: the last step's checkpoint is written before its evaluation; an
  evaluation that fails (injected) is one line naming the checkpoint kept, translate reads it,
  and --resume evaluates it and finishes with what an uninterrupted run gives.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from rosetta import load_checkpoint
from rosetta.backends import TRAINING_BACKENDS
from rosetta.cli import main
from rosetta.device import parse_device
from rosetta.errors import RosettaError

pytestmark = pytest.mark.trainable

QUICK = ["--task", "copy", "--max-tokens", "512", "--buckets", "24", "--train-size", "200",
         "--eval-size", "4", "--bleu-samples", "4", "--warmup", "10", "--margin", "4", "--no-progress"]
SOURCES = "5 6 7 8\n9 10 11\n"  # id lines: the copy task has no tokenizer
NAMES = "give cpu, cuda or gpu (the same), cuda:N or gpu:N (GPU N, from 0)"


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("rosetta: error")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def translate(capsys, monkeypatch, *args: str) -> list[str]:
    monkeypatch.setattr("sys.stdin", io.StringIO(SOURCES))
    capsys.readouterr()
    code = main(["translate", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out.splitlines()


# -- Devices named one way ------------------------------------------------------------------------

@pytest.mark.parametrize("name, kind, index, torch_name", [
    ("cpu", "cpu", None, "cpu"), ("cpu:0", "cpu", 0, "cpu:0"), ("cuda", "gpu", None, "cuda"),
    ("gpu", "gpu", None, "cuda"), ("cuda:1", "gpu", 1, "cuda:1"), ("gpu:3", "gpu", 3, "cuda:3"),
])
def test_the_documented_names_parse_to_one_kind(name, kind, index, torch_name):
    """docs/training.md's spellings: torch's cuda and JAX's gpu are one kind of device."""
    device = parse_device(name)
    assert (device.kind, device.index, device.torch, device.platform) == (kind, index, torch_name, kind)


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _refusals() -> list[tuple[str, str | None]]:
    """(--device, the one line every backend gives; None: whatever it is, the same from each)."""
    bad = [(name, f"rosetta: error: --device {shown}: not a device name; {NAMES}") for name, shown in [
        ("", "''"), ("meta", "meta"), ("CPU", "CPU"), (" cpu", "' cpu'"), ("cuda:x", "cuda:x"),
        ("cuda:-1", "cuda:-1"), ("cuda:", "cuda:"), ("tpu", "tpu"), ("mps", "mps"), ("cpu,cuda", "cpu,cuda"),
        ("cuda:1234567", "cuda:1234567")]]
    bad.append(("cpu:7", "rosetta: error: --device cpu:7: 1 CPU device here (cpu:0)"))
    bad.append(("cuda:99", None))  # no machine here has 100 GPUs; the count in the line is the machine's
    if _gpus() == 0:
        bad += [("cuda", "rosetta: error: --device cuda: no GPU here"),
                ("gpu:0", "rosetta: error: --device gpu:0: no GPU here")]
    return bad


@pytest.mark.parametrize("name, expected", _refusals(), ids=[repr(n) for n, _ in _refusals()])
def test_a_bad_device_is_refused_identically_by_every_backend(name, expected, tmp_path, capsys):
    import jax

    if name == "cpu:7" and len(jax.local_devices(backend="cpu")) != 1:
        pytest.skip("JAX sees several host devices here (XLA_FLAGS): its CPU count differs from torch's")
    lines = {}
    for backend in TRAINING_BACKENDS:
        out = tmp_path / backend
        assert main(["train", "--backend", backend, *QUICK, "--steps", "1", "--device", name,
                     "--out", str(out)]) == 2
        lines[backend] = one_line(capsys)
        assert not out.exists()  # refused before OUT is touched
    assert len(set(lines.values())) == 1, lines
    line = lines[TRAINING_BACKENDS[0]]
    assert line == expected if expected is not None else line.startswith(f"rosetta: error: --device {name}: ")


@pytest.mark.parametrize("name", ["meta", "", "cpu:7"])
def test_trainers_and_the_torch_model_built_in_python_refuse_a_bad_device_alike(name):
    """Trainer(device=...) in every training backend and the torch Model: the same one message."""
    from rosetta import init_params, preset
    from rosetta.backends import get_backend, get_trainer
    from rosetta.training import TrainConfig

    cfg = preset("tiny")
    params = init_params(cfg, 0)
    messages = set()
    for backend in TRAINING_BACKENDS:
        with pytest.raises(RosettaError) as e:
            get_trainer(backend)(cfg, params, TrainConfig(), device=name)
        messages.add(str(e.value))
    with pytest.raises(RosettaError) as e:
        get_backend("torch")(cfg, params, "float32", device=name)
    messages.add(str(e.value))
    assert len(messages) == 1 and next(iter(messages)).startswith("--device "), messages


# -- dtypes: every use of the run's dtype works ---------------------------------------------------

@pytest.mark.slow
def test_a_traced_jax_float64_run_finishes_and_translates_as_the_reference(tmp_path, capsys, monkeypatch):
    """The documented JAX reference trace trains, evaluates, checkpoints; its checkpoint decodes in
    float64 in every backend to the NumPy reference's tokens."""
    out = tmp_path / "run"
    assert main(["train", "--backend", "jax", "--dtype", "float64", "--trace", "3", *QUICK, "--steps", "3",
                 "--out", str(out)]) == 0, capsys.readouterr().err
    run = out / "jax"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-00000003"
    assert sorted(p.name for p in (run / "trace").glob("step_*.safetensors")) == [
        f"step_{k:06d}.safetensors" for k in range(4)]
    evals = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evals if r["kind"] == "eval"] == [3]
    reference = translate(capsys, monkeypatch, "--run", str(run), "--backend", "numpy", "--dtype", "float64",
                          "--beam", "1", "--margin", "4")
    assert len(reference) == 2
    for backend in ("torch", "jax"):
        assert translate(capsys, monkeypatch, "--run", str(run), "--backend", backend, "--dtype", "float64",
                         "--beam", "1", "--margin", "4") == reference, backend


def test_a_torch_bfloat16_run_on_the_cpu_finishes_averages_and_translates(tmp_path, capsys, monkeypatch):
    """bfloat16 on a CPU for each use the run makes of it: training, its evaluation, the averaged
    checkpoints' evaluation; then translate in bfloat16 (torch, JAX) and float32 (NumPy)."""
    out = tmp_path / "run"
    assert main(["train", "--backend", "torch", "--dtype", "bfloat16", *QUICK, "--steps", "4",
                 "--checkpoint-every", "2", "--average-last", "2", "--device", "cpu", "--out", str(out)]) == 0
    run = out / "torch"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-00000004"
    assert (run / "averaged.safetensors").is_file() and (run / "result.json").is_file()
    kinds = [json.loads(line)["kind"] for line in (run / "log.jsonl").read_text().splitlines()]
    assert kinds.count("eval") == 1 and kinds.count("eval_average") == 1
    for backend, dtype in (("torch", "bfloat16"), ("jax", "bfloat16"), ("numpy", "float32")):
        assert len(translate(capsys, monkeypatch, "--run", str(run), "--backend", backend, "--dtype", dtype,
                             "--beam", "2", "--margin", "4")) == 2


@pytest.mark.slow
def test_a_marian_directory_and_its_conversion_translate_in_bfloat16(opus_mt_dir, tmp_path, capsys,
                                                                      monkeypatch):
    """`translate --dtype bfloat16` of a Marian directory and of its conversion: a line a sentence."""
    pytest.importorskip("transformers")
    from parity_tests.opus_mt_case import case_sentences

    sentences = case_sentences(3)
    converted = tmp_path / "de-en.safetensors"
    assert main(["convert", str(opus_mt_dir), str(converted)]) == 0, capsys.readouterr().err
    for model, backend in ((opus_mt_dir, "torch"), (converted, "torch"), (converted, "jax")):
        monkeypatch.setattr("sys.stdin", io.StringIO("".join(s + "\n" for s in sentences)))
        capsys.readouterr()
        assert main(["translate", "--checkpoint", str(model), "--backend", backend, "--dtype", "bfloat16",
                     "--beam", "2"]) == 0, capsys.readouterr().err
        assert len(capsys.readouterr().out.splitlines()) == len(sentences)


# -- A failure after training loses no training --------------------------------------------------

def _train(out: Path, *flags: str) -> int:
    return main(["train", "--backend", "torch", *QUICK, "--device", "cpu", "--out", str(out), *flags])


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "torch" / "log.jsonl").read_text().splitlines()]


def _weights(out: Path, step: int) -> dict[str, np.ndarray]:
    return load_checkpoint(out / "torch" / "checkpoints" / f"step-{step:08d}" / "model.safetensors").params


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """4 steps, evaluated at 2 and 4, never stopped: what every interrupted run below must equal."""
    out = tmp_path_factory.mktemp("whole")
    assert _train(out, "--steps", "4", "--eval-every", "2") == 0
    return out


def _failing(monkeypatch, name: str, at_call: int = 1) -> None:
    """rosetta/harness/loop.py's `name` (validation or averaged) raises at its `at_call`-th call, as
    oneDNN's "could not create a primitive descriptor" did: not a RosettaError."""
    from rosetta.harness import loop

    real, calls = getattr(loop, name), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == at_call:
            raise RuntimeError("could not create a primitive descriptor for the matmul primitive\nmore")
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, name, failing)


def _same_run(out: Path, whole: Path) -> None:
    got, want = _log(out), _log(whole)
    assert [(r["kind"], r["step"]) for r in got] == [(r["kind"], r["step"]) for r in want]
    losses = [[r["val_loss"] for r in log if r["kind"] == "eval"] for log in (got, want)]
    assert losses[0] == losses[1]
    assert all(np.array_equal(_weights(out, 4)[k], v) for k, v in _weights(whole, 4).items())


def test_a_failing_final_evaluation_keeps_the_last_step_resumable_and_translatable(
        uninterrupted, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    _failing(monkeypatch, "validation", at_call=2)  # step 2's evaluation passes, step 4's fails
    capsys.readouterr()
    assert _train(out, "--steps", "4", "--eval-every", "2") == 2
    checkpoint = out / "torch" / "checkpoints" / "step-00000004"
    assert one_line(capsys) == (
        "rosetta: error: torch: the evaluation at step 4 failed (RuntimeError: could not create a primitive "
        f"descriptor for the matmul primitive); the run is kept at {checkpoint}: --resume goes on from there")
    assert (out / "torch" / "checkpoints" / "latest").read_text().strip() == checkpoint.name
    assert not (out / "torch" / "result.json").exists()
    assert len(translate(capsys, monkeypatch, "--run", str(out / "torch"), "--backend", "numpy")) == 2
    monkeypatch.undo()
    assert _train(out, "--steps", "4", "--eval-every", "2", "--resume") == 0
    _same_run(out, uninterrupted)  # step 4 evaluated once, on the same weights


def test_a_failing_evaluation_between_checkpoints_saves_its_step(uninterrupted, tmp_path, capsys,
                                                                  monkeypatch):
    """No checkpoint was due at step 2 (--checkpoint-every 0): its failing evaluation writes one, and
    the resumed run evaluates step 2, trains on and ends where the uninterrupted run does."""
    out = tmp_path / "run"
    _failing(monkeypatch, "validation")
    capsys.readouterr()
    assert _train(out, "--steps", "4", "--eval-every", "2", "--checkpoint-every", "0") == 2
    assert "the evaluation at step 2 failed" in one_line(capsys)
    assert (out / "torch" / "checkpoints" / "latest").read_text().strip() == "step-00000002"
    monkeypatch.undo()
    assert _train(out, "--steps", "4", "--eval-every", "2", "--checkpoint-every", "0", "--resume") == 0
    _same_run(out, uninterrupted)


def test_a_failing_averaged_evaluation_keeps_the_run_and_resume_finishes_it(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    flags = ["--steps", "4", "--checkpoint-every", "2", "--average-last", "2"]
    _failing(monkeypatch, "averaged")
    capsys.readouterr()
    assert _train(out, *flags) == 2
    assert "the averaged checkpoints' evaluation at step 4 failed (RuntimeError: " in one_line(capsys)
    assert (out / "torch" / "checkpoints" / "latest").read_text().strip() == "step-00000004"
    monkeypatch.undo()
    assert _train(out, *flags, "--resume") == 0
    kinds = [(r["kind"], r["step"]) for r in _log(out) if r["kind"] != "train"]
    assert kinds == [("eval", 4), ("eval_average", 4)]  # neither repeated
    assert (out / "torch" / "result.json").is_file()


def test_a_warmup_past_the_run_warns_and_one_checkpoint_is_not_averaged(tmp_path, capsys):
    """Issue 57: --warmup >= the run's steps (the recipe's 300 with --steps 4) trained silently with a
    warm-up that never ends: now a warning line. --average-last with a single checkpoint wrote an
    "averaged" copy of it: now a note and no averaged.safetensors; two checkpoints are averaged."""
    out = tmp_path / "run"
    flags = ["train", "--backend", "torch", *QUICK, "--warmup", "300", "--eval-every", "0",
             "--average-last", "2", "--keep", "2", "--device", "cpu", "--out", str(out)]
    capsys.readouterr()
    assert main([*flags, "--steps", "4"]) == 0
    err = capsys.readouterr().err
    assert ("rosetta: torch: warning: --warmup 300 >= the run's 4 steps: the learning rate rises for the "
            "whole run and never decays (the warm-up never ends); give --warmup below the steps\n") in err
    assert ("rosetta: torch: --average-last 2: the run has 1 checkpoint, nothing to average; no "
            "averaged.safetensors written (more steps than --checkpoint-every 500 give more)\n") in err
    assert not (out / "torch" / "averaged.safetensors").exists()
    assert main([*flags, "--steps", "8", "--resume"]) == 0  # checkpoints at 4 and 8: averaged
    assert (out / "torch" / "averaged.safetensors").is_file()
    capsys.readouterr()
    assert main([*flags[:-1], str(tmp_path / "short"), "--steps", "4", "--warmup", "3"]) == 0
    assert "warning" not in capsys.readouterr().err
