"""Training math (SPEC §4) agrees between PyTorch and JAX and with independent sources: the
paper's schedule formula written out here, the peer libraries' own losses, central finite
differences of the float64 NumPy reference, and torch.autograd.gradcheck. Dropout is 0
throughout: no two frameworks draw the same masks (PITFALLS 10)."""

from __future__ import annotations

import json
import math
from functools import cache

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx

import jax_impl.train as jt
import torch_impl.train as tt
from jax_impl.backend import parity_mode as jax_parity_mode
from jax_impl.convert import build_model, to_params
from numpy_ref.model import forward as reference_forward
from rosetta import ModelConfig, init_params, param_shapes, preset
from rosetta.errors import ConfigError
from rosetta.parity import random_batch, relative_error
from rosetta.training import TrainConfig, learning_rate
from torch_impl.backend import Model as TorchModel
from torch_impl.backend import parity_mode as torch_parity_mode
from torch_impl.convert import from_state_dict

pytestmark = pytest.mark.trainable

NO_DROPOUT = dict(dropout=0.0, attention_dropout=0.0)  # activation_dropout follows dropout
# Fewer layers where depth adds nothing new: each config costs one XLA compile (seconds on 2 cores).
GRAD_CONFIGS: dict[str, dict] = {
    "post_norm_relu_tied_all": {},
    "pre_norm_gelu_share_none_output_bias_2_1_layers": dict(
        norm_first=True, activation="gelu", share_embeddings="none", output_bias=True,
        src_vocab_size=50, tgt_vocab_size=70, num_decoder_layers=1),
    "share_decoder_1_1_layers": dict(share_embeddings="decoder", src_vocab_size=80, tgt_vocab_size=40,
                                     num_encoder_layers=1, num_decoder_layers=1),
}


# -- Helpers: written from the SPEC, not from the code under test ---------------------------

def paper_lr(step: int, d_model: int, warmup: int, factor: float = 1.0) -> float:
    """Eq. 3 by branch: linear warmup, then inverse square root decay."""
    if step <= warmup:
        return factor * step / (math.sqrt(d_model) * warmup**1.5)
    return factor / math.sqrt(d_model * step)


def make_labels(tgt: np.ndarray, pad_id: int, eos_id: int) -> np.ndarray:
    """The decoder input shifted left by one, eos after the last real token, pad elsewhere."""
    labels = np.full_like(tgt, pad_id)
    for b, row in enumerate(tgt):
        n = 1 + int((row[1:] != pad_id).sum())  # real length; position 0 is the start token
        labels[b, : n - 1] = row[1:n]
        labels[b, n - 1] = eos_id
    return labels


def perturbed_params(cfg: ModelConfig, seed: int = 1) -> dict[str, np.ndarray]:
    """Canonical init plus noise, so zero biases and unit LayerNorm scales are not special."""
    rng = np.random.default_rng(seed)
    return {k: (v + 0.05 * rng.standard_normal(v.shape)).astype(np.float32)
            for k, v in init_params(cfg, seed=0).items()}


def as64(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float64) for k, v in params.items()}


def batch(cfg: ModelConfig, seed: int, b: int = 4, s: int = 11, t: int = 9):
    src, tgt = random_batch(cfg, b, s, t, seed=seed)
    return src, tgt, make_labels(tgt, cfg.pad_id, cfg.eos_id)


def reference_loss(params: dict[str, np.ndarray], cfg: ModelConfig, src, tgt, labels, eps: float) -> float:
    """float64: -Σ_v q_v log p_v with q = (1-ε) onehot(y) + ε/V, mean over non-pad labels."""
    logits = reference_forward(params, cfg, src, tgt)
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    V = logits.shape[-1]
    q = (1 - eps) * np.eye(V)[labels] + eps / V
    per_token = -(q * logp).sum(-1)
    mask = labels != cfg.pad_id
    return float(per_token[mask].sum() / mask.sum())


