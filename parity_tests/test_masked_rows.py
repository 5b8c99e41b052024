"""A source row of nothing but padding (the last rows of a bucket can be): every query of its
encoder self-attention and of the decoder's cross-attention has no key left, and SPEC §2 gives it
uniform weights, the values' mean, whatever q and k are. So a loss on that row's outputs has no
gradient to the query and key projections of those attentions: exactly zero, as central finite
differences in float64 say, in PyTorch and in JAX. (PyTorch's SDPA with an additive mask gave
||dL/dq|| = 3.77 there before torch_impl/ops.py replaced such rows by the values' mean.)"""

from __future__ import annotations

import numpy as np
import pytest

from rosetta import from_params, init_params, preset
from rosetta.parity import random_batch

PAD_ROW = 1
H = 1e-6  # central differences of an O(1) loss in float64: error ~ H^2 + eps / H ~ 1e-10
ATTENTIONS = ("encoder.layers.{}.self_attn", "decoder.layers.{}.cross_attn")  # the ones without keys
NO_KEY = [f"{attn.format(i)}.{p}.{w}" for attn in ATTENTIONS for i in range(2) for p in "qk"
          for w in ("kernel", "bias")]
SEEN = ["encoder.layers.0.self_attn.v.kernel", "decoder.layers.1.cross_attn.v.kernel"]  # do depend on it


def _case():
    cfg = preset("tiny", dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    params = {k: v.astype(np.float64) for k, v in init_params(cfg, seed=0).items()}
    src, tgt = random_batch(cfg, 3, 7, 6, seed=0)
    src[PAD_ROW] = cfg.pad_id
    cotangent = np.random.default_rng(1).standard_normal((tgt.shape[1], cfg.tgt_vocab_size))
    return cfg, params, src, tgt, cotangent


def _loss(cfg, params, src, tgt, cotangent, backend) -> float:
    logits = np.asarray(from_params(cfg, params, backend, "float64").logits(src, tgt), dtype=np.float64)
    return float((logits[PAD_ROW] * cotangent).sum())


def _autograd(cfg, params, src, tgt, cotangent, backend) -> dict[str, np.ndarray]:
    """The loss's gradient by the framework's autodiff, as canonical arrays."""
    if backend == "torch":
        import torch

        from torch_impl.convert import build_model, from_state_dict

        module = build_model(cfg, params, torch.float64)
        logits = module(torch.from_numpy(src), torch.from_numpy(tgt))
        (logits[PAD_ROW] * torch.from_numpy(cotangent)).sum().backward()
        return from_state_dict(cfg, {n: p.grad for n, p in module.named_parameters()}, np.float64)
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jax_impl.convert import build_model, to_params

    with jax.enable_x64(True):
        graphdef, state = nnx.split(build_model(cfg, params, jnp.float64))

        def loss(state):
            return (nnx.merge(graphdef, state)(jnp.asarray(src), jnp.asarray(tgt))[PAD_ROW] * cotangent).sum()

        # One XLA program (jit): op by op, the float64 backward compiled each of its ~250 ops apart.
        return to_params(nnx.merge(graphdef, jax.jit(jax.grad(loss))(state)), np.float64)


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_no_gradient_to_q_and_k_where_no_key_is_left(backend):
    cfg, params, src, tgt, cotangent = _case()
    grads = _autograd(cfg, params, src, tgt, cotangent, backend)
    for name in NO_KEY:
        assert not grads[name].any(), (name, np.abs(grads[name]).max())  # exactly zero
    rng = np.random.default_rng(2)
    for name in NO_KEY[0::8] + NO_KEY[1::8] + NO_KEY[2::8] + SEEN:  # finite differences: q, its bias, k
        index = tuple(rng.integers(0, n) for n in params[name].shape)
        moved = []
        for step in (H, -H):
            p = {**params, name: params[name].copy()}
            p[name][index] += step
            moved.append(_loss(cfg, p, src, tgt, cotangent, backend))
        numeric = (moved[0] - moved[1]) / (2 * H)
        if name in NO_KEY:
            assert abs(numeric) <= 1e-8, (name, numeric)
        else:  # the finite differences see what the loss does depend on
            assert abs(numeric) > 1e-4 and abs(grads[name][index] - numeric) <= 1e-6 * max(1, abs(numeric))
