"""Every backend against the float64 NumPy reference, stage by stage, over the config matrix.

Adding a backend or a dtype is one line in `CASES`; adding a config is one line in
conftest.CONFIG_VARIANTS. Tolerances are relative errors ||a - b|| / ||b|| at the positions
that are part of the contract (non-pad source positions for encoder stages, non-pad target
positions for decoder stages and logits).
"""

from __future__ import annotations

import numpy as np
import pytest

from rosetta import from_params
from rosetta.parity import relative_error, target_positions

# (backend, compute dtype) -> relative tolerance against the float64 reference.
CASES: dict[tuple[str, str], float] = {
    ("numpy", "float32"): 1e-5,
    ("torch", "float32"): 1e-5,
    ("torch", "float64"): 1e-12,
    ("torch", "bfloat16"): 3e-2,
    ("jax", "float32"): 1e-5,
    ("jax", "bfloat16"): 3e-2,
}


def _positions(cfg, src, tgt, stage):
    if stage.startswith(("src_embed", "encoder")):
        return src != cfg.pad_id
    return target_positions(cfg, tgt)


@pytest.mark.parametrize("backend,dtype", sorted(CASES), ids=[f"{b}-{d}" for b, d in sorted(CASES)])
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


@pytest.mark.parametrize("backend,dtype", sorted(CASES), ids=[f"{b}-{d}" for b, d in sorted(CASES)])
def test_canonical_round_trip_is_bit_exact(backend, dtype, cfg, params):
    back = from_params(cfg, params, backend, "float32" if dtype != "float64" else dtype).to_params()
    assert list(back) == list(params)
    for name, value in params.items():
        assert back[name].dtype == np.float32, name
        assert back[name].tobytes() == value.tobytes(), name