def own_copy(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    # On CPU the torch module's untransposed float32 tensors share memory with the NumPy arrays
    # it was built from, and jnp.asarray may too: an in-place torch update would then move the
    # caller's params and a JAX model built from them. Each framework gets its own copy.
    return {k: v.copy() for k, v in params.items()}


def torch_module(cfg: ModelConfig, params, dtype: str = "float32"):
    """Built as the backend builds it: meta device, then the canonical weights assigned."""
    return TorchModel(cfg, own_copy(params), dtype, device="cpu").module


def jax_model(cfg: ModelConfig, params):
    return build_model(cfg, own_copy(params))


def t(x: np.ndarray):
    return torch.from_numpy(np.asarray(x))


# Attention key biases get an exactly zero gradient: q·b_k is the same for every key, and
# softmax ignores a constant shift. Both frameworks return roundoff there (~1e-9), and Adam,
# which divides by sqrt(v) ~ |g|, turns that roundoff into lr-sized steps in arbitrary
# directions. The output does not depend on them, so they are compared through the logits.
def is_key_bias(name: str) -> bool:
    return name.endswith(".k.bias")


# -- TrainConfig and the schedule ---------------------------------------------------------

def test_train_config_defaults_are_the_papers():
    c = TrainConfig()
    assert (c.label_smoothing, c.warmup_steps, c.lr_factor) == (0.1, 4000, 1.0)
    assert (c.adam_b1, c.adam_b2, c.adam_eps, c.clip_norm) == (0.9, 0.98, 1e-9, None)


def test_train_config_json_round_trip():
    c = TrainConfig(label_smoothing=0.2, warmup_steps=10, clip_norm=1.5, seed=7)
    assert TrainConfig.from_json(c.to_json()) == c
    assert TrainConfig.from_dict(json.loads(c.to_json())) == c
    with pytest.raises(ConfigError, match="lr_max"):
        TrainConfig.from_dict({"lr_max": 1.0})


@pytest.mark.parametrize("field, value", [
    ("label_smoothing", 1.0), ("label_smoothing", -0.1), ("warmup_steps", 0), ("warmup_steps", 2.5),
    ("lr_factor", 0.0), ("adam_b1", 1.0), ("adam_b2", True), ("adam_eps", 0.0), ("clip_norm", -1.0),
    ("seed", -1),
])
def test_train_config_errors_name_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        TrainConfig(**{field: value})


def test_learning_rate_is_eq3():
    d, w = 512, 4000
    for step in (1, w - 1, w, w + 1, 10 * w):
        assert learning_rate(step, d, w) == pytest.approx(paper_lr(step, d, w), rel=1e-12)
    assert learning_rate(7, 64, 10, factor=2.0) == pytest.approx(paper_lr(7, 64, 10, 2.0), rel=1e-12)
    with pytest.raises(ConfigError, match="step"):
        learning_rate(0, d, w)


def test_learning_rate_peaks_at_warmup():
    d, w = 512, 4000
    lrs = [learning_rate(s, d, w) for s in range(1, 3 * w)]
    assert int(np.argmax(lrs)) + 1 == w
    assert lrs[w - 1] == pytest.approx((d * w) ** -0.5, rel=1e-12)


class _OneParam:
    """Just what make_optimizer reads: `cfg.d_model` and the parameters."""
    cfg = ModelConfig(src_vocab_size=8, tgt_vocab_size=8, d_model=32, num_heads=4)


def test_schedulers_apply_eq3_for_20_steps():
    """Adam with a constant gradient g moves each weight by lr·g/(|g| + eps) ≈ lr per step
    (bias correction makes m̂ = g and v̂ = g²): read the lr off the weights each optimizer
    actually updated, and off the torch scheduler and the optax schedule."""
    tc, steps = TrainConfig(warmup_steps=10, lr_factor=2.0), 20
    expected = [paper_lr(s, 32, 10, 2.0) for s in range(1, steps + 1)]

    torch_holder = torch.nn.Module()
    torch_holder.cfg, torch_holder.w = _OneParam.cfg, torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt, sched = tt.make_optimizer(torch_holder, tc)
    torch_lrs, torch_moves = [], []
    for _ in range(steps):
        torch_lrs.append(opt.param_groups[0]["lr"])
        before = torch_holder.w.detach().clone()
        torch_holder.w.grad = torch.full_like(before, 1e3)
        opt.step()
        sched.step()
        torch_moves.append(float((before - torch_holder.w.detach())[0]))
    assert torch_lrs == pytest.approx(expected, rel=1e-12)  # float64 all the way
    np.testing.assert_allclose(torch_moves, expected, rtol=1e-9)

    class JaxHolder(nnx.Module):
        cfg = _OneParam.cfg

        def __init__(self):
            self.w = nnx.Param(jnp.zeros(3))

    holder = JaxHolder()
    jopt = jt.make_optimizer(holder, tc)
    lr_fn = jt.schedule(32, tc)
    jax_lrs, jax_moves = [], []
    for _ in range(steps):
        jax_lrs.append(float(lr_fn(jopt.step[...])))
        before = float(holder.w[...][0])
        jopt.update(holder, jax.tree.map(lambda x: jnp.full_like(x, 1e3), nnx.state(holder, nnx.Param)))
        jax_moves.append(before - float(holder.w[...][0]))
    # optax traces the schedule in float32: a product, a minimum and an rsqrt, each rounded (and
    # XLA's rsqrt within 2 ulps): <= 4 ulps = 4 * 2^-24 = 2.4e-7 relative; 1e-6 bounds it on any CPU.
    np.testing.assert_allclose(jax_lrs, expected, rtol=1e-6)
    # A move is read as before - after of float32 weights that have reached sum(lr) <= 20 lr_max:
    # the subtraction's rounding is <= ulp(20 lr_max) ~ 20 * 2^-24 lr = 1.2e-6 relative; plus the lr's.
    np.testing.assert_allclose(jax_moves, expected, rtol=1e-5)


# -- The loss ------------------------------------------------------------------------------

def random_logits(V: int = 13, pad_id: int = 0, seed: int = 0):
    rng = np.random.default_rng(seed)
    logits = (3.0 * rng.standard_normal((3, 7, V))).astype(np.float32)
    labels = rng.integers(0, V, size=(3, 7))
    labels[1, 4:] = pad_id
    labels[2, 1:] = pad_id
    labels[0, 2] = pad_id  # padding inside a row too
    return logits, labels


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_loss_matches_torch_and_optax(eps):
    logits, labels = random_logits()
    V, pad = logits.shape[-1], 0
    mask = labels != pad

    peer_torch = torch.nn.CrossEntropyLoss(label_smoothing=eps, ignore_index=pad)(
        t(logits).reshape(-1, V), t(labels).reshape(-1))
    per_pos = optax.softmax_cross_entropy(logits, optax.smooth_labels(jax.nn.one_hot(labels, V), eps))
    peer_optax = float(jnp.sum(jnp.where(mask, per_pos, 0.0)) / mask.sum())

    ours_torch, n_torch = tt.loss_fn(t(logits), t(labels), pad, eps)
    ours_jax, n_jax = jt.loss_fn(jnp.asarray(logits), jnp.asarray(labels), pad, eps)
    assert int(n_torch) == int(n_jax) == int(mask.sum())
    assert relative_error(ours_torch.item(), peer_torch.item()) <= 1e-6
    assert relative_error(float(ours_jax), peer_optax) <= 1e-6
    assert relative_error(ours_torch.item(), float(ours_jax)) <= 1e-6
    # The peers agree with each other too: ε/V over all classes, pad included (PITFALLS 11).
    assert relative_error(peer_torch.item(), peer_optax) <= 1e-6


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("num_tokens", [None, 50])
def test_jax_loss_and_projection_backwards_equal_autodiff_in_float64(eps, num_tokens):
    """jax_impl's own backwards (loss_fn's closed form, the output projection's x^T g) against
    JAX's autodiff of optax's smoothed cross-entropy over a plain matmul, in float64: the
    gradients with respect to the hidden states and to a tied table E (kernel E^T, §3.4)."""
    from jax_impl.ops import project

    rng = np.random.default_rng(0)
    hidden, table = rng.standard_normal((3, 7, 16)), 0.3 * rng.standard_normal((40, 16))
    labels = rng.integers(0, 40, (3, 7))
    labels[0, 4:] = 0  # pad
    with jax.enable_x64(True):
        def ours(h, e):
            return jt.loss_fn(project(h, e.T), jnp.asarray(labels), 0, eps, num_tokens)[0]

        def peer(h, e):
            q = optax.smooth_labels(jax.nn.one_hot(labels, 40), eps)
            per_pos = optax.softmax_cross_entropy(h @ e.T, q)
            denominator = (labels != 0).sum() if num_tokens is None else num_tokens
            return jnp.sum(jnp.where(labels != 0, per_pos, 0.0)) / denominator

        args = (jnp.asarray(hidden), jnp.asarray(table))
        (ours_loss, ours_grads), (peer_loss, peer_grads) = (jax.value_and_grad(f, argnums=(0, 1))(*args)
                                                            for f in (ours, peer))
        assert ours_grads[0].dtype == jnp.float64
        assert relative_error(float(ours_loss), float(peer_loss)) <= 1e-13
        for a, b in zip(ours_grads, peer_grads, strict=True):
            assert relative_error(np.asarray(a), np.asarray(b)) <= 1e-12


def test_loss_of_bfloat16_logits_is_computed_in_float32():
    logits, labels = random_logits()
    low = torch.from_numpy(logits).to(torch.bfloat16)
    loss, _ = tt.loss_fn(low, t(labels), 0, 0.1)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(tt.loss_fn(low.float(), t(labels), 0, 0.1)[0].item(), rel=1e-7)
    jlow = jnp.asarray(logits, jnp.bfloat16)
    jloss, _ = jt.loss_fn(jlow, jnp.asarray(labels), 0, 0.1)
    assert jloss.dtype == jnp.float32
    assert float(jloss) == pytest.approx(float(jt.loss_fn(jlow.astype(jnp.float32), labels, 0, 0.1)[0]),
                                         rel=1e-6)
    assert float(jloss) == pytest.approx(loss.item(), rel=1e-6)


def test_loss_gradcheck():
    logits, labels = random_logits(V=5)
    x = torch.from_numpy(logits.astype(np.float64)).requires_grad_()
    assert torch.autograd.gradcheck(lambda z: tt.loss_fn(z, t(labels), 0, 0.1)[0], (x,))


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_loss_gradient_with_probabilities_below_float32s_normal_range(label_smoothing):
    """loss_fn's closed-form backward (torch_impl/loss.py) against the float64 formula, s · (softmax
    - q) with s = mask / count, on float32 logits spread so that most probabilities lie below float32's
    smallest normal number (exp is read at 2·tiny there); twice through one graph (retain_graph: the
    saved log-probabilities are not overwritten then), the same gradient. The bound, per entry, with
    u = eps/2: log_softmax's x - max - log Σ has an absolute error of at most (|log p| + 2)·u, so p =
    exp(log p) one of p·(|log p| + 3)·u <= (1/e + 3)·u; subtracting ε/V, adding -(1-ε) at the label and
    multiplying by s add at most u·s each (|p - q| <= 1): in all under 7·u·s = 3.5·eps·s, taken as
    4·eps·s, plus s·2·tiny from the clamp (2.5·tiny taken: exp of log(2·tiny) rounded). On any CPU:
    no sum over more than one row's V terms."""
    logits, labels = random_logits(V=11)
    logits = logits * 40.0  # log-probabilities down to about -800
    x = t(logits).requires_grad_()
    loss = tt.loss_fn(x, t(labels), 0, label_smoothing)[0]
    (first,) = torch.autograd.grad(loss, x, retain_graph=True)
    (second,) = torch.autograd.grad(loss, x)
    assert torch.equal(first, second)
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    assert (p < np.finfo(np.float32).tiny).mean() > 0.5  # the case this test is about
    q = np.full_like(p, label_smoothing / z.shape[-1])
    np.put_along_axis(q, labels[..., None], q[0, 0, 0] + 1.0 - label_smoothing, axis=-1)
    mask = labels != 0
    expected = (p - q) * mask[..., None] / mask.sum()
    bound = (4 * np.finfo(np.float32).eps + 2.5 * np.finfo(np.float32).tiny) / mask.sum()
    assert np.abs(first.numpy() - expected).max() <= bound
    if label_smoothing == 0.0:  # where p < tiny off the label, the gradient is s·p exactly but for the clamp
        # (exp(float32(log(2·tiny))): 2·tiny within 4e-6 relative) and the product's rounding in the
        # subnormals (half the smallest subnormal, 2^-150): under 2.5·tiny·s
        below = (p < np.finfo(np.float32).tiny) & mask[..., None] & (q == 0.0)
        error = np.abs(first.numpy()[below] - expected[below]).max()
        assert error <= 2.5 * np.finfo(np.float32).tiny / mask.sum()


# -- Gradient parity -----------------------------------------------------------------------

@cache
def grad_case(name: str):
    cfg = preset("tiny", **NO_DROPOUT, **GRAD_CONFIGS[name])
    params = perturbed_params(cfg)
    src, tgt, labels = batch(cfg, seed=3)
    with torch_parity_mode():
        torch_loss, torch_grads = tt.gradients(torch_module(cfg, params), t(src), t(tgt), t(labels), 0.1)
    with jax_parity_mode():
        jax_loss, jax_grads = jt.gradients(jax_model(cfg, params), src, tgt, labels, 0.1)
    return cfg, params, (src, tgt, labels), (torch_loss, torch_grads), (jax_loss, jax_grads)


@pytest.mark.parametrize("name", sorted(GRAD_CONFIGS))
def test_gradient_parity(name):
    cfg, _, _, (torch_loss, torch_grads), (jax_loss, jax_grads) = grad_case(name)
    assert list(torch_grads) == list(jax_grads) == list(param_shapes(cfg))
    assert relative_error(torch_loss, jax_loss) <= 1e-6
    global_norm = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in jax_grads.values()))
    for key, g_jax in jax_grads.items():
        g_torch = torch_grads[key]
        assert g_torch.shape == g_jax.shape == param_shapes(cfg)[key], key
        if is_key_bias(key):  # exactly zero in exact arithmetic: both are roundoff
            assert max(np.linalg.norm(g_torch), np.linalg.norm(g_jax)) <= 1e-6 * global_norm, key
        else:
            assert relative_error(g_torch, g_jax) <= 1e-5, key


