"""Every dtype a backend offers runs (issue 36, item 6): each trainer's dtypes (read from its
backend's one dtype table: torch_impl/backend.py, jax_impl/backend.py) train 3 steps of `tiny` with
an evaluation, and the checkpoint they write translates and evaluates in every model backend, at
the run's dtype where that backend offers it (else its default). A dtype offered and failing here
(the oneDNN-packed linears under bfloat16 autocast; JAX's model without float64) was a traceback
after training had run."""

from __future__ import annotations

import io
import json

import pytest

from rosetta.backends import MODEL_BACKENDS, TRAINING_BACKENDS, get_backend, get_trainer
from rosetta.cli import main

CASES = [(backend, dtype) for backend in TRAINING_BACKENDS for dtype in get_trainer(backend).dtypes]


def test_the_trainers_and_models_read_one_table_per_backend():
    """A trainer offers the dtypes of its backend's table that train; the model every dtype of it."""
    from jax_impl import backend as jax_backend
    from torch_impl import backend as torch_backend

    assert get_backend("torch").dtypes == tuple(torch_backend.DTYPES)
    assert get_trainer("torch").dtypes == tuple(k for k, p in torch_backend.DTYPES.items() if p.trains)
    assert get_backend("jax").dtypes == get_trainer("jax").dtypes == tuple(jax_backend.DTYPES)
    assert {dtype for _, dtype in CASES} == {"float32", "bfloat16", "float64"}


@pytest.mark.slow
@pytest.mark.parametrize("backend, dtype", CASES, ids=[f"{b}-{d}" for b, d in CASES])
def test_every_dtype_trains_and_its_checkpoint_translates_in_every_backend(backend, dtype, tmp_path,
                                                                          monkeypatch, capsys):
    out = tmp_path / "run"
    assert main(["train", "--backend", backend, "--dtype", dtype, "--task", "multi30k", "--train-size", "300",
                 "--vocab-size", "300", "--eval-size", "4", "--bleu-samples", "2", "--max-tokens", "1024",
                 "--buckets", "128", "--steps", "3", "--eval-every", "3", "--warmup", "10", "--margin", "4",
                 "--out", str(out), "--no-progress", "--device", "cpu"]) == 0
    result = json.loads((out / backend / "result.json").read_text())
    assert result["steps"] == 3 and result["evaluations"][0]["step"] == 3 and result["dtype"] == dtype
    for model in MODEL_BACKENDS:
        use = dtype if dtype in get_backend(model).dtypes else get_backend(model).dtypes[0]
        monkeypatch.setattr("sys.stdin", io.StringIO("Ein Hund läuft.\nZwei Männer.\n"))
        capsys.readouterr()
        assert main(["translate", "--run", str(out / backend), "--backend", model, "--dtype", use,
                     "--beam", "2", "--margin", "4"]) == 0, (model, use)
        assert len(capsys.readouterr().out.splitlines()) == 2
        scores = tmp_path / f"{model}.json"
        assert main(["evaluate", str(out / backend), "--split", "val", "--limit", "3", "--backend", model,
                     "--dtype", use, "--beam", "1", "--margin", "4", "--out", str(scores)]) == 0, (model, use)
        assert json.loads(scores.read_text())["dtype"] == use
