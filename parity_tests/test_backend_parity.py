"""Every backend against the float64 NumPy reference, stage by stage, over the config matrix.

Adding a backend or a dtype is one line in rosetta.parity.TOLERANCES; adding a config is one line in
conftest.CONFIG_VARIANTS. Tolerances are relative errors ||a - b|| / ||b|| at the positions
that are part of the contract (non-pad source positions for encoder stages, non-pad target
positions for decoder stages and logits).
"""

from __future__ import annotations

import numpy as np
import pytest

from rosetta import from_params
from rosetta.parity import TOLERANCES, relative_error, target_positions


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# (backend, compute dtype) -> relative tolerance against the float64 reference: the table that
# `rosetta parity` enforces (rosetta/parity.py); PyTorch's float16 runs on CUDA only.
CASES: dict[tuple[str, str], float] = {
    case: tolerance for case, tolerance in TOLERANCES.items() if case != ("torch", "float16") or _cuda()
}


def _positions(cfg, src, tgt, stage):
    if stage.startswith(("src_embed", "encoder")):
        return src != cfg.pad_id
    return target_positions(cfg, tgt)


# JAX's float64 model compiles anew for every config (~2.7 s each on this project's CPU, 39 cases):
# it runs on three configs below, chosen to cover pre- and post-norm, tied and untied outputs. Its
# bfloat16 model (one program per config × batch shape, ~1.3 s each) runs every config on the padded
# batch (test_jax_bfloat16_matches_the_reference): the batch shapes' paths (padding, a batch of one,
# tgt longer than src) are the dtype's same code, run in float32 on every config here.
MATRIX = sorted(case for case in CASES if case not in (("jax", "float64"), ("jax", "bfloat16")))


@pytest.mark.parametrize("backend,dtype", MATRIX, ids=[f"{b}-{d}" for b, d in MATRIX])
def test_every_stage_matches_the_reference(backend, dtype, cfg, params, batch):
    src, tgt = batch
    want = from_params(cfg, params, "numpy", "float64").stages(src, tgt)
    got = from_params(cfg, params, backend, dtype).stages(src, tgt)
    assert sorted(got) == sorted(want)
    for stage, ref in want.items():
        out = np.asarray(got[stage], dtype=np.float64)
        assert out.shape == ref.shape, stage
        assert np.isfinite(out).all(), stage
        where = _positions(cfg, src, tgt, stage)
        if not where.any():
            continue  # e.g. a source that is all padding has no contract positions
        err = relative_error(out, ref, where)
        assert err <= CASES[backend, dtype], f"{stage}: relative error {err:.2e}"


@pytest.mark.parametrize("cfg", ["post_norm_relu", "pre_norm_gelu", "share_none_unequal_vocab_output_bias"],
                         indirect=True)
@pytest.mark.parametrize("batch", ["padded"], indirect=True)
def test_jax_float64_matches_the_reference(cfg, params, batch):
    """JAX's float64 model (under 64-bit JAX: jax_impl/backend.py x64) is the reference, stage by stage."""
    test_every_stage_matches_the_reference("jax", "float64", cfg, params, batch)


@pytest.mark.parametrize("batch", ["padded"], indirect=True)
def test_jax_bfloat16_matches_the_reference(cfg, params, batch):
    """JAX's bfloat16 model (float32 weights cast once: jax_impl/backend.py compute_weights), every
    config, stage by stage, within TOLERANCES' 3e-2."""
    test_every_stage_matches_the_reference("jax", "bfloat16", cfg, params, batch)


# The model each dtype builds its canonical weights in: float32 parameters for every compute dtype but
# float64 (the 16-bit ones cast at use), so a 16-bit case would rebuild the float32 case's model.
ROUND_TRIPS = sorted({(backend, "float64" if dtype == "float64" else "float32") for backend, dtype in CASES})


@pytest.mark.parametrize("backend,dtype", ROUND_TRIPS, ids=[f"{b}-{d}" for b, d in ROUND_TRIPS])
def test_canonical_round_trip_is_bit_exact(backend, dtype, cfg, params):
    back = from_params(cfg, params, backend, dtype).to_params()
    assert list(back) == list(params)
    for name, value in params.items():
        assert back[name].dtype == np.float32, name
        assert back[name].tobytes() == value.tobytes(), name


@pytest.mark.parametrize("src,tgt,message", [
    ([[5, 64]], [[1, 5]], "src holds token id 64, outside the vocabulary [0, 64)"),
    ([[5, 6]], [[1, -1]], "tgt holds token id -1"),
    (np.array([[5.0, 6.0]]), [[1, 5]], "src must hold integer token ids, got dtype float64"),
    ([[5] * 129], [[1, 5]], "src has length 129, longer than max_len 128"),
    (np.zeros((0, 3), np.int64), [[1]], "src is empty"),
    ([[5, 6], [7, 8]], [[1, 5]], "src has batch size 2 but tgt has 1"),
])
def test_bad_input_is_refused_by_every_backend(backend, src, tgt, message):
    from rosetta import InputError, init_params, preset

    cfg = preset("tiny")
    model = from_params(cfg, init_params(cfg), backend)
    with pytest.raises(InputError) as err:
        model.logits(src, tgt)
    assert message in str(err.value)


def test_mismatched_checkpoint_is_refused_by_every_backend(backend, tmp_path):
    import json

    import safetensors.numpy

    from rosetta import CheckpointError, init_params, load, preset
    from rosetta.checkpoint import FORMAT

    cfg = preset("tiny")
    tensors = init_params(cfg)
    tensors["encoder.layers.1.ffn.linear2.kernel"] = np.zeros((64, 16), np.float32)
    meta = {"format": FORMAT, "config": json.dumps(cfg.to_dict()), "dtype": "float32"}
    safetensors.numpy.save_file(tensors, str(tmp_path / "m.safetensors"), metadata=meta)
    with pytest.raises(CheckpointError, match=r"encoder.layers.1.ffn.linear2.kernel has shape \(64, 16\)"):
        load(tmp_path / "m.safetensors", backend)


def test_unknown_dtype_is_refused(backend):
    from rosetta import RosettaError, init_params, preset

    cfg = preset("tiny")
    with pytest.raises(RosettaError, match=f"backend '{backend}' has no dtype 'int8'"):
        from_params(cfg, init_params(cfg), backend, "int8")


def test_models_never_share_memory_with_the_callers_arrays(backend):
    from rosetta import init_params, preset

    cfg = preset("tiny", share_embeddings="none", output_bias=True)
    params = init_params(cfg)
    before = {k: v.copy() for k, v in params.items()}
    model = from_params(cfg, params, backend)
    for value in model.to_params().values():
        value += 1.0  # writing into what to_params returned must not reach the model ...
    for value in params.values():
        value -= 1.0  # ... nor writing into the caller's arrays
    again = model.to_params()
    for name, value in before.items():
        assert np.array_equal(again[name], value), name