@pytest.mark.parametrize("name", sorted(GRAD_CONFIGS))
def test_gradients_match_finite_differences(name):
    """Central differences of the float64 NumPy reference loss, at each checked tensor's
    largest-gradient entry: an independent check of what both frameworks agree on."""
    cfg, params, (src, tgt, labels), (_, torch_grads), (_, jax_grads) = grad_case(name)
    p64 = as64(params)
    names = [n for n in param_shapes(cfg) if n.endswith((".embedding", "generator.kernel", "generator.bias",
                                                         "decoder.layers.0.ffn.linear1.kernel",
                                                         "encoder.layers.0.self_attn.q.kernel",
                                                         "decoder.layers.0.cross_attn_norm.scale"))]
    h = 1e-5
    for key in names:
        index = np.unravel_index(np.argmax(np.abs(jax_grads[key])), jax_grads[key].shape)
        plus, minus = dict(p64), dict(p64)
        plus[key], minus[key] = p64[key].copy(), p64[key].copy()
        plus[key][index] += h
        minus[key][index] -= h
        fd = (reference_loss(plus, cfg, src, tgt, labels, 0.1)
              - reference_loss(minus, cfg, src, tgt, labels, 0.1)) / (2 * h)
        assert torch_grads[key][index] == pytest.approx(fd, rel=1e-4, abs=1e-7), key
        assert jax_grads[key][index] == pytest.approx(fd, rel=1e-4, abs=1e-7), key


