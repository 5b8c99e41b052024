"""Parity mode: float32 calls of the torch and JAX backends run with full-precision matmuls
(no TF32, JAX 'highest'), and restore the caller's setting afterwards (PITFALLS 5)."""

from __future__ import annotations

import jax
import numpy as np
import torch

from jax_impl import backend as jax_backend
from rosetta import from_params, init_params, preset


def test_torch_parity_mode_turns_tf32_off_during_float32_calls(monkeypatch):
    cfg = preset("tiny")
    model = from_params(cfg, init_params(cfg), "torch", "float32")
    seen = []
    forward = model.module.forward
    monkeypatch.setattr(model.module, "forward", lambda *a, **k: (
        seen.append((torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)),
        forward(*a, **k))[1])
    torch.set_float32_matmul_precision("high")  # what a user may have set: TF32 allowed
    try:
        model.logits(np.array([[5, 6]]), np.array([[1, 5]]))
        assert seen == [("highest", False)]
        assert torch.get_float32_matmul_precision() == "high"  # restored
    finally:
        torch.set_float32_matmul_precision("highest")


def test_jax_parity_mode_sets_highest_matmul_precision():
    assert jax.config.jax_default_matmul_precision is None
    with jax_backend.parity_mode():
        assert jax.config.jax_default_matmul_precision == "highest"
    assert jax.config.jax_default_matmul_precision is None
    with jax_backend.parity_mode(enabled=False):
        assert jax.config.jax_default_matmul_precision is None


def test_bfloat16_calls_leave_the_callers_precision_alone(monkeypatch):
    cfg = preset("tiny")
    with from_params(cfg, init_params(cfg), "jax", "bfloat16")._context():
        assert jax.config.jax_default_matmul_precision is None
    model = from_params(cfg, init_params(cfg), "torch", "bfloat16")
    seen = []
    forward = model.module.forward
    monkeypatch.setattr(model.module, "forward", lambda *a, **k: (
        seen.append(torch.get_float32_matmul_precision()), forward(*a, **k))[1])
    torch.set_float32_matmul_precision("high")
    try:
        model.logits(np.array([[5, 6]]), np.array([[1, 5]]))
        assert seen == ["high"]
    finally:
        torch.set_float32_matmul_precision("highest")