def test_torch_gradcheck_float64():
    """torch.autograd.gradcheck on a tiny float64 model built as the backend builds it
    (to_state_dict(cfg, params, torch.float64) onto a meta-device module)."""
    cfg = ModelConfig(src_vocab_size=11, tgt_vocab_size=11, d_model=8, num_heads=2, num_encoder_layers=1,
                      num_decoder_layers=1, d_ff=16, max_len=16, activation="gelu", output_bias=True,
                      **NO_DROPOUT)
    module = torch_module(cfg, perturbed_params(cfg), "float64")
    src, tgt, labels = batch(cfg, seed=5, b=2, s=5, t=4)
    names = ["shared_embed.weight", "encoder.layers.0.self_attn.q.weight",
             "decoder.layers.0.cross_attn.v.bias", "decoder.layers.0.ffn_norm.weight", "generator.bias"]
    inputs = tuple(dict(module.named_parameters())[n].detach().clone().requires_grad_() for n in names)
    assert all(x.dtype == torch.float64 for x in inputs)

    def loss(*tensors):
        logits = torch.func.functional_call(module, dict(zip(names, tensors, strict=True)), (t(src), t(tgt)))
        return tt.loss_fn(logits, t(labels), cfg.pad_id, 0.1)[0]

    assert torch.autograd.gradcheck(loss, inputs)


# -- Optimizer-step parity -----------------------------------------------------------------

def run_both(cfg: ModelConfig, params, tc: TrainConfig, batches):
    """Train from the same weights on the same batches, in float64 in both frameworks (torch's
    float64 module; JAX's under 64-bit JAX); weights after step 1 and at the end."""
    module = torch_module(cfg, params, "float64")
    opt, sched = tt.make_optimizer(module, tc)
    with jax.enable_x64(True):
        model = build_model(cfg, own_copy(params), jnp.float64)
        jopt, rngs = jt.make_optimizer(model, tc), nnx.Rngs(dropout=tc.seed)
    torch_log, jax_log, after_1 = [], [], None
    for i, (src, tgt, labels) in enumerate(batches):
        loss, lr = tt.train_step(module, opt, sched, t(src), t(tgt), t(labels), tc)
        torch_log.append((loss.item(), lr))
        with jax.enable_x64(True):
            jloss, jlr = jt.train_step(model, jopt, rngs, src, tgt, labels, tc)
            jax_log.append((float(jloss), float(jlr)))
            if i == 0:  # from_state_dict returns views of the live torch weights: copy
                after_1 = (own_copy(from_state_dict(cfg, module.state_dict(), np.float64)),
                           to_params(model, np.float64))
    with jax.enable_x64(True):
        final = (from_state_dict(cfg, module.state_dict(), np.float64), to_params(model, np.float64))
    return torch_log, jax_log, after_1, final


# Two implementations of one algorithm in float64 (docs/testing.md): they differ only by the order
# of their sums, <= n u relative per entry (u = 2^-53, n <= 44 terms), which Adam passes on with gain
# 1 where |g| >> eps (the k biases, zero in exact arithmetic, go through the logits) and 20 steps
# compound to ~20 n u = 1e-13. Seen: <= 1.4e-15 (AMD EPYC). In float32 the same comparison needed
# 1e-4 after 20 steps and still depended on the CPU: Adam makes rounding in small gradients
# full-size steps. A real difference shows: torch's clip rule, c/(norm + 1e-6), gave 3.6e-9.
STEP_PARITY_RTOL = 1e-10


@pytest.mark.parametrize("clip_norm", [None, 0.5])
def test_optimizer_step_parity(clip_norm):
    """PyTorch's and JAX's training steps are one algorithm: 20 steps (loss, clipping, Adam, the
    schedule) from the same weights in float64 give the same losses, lrs and weights."""
    cfg = preset("tiny", **NO_DROPOUT, num_encoder_layers=1, num_decoder_layers=1)  # one compile each
    params = perturbed_params(cfg)
    tc = TrainConfig(warmup_steps=10, lr_factor=0.2, clip_norm=clip_norm)
    batches = [batch(cfg, seed=100 + s) for s in range(20)]
    if clip_norm is not None:  # make sure clipping is active on the first step
        _, g = tt.gradients(torch_module(cfg, params), *map(t, batches[0]), tc.label_smoothing)
        assert math.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in g.values())) > clip_norm

    torch_log, jax_log, after_1, final = run_both(cfg, params, tc, batches)

    expected = [paper_lr(s, cfg.d_model, 10, 0.2) for s in range(1, 21)]
    assert [lr for _, lr in torch_log] == pytest.approx(expected, rel=1e-12)
    assert [lr for _, lr in jax_log] == pytest.approx(expected, rel=1e-12)  # the schedule in float64
    np.testing.assert_allclose([x for x, _ in jax_log], [x for x, _ in torch_log], rtol=STEP_PARITY_RTOL)

    for torch_p, jax_p in (after_1, final):
        assert all(v.dtype == np.float64 for v in [*torch_p.values(), *jax_p.values()])
        for key in param_shapes(cfg):
            if not is_key_bias(key):
                assert relative_error(torch_p[key], jax_p[key]) <= STEP_PARITY_RTOL, key
    # The weights moved, so the comparison above is not trivially true.
    assert relative_error(final[1]["shared_embed.embedding"], params["shared_embed.embedding"]) > 1e-2
    # Key biases (see is_key_bias) drift apart but cannot change the output: the float64
    # reference gives the same logits from either framework's trained weights.
    src, tgt, _ = batches[0]
    logits = [reference_forward(as64(p), cfg, src, tgt) for p in final]
    assert relative_error(logits[0], logits[1]) <= STEP_PARITY_RTOL


@pytest.mark.parametrize("rate", [0.1, 0.3, 0.5])
def test_torch_cpu_dropout_keeps_each_value_at_its_rate_and_scales_it(rate):
    """torch_impl's CPU dropout (16 random bits a value) against the binomial distribution: each of
    the four values a 64-bit draw feeds keeps with probability 1 - p (to 5 standard deviations),
    kept values are scaled by 1/(1-p), the gradient is that mask, eval mode is the identity, and
    the masks follow torch's seeded generator."""
    from torch_impl.model import Dropout

    n = 400_000
    layer = Dropout(rate).train()
    x = torch.ones(n, requires_grad=True)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        y = layer(x)
        torch.manual_seed(0)
        again = layer(torch.ones(n))
        other = layer(torch.ones(n))
    keep_p = 1 - round(rate * 65536) / 65536  # the rate rounded to 16 bits: 0.1 -> 0.100006
    assert abs(keep_p - (1 - rate)) < 2**-16
    kept = (y != 0).detach().reshape(-1, 4)  # the four 16-bit lanes of each 64-bit draw
    m = kept.shape[0]
    for lane in range(4):
        count = int(kept[:, lane].sum())
        assert abs(count - m * keep_p) < 5 * math.sqrt(m * keep_p * (1 - keep_p)), (lane, count / m)
    assert torch.allclose(y[y != 0], torch.tensor(1 / keep_p), rtol=1e-6, atol=0)
    grad = torch.randn(n)
    y.backward(grad)
    assert torch.equal(x.grad, grad * y.detach())  # d(x·mask·s)/dx = mask·s, and y = mask·s here
    assert torch.equal(y.detach(), again) and not torch.equal(again, other)
    assert layer.eval()(x) is x


@pytest.mark.parametrize("rate", [0.1, 0.3, 0.5])
def test_jax_cpu_dropout_keeps_each_value_at_its_rate_and_scales_it(rate):
    """jax_impl's CPU dropout (16 random bits a value, as torch_impl's) against the binomial
    distribution: in threefry's classic mode (the trainer's on one device) each 32-bit word feeds
    two values, and each of the two keeps with probability 1 - p to 5 standard deviations; kept
    values are scaled by 1/(1-p), the gradient is that mask, deterministic mode is the identity,
    and the masks follow the key."""
    from jax_impl.ops import Dropout

    assert jax.default_backend() == "cpu"  # the path under test; GPUs keep nnx.Dropout's draw
    n = 400_000
    layer = Dropout(rate)
    x = jnp.ones(n)
    with jax.threefry_partitionable(False):
        y, pullback = jax.vjp(lambda v: layer(v, rngs=nnx.Rngs(dropout=0)), x)
        again = layer(x, rngs=nnx.Rngs(dropout=0))
        other = layer(x, rngs=nnx.Rngs(dropout=1))
    keep_p = 1 - round(rate * 65536) / 65536  # the rate rounded to 16 bits: 0.1 -> 0.100006
    kept = np.asarray(y != 0).reshape(-1, 2)  # the two 16-bit halves of each 32-bit word
    m = kept.shape[0]
    for lane in range(2):
        count = int(kept[:, lane].sum())
        assert abs(count - m * keep_p) < 5 * math.sqrt(m * keep_p * (1 - keep_p)), (lane, count / m)
    y = np.asarray(y)
    np.testing.assert_allclose(y[y != 0], 1 / keep_p, rtol=1e-6, atol=0)
    grad = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(pullback(jnp.asarray(grad))[0]), grad * y)  # mask·s
    assert np.array_equal(y, np.asarray(again)) and not np.array_equal(y, np.asarray(other))
    assert layer(x, deterministic=True, rngs=nnx.Rngs(dropout=0)) is x


def test_torch_cpu_attention_dropout_is_eq1_with_the_drawn_mask():
    """With attention dropout on a CPU, torch_impl's attention takes the explicit path: its output
    is eq. 1 in float64 NumPy (a row with every key masked gets uniform weights, SPEC §2) times
    the mask cpu_dropout draws from the same seed, then the values."""
    from torch_impl.ops import attention, cpu_dropout

    rng = np.random.default_rng(0)
    B, h, Tq, Tk, dh, rate = 2, 3, 5, 6, 4, 0.3
    q, k, v = (rng.standard_normal((B, h, T, dh)).astype(np.float32) for T in (Tq, Tk, Tk))
    mask = rng.random((B, 1, Tq, Tk)) < 0.7
    mask[1, 0, 2] = False  # a query with no key left
    with torch.random.fork_rng():
        torch.manual_seed(0)
        y, weights = attention(t(q), t(k), t(v), torch.from_numpy(mask), rate)
        torch.manual_seed(0)
        drawn = cpu_dropout(torch.ones(B, h, Tq, Tk), rate).numpy().astype(np.float64)
    assert weights is None and 0 < (drawn == 0).mean() < 1
    scores = q.astype(np.float64) @ k.astype(np.float64).transpose(0, 1, 3, 2) / math.sqrt(dh)
    scores = np.where(mask, scores, -np.inf)
    no_key = ~mask.any(-1, keepdims=True)
    scores = np.where(no_key, 0.0, scores)  # uniform weights
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    expected = ((p * drawn) @ v.astype(np.float64)).transpose(0, 2, 1, 3)  # (B, Tq, h, dh)
    # float32: each value passes ~15 roundings of u = 6e-8 (a 4-term dot, exp, a sum of 6, a 6-term
    # dot): under 1e-6 (6.8e-8 seen).
    assert relative_error(y.numpy(), expected) <= 1e-6


def test_train_step_applies_dropout_reproducibly():
    """With dropout on, a step's loss differs from the eval loss and is reproducible from the
    seed: torch's global generator, JAX's explicit nnx.Rngs (the streams differ: PITFALLS 10)."""
    cfg = preset("tiny", dropout=0.3, num_encoder_layers=1, num_decoder_layers=1)
    params, tc = perturbed_params(cfg), TrainConfig(warmup_steps=10, seed=3)
    src, tgt, labels = batch(cfg, seed=7)
    eval_loss = reference_loss(as64(params), cfg, src, tgt, labels, tc.label_smoothing)

    def torch_loss() -> float:
        with torch.random.fork_rng():  # leave the global generator as other tests find it
            torch.manual_seed(tc.seed)
            module = torch_module(cfg, params)
            loss, _ = tt.train_step(module, *tt.make_optimizer(module, tc), t(src), t(tgt), t(labels), tc)
            return loss.item()

    jax_start = jax_model(cfg, params)
    jax_start = (jax_start, jt.make_optimizer(jax_start, tc))

    def jax_loss() -> float:
        # Clones share the optimizer's transformation, so the second call reuses the compiled step.
        model, optimizer = nnx.clone(jax_start)
        rngs = nnx.Rngs(dropout=tc.seed)
        return float(jt.train_step(model, optimizer, rngs, src, tgt, labels, tc)[0])

    for loss_of in (torch_loss, jax_loss):
        first = loss_of()
        assert math.isfinite(first) and abs(first - eval_loss) > 1e-3
        assert loss_of() == first


def test_jax_models_of_one_config_share_their_structure_not_their_weights():
    """build_model traces a config's structure once (jax_impl/convert.py: _structure) and gives each
    model new variables: training one model (every weight changed in place) leaves another built from
    the same config and params as it was, and each is what a fresh trace of the constructor builds."""
    from jax_impl.convert import _structure
    from jax_impl.model import Transformer

    cfg = preset("tiny", num_encoder_layers=1, num_decoder_layers=1, output_bias=True)
    params = perturbed_params(cfg)
    first = build_model(cfg, params)
    hits = _structure.cache_info().hits
    second = build_model(cfg, params)
    assert _structure.cache_info().hits == hits + 1  # the second build read the traced structure
    traced = nnx.eval_shape(lambda: Transformer(cfg, jnp.float32, rngs=nnx.Rngs(0)))
    traced.eval()  # as build_model leaves a model
    assert nnx.split(second)[0] == nnx.split(first)[0] == nnx.split(traced)[0]
    nnx.update(first, jax.tree.map(lambda x: x + 1, nnx.state(first, nnx.Param)))  # a step, in place
    for name, value in to_params(second).items():
        assert np.array_equal(value, params[name]), name
    assert all(np.array_equal(value, params[name] + 1) for name, value in to_params(first).items())
