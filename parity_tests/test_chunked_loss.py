"""The chunked output projection + label-smoothed cross-entropy (torch_impl/loss.py,
jax_impl/loss.py) against independent sources: each framework's plain path (the logits written
out, then train.loss_fn, differentiated by autograd), the float64 formula written out here in
NumPy, torch.autograd.gradcheck and jax.test_util.check_grads in float64. Also the memory claim:
nothing of [tokens, V] is kept for the backward (torch) or built at all (JAX's traced program)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from torch.utils._python_dispatch import TorchDispatchMode

import jax_impl.loss as jl
import jax_impl.train as jt
import torch_impl.loss as tl
import torch_impl.train as tt
from jax_impl.convert import build_model
from rosetta import init_params, preset
from rosetta.errors import RosettaError
from rosetta.parity import TOLERANCES, random_batch, relative_error
from torch_impl.backend import Model as TorchModel

pytestmark = pytest.mark.trainable

FRAMEWORKS = ("torch", "jax")
PAD = 0
B, T, D, V = 3, 7, 16, 50  # 21 tokens


def case(seed: int = 0, bias: bool = True, all_pad: bool = False):
    """hidden [B, T, d], weight in the canonical [d, V] layout, bias [V] or None, labels [B, T]
    with padding (row 0 full, the others cut), all float64."""
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((B, T, D))
    weight = 0.5 * rng.standard_normal((D, V))
    b = 0.3 * rng.standard_normal(V) if bias else None
    labels = rng.integers(1, V, size=(B, T))
    labels[1, 4:] = PAD
    labels[2, 2:] = PAD
    if all_pad:
        labels[:] = PAD
    return hidden, weight, b, labels


def softmax_terms(hidden, weight, bias, labels, eps: float, num_tokens=None, scale: float = 1.0):
    """float64 pieces of SPEC §4's loss for hidden [..., d], weight [d, V]: (s h W, log p, q, m / count)
    with logits = s (h W) + b (SPEC §2, s the logit_scale), q = (1-ε) onehot(y) + ε/V and m the
    non-pad mask ([..., 1]), count the non-pad labels or `num_tokens`."""
    scaled = scale * (hidden @ weight)
    logits = scaled + (0.0 if bias is None else bias)
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    q = (1 - eps) * np.eye(weight.shape[1])[labels] + eps / weight.shape[1]
    mask = labels != PAD
    count = max(mask.sum() if num_tokens is None else num_tokens, 1)
    return scaled, logp, q, mask[..., None] / count


def formula(hidden, weight, bias, labels, eps: float, num_tokens=None, scale: float = 1.0):
    """float64, from SPEC §4: loss = Σ_mask -Σ_v q_v log p_v / count, and its gradient
    d loss / d logits = mask (p - q) / count, taken through logits = s (h W) + b."""
    _, logp, q, mask = softmax_terms(hidden, weight, bias, labels, eps, num_tokens, scale)
    loss = -(q * logp * mask).sum()
    g = (np.exp(logp) - q) * mask  # [B, T, V]
    g2 = g.reshape(-1, V)
    grads = (scale * (g @ weight.T), scale * hidden.reshape(-1, D).T @ g2, g2.sum(0))
    return loss, grads


def run(framework: str, path: str, hidden, weight, bias, labels, eps: float, num_tokens=None,
        chunk: int = 8, dtype=np.float32, scale: float = 1.0):
    """(loss, count, (grad hidden, grad weight [d, V], grad bias or None)) as float64 NumPy, by
    the chunked loss ("chunked") or by the plain logits + train.loss_fn ("plain")."""
    if framework == "torch":
        tdt = {np.float32: torch.float32, np.float64: torch.float64, "bfloat16": torch.bfloat16}[dtype]
        h = torch.tensor(hidden).to(tdt).requires_grad_()
        w = torch.tensor(weight.T.copy(), dtype=torch.float32 if tdt == torch.bfloat16 else tdt,
                         requires_grad=True)  # nn.Linear's [V, d]
        b = None if bias is None else torch.tensor(bias, dtype=w.dtype, requires_grad=True)
        y = torch.tensor(labels)
        n = None if num_tokens is None else torch.tensor(num_tokens)
        if path == "chunked":
            loss, count = tl.chunked_loss(h, w, b, y, PAD, eps, n, chunk=chunk, logit_scale=scale)
        else:
            logits = scale * torch.nn.functional.linear(h, w.to(h.dtype))
            loss, count = tt.loss_fn(logits if b is None else logits + b.to(h.dtype), y, PAD, eps, n)
        loss.backward()
        grads = (h.grad, w.grad.T, None if b is None else b.grad)
        return (float(loss.detach()), int(count),
                tuple(None if g is None else g.double().numpy() for g in grads))
    jdt = jnp.bfloat16 if dtype == "bfloat16" else dtype
    h = jnp.asarray(hidden, jdt)
    w = jnp.asarray(weight, jnp.float32 if dtype == "bfloat16" else jdt)
    b = None if bias is None else jnp.asarray(bias, w.dtype)
    y = jnp.asarray(labels)

    def f(h, w, b):
        if path == "chunked":
            return jl.chunked_loss(h, w, b, y, PAD, eps, num_tokens, chunk=chunk, logit_scale=scale)
        return jt.loss_fn(scale * (h @ w.astype(h.dtype)) + (0 if b is None else b.astype(h.dtype)), y, PAD,
                          eps, num_tokens)

    (loss, count), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(h, w, b)
    return (float(loss), int(count),
            tuple(None if g is None else np.asarray(g.astype(jnp.float32), np.float64) for g in grads))


def close(a, b, tol: float) -> None:
    assert relative_error(np.atleast_1d(a), np.atleast_1d(b)) <= tol, (a, b)


# (chunk, ε, bias, logit_scale) over 21 tokens: a chunk that divides them, one that does not, one
# beyond them; a logit_scale (SPEC §2) that is not a power of two, with a bias added after it.
FLOAT32_CASES = {"chunk_7_divides_eps_0.1_bias": (7, 0.1, True, 1.0),
                 "chunk_8_does_not_divide_eps_0.1_bias": (8, 0.1, True, 1.0),
                 "chunk_64_beyond_tokens_eps_0.1_bias": (64, 0.1, True, 1.0),
                 "chunk_8_eps_0_no_bias": (8, 0.0, False, 1.0),
                 "chunk_8_eps_0.1_bias_logit_scale_0.3": (8, 0.1, True, 0.3)}


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("chunk_eps_bias", FLOAT32_CASES.values(), ids=FLOAT32_CASES.keys())
def test_float32_equals_plain_path_and_float64_formula(framework, chunk_eps_bias):
    chunk, eps, bias, scale = chunk_eps_bias
    hidden, weight, b, labels = case(bias=bias)
    loss, count, grads = run(framework, "chunked", hidden, weight, b, labels, eps, chunk=chunk, scale=scale)
    plain_loss, plain_count, plain_grads = run(framework, "plain", hidden, weight, b, labels, eps,
                                               scale=scale)
    ref_loss, ref_grads = formula(hidden.astype(np.float32).astype(np.float64),
                                  weight.astype(np.float32).astype(np.float64),
                                  None if b is None else b.astype(np.float32).astype(np.float64), labels, eps,
                                  scale=scale)
    assert count == plain_count == (labels != PAD).sum()
    close(loss, plain_loss, 1e-6)
    close(loss, ref_loss, 1e-6)
    for got, plain, ref in zip(grads, plain_grads, ref_grads, strict=True):
        if not bias and got is None:
            continue
        close(got, plain, 1e-6)
        close(got, ref, 1e-6)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_num_tokens_divides_instead_of_the_count(framework):
    """A block of a global batch (rosetta/distributed.py): the sum over the global count."""
    hidden, weight, b, labels = case(seed=1)
    loss, count, grads = run(framework, "chunked", hidden, weight, b, labels, 0.1, num_tokens=40, chunk=5)
    plain_loss, _, plain_grads = run(framework, "plain", hidden, weight, b, labels, 0.1, num_tokens=40)
    ref_loss, ref_grads = formula(hidden, weight, b, labels, 0.1, num_tokens=40)
    assert count == (labels != PAD).sum() != 40
    close(loss, plain_loss, 1e-6)
    close(loss, ref_loss, 1e-6)
    for got, plain, ref in zip(grads, plain_grads, ref_grads, strict=True):
        close(got, plain, 1e-6)
        close(got, ref, 1e-6)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_all_pad_labels_give_zero_loss_and_zero_gradients(framework):
    hidden, weight, b, labels = case(all_pad=True)
    loss, count, grads = run(framework, "chunked", hidden, weight, b, labels, 0.1, chunk=4)
    assert (loss, count) == (0.0, 0)
    for g in grads:
        assert np.isfinite(g).all() and not g.any()


# -- bfloat16 operands: bfloat16 GEMMs, float32 accumulation -----------------------------------

U = 2.0 ** -8  # bfloat16's unit roundoff: 8 significant bits, rounded to nearest

# Roundings to bfloat16 per path, (logits, d loss / d logits, grad hidden, grad weight), each a
# relative U (their derivation: bfloat16_bounds). Chunked, PyTorch (JAX rounds a subset of them,
# its GEMMs return float32): the bfloat16 GEMM's output of h W (1); g cast to the operand (1);
# grad hidden: the GEMM's output, then the scaled result (2); grad weight: s·h, each chunk's GEMM
# output, the cast to a bfloat16 weight (3). Plain (the logits in bfloat16, then loss_fn; autograd):
# the GEMM's output, ×s and +b in bfloat16 (3); g cast back to bfloat16 and ×s (2); one or two
# per GEMM output (2, 2).
ROUNDINGS = {"chunked": (1, 1, 2, 3), "plain": (3, 2, 2, 2)}


def bfloat16_bounds(hidden, weight, bias, labels, eps: float, scale: float, tokens, path: str):
    """Derived bounds on the norm-wise relative error (rosetta.parity.relative_error) of (loss,
    grad hidden, grad weight [d, V], grad bias) of a path whose operands are the bfloat16 values
    `hidden` [N, d], `weight` [d, V], `bias` (given here exactly, in float64), against the float64
    formula on those same values: what remains is the rounding inside the path. First order, each
    rounding to bfloat16 a relative U, float32 accumulation (2^-24 per operation) neglected:
      logits z = s (h W) + b: |Δz| <= n_z U (|s h W| + |b|) =: δz;
      loss = Σ_t ℓ_t(z_t) / D, dℓ/dz = p - q, so |Δloss| <= Σ |g| δz with g = m (p - q) / D;
      g: Δp_v = p_v (Δz_v - Σ_w p_w Δz_w) gives |Δg| <= n_g U |g| + (m / D) p (δz + max_v δz) =: δg;
      grad h = s g W^T: |Δ| <= s (δg + n_h U |g|) |W|^T; grad W = s h^T g: |Δ| <= s |h|^T (δg + n_w U |g|);
      grad b = Σ_t g: |Δ| <= Σ_t (δg + U |g|) (one rounding of the sum or of the bfloat16 bias's gradient).
    With `tokens` (a tied table: hidden = R + E[tokens], weight = E^T) the weight's bound adds the
    hidden's, scattered onto the rows of those tokens, as the gradients add. The products bound
    worst-case alignment of every rounding; the 1.25 covers the second-order terms (relative
    U·max|Δz| ≈ 0.01 of the first-order ones here) and the float32 accumulations (≤ V · 2^-24
    ≈ 3e-6 relative, under 1e-3 of one U)."""
    n_z, n_g, n_h, n_w = ROUNDINGS[path]
    z0, logp, q, mask = softmax_terms(hidden, weight, bias, labels, eps, scale=scale)
    p = np.exp(logp)
    g = (p - q) * mask
    dz = n_z * U * (np.abs(z0) + np.abs(0.0 if bias is None else bias))
    loss = -(q * logp * mask).sum()
    dg = n_g * U * np.abs(g) + mask * p * (dz + dz.max(-1, keepdims=True))
    d_h = scale * (dg + n_h * U * np.abs(g)) @ np.abs(weight).T
    d_w = scale * np.abs(hidden).T @ (dg + n_w * U * np.abs(g))
    d_b = (dg + U * np.abs(g)).sum(0)
    grads = (scale * g @ weight.T, scale * hidden.T @ g, g.sum(0))
    if tokens is not None:
        d_w, grads = d_w.copy(), (grads[0], grads[1].copy(), grads[2])
        np.add.at(d_w.T, tokens, d_h)
        np.add.at(grads[1].T, tokens, grads[0])
    bounds = [np.abs(g * dz).sum() / loss] + [np.linalg.norm(d) / np.linalg.norm(r)
                                              for d, r in zip((d_h, d_w, d_b), grads, strict=True)]
    return [1.25 * x for x in bounds]


def to_bf16(a):
    return None if a is None else np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def run_bf16(framework: str, path: str, rest, table, bias, labels, eps: float, scale: float, tokens,
             chunk: int = 8):
    """bfloat16 operands from float32 leaves, as a bfloat16 step casts its weights: hidden =
    bfloat16(rest + table[tokens]) (tied: the table is also the output weight) or bfloat16(rest);
    the bias's bfloat16 cast in the graph; the weight's too when tied (and on the plain path),
    else the float32 weight is passed (the chunked loss casts it once). Returns (loss, grads of
    rest, table [d, V], bias)."""
    tied = tokens is not None
    if framework == "torch":
        r = torch.tensor(rest, dtype=torch.float32, requires_grad=True)
        e = torch.tensor(table.T.copy(), dtype=torch.float32, requires_grad=True)  # [V, d]
        b = None if bias is None else torch.tensor(bias, dtype=torch.float32, requires_grad=True)
        h = (r + e[torch.tensor(tokens)] if tied else r).to(torch.bfloat16)
        w = e.to(torch.bfloat16) if tied or path == "plain" else e
        bb = None if b is None else b.to(torch.bfloat16)
        y = torch.tensor(labels)
        if path == "chunked":
            loss = tl.chunked_loss(h, w, bb, y, PAD, eps, chunk=chunk, logit_scale=scale)[0]
        else:
            logits = scale * torch.nn.functional.linear(h, w)
            loss = tt.loss_fn(logits if bb is None else logits + bb, y, PAD, eps)[0]
        loss.backward()
        grads = (r.grad, e.grad.T, None if b is None else b.grad)
        return (float(loss.detach()), *(None if x is None else x.double().numpy() for x in grads))
    y = jnp.asarray(labels)

    def f(r, e, b):
        h = (r + e.T[jnp.asarray(tokens)] if tied else r).astype(jnp.bfloat16)
        w = e.astype(jnp.bfloat16) if tied or path == "plain" else e
        bb = None if b is None else b.astype(jnp.bfloat16)
        if path == "chunked":
            return jl.chunked_loss(h, w, bb, y, PAD, eps, chunk=chunk, logit_scale=scale)[0]
        return jt.loss_fn(scale * (h @ w) + (0 if bb is None else bb), y, PAD, eps)[0]

    args = (jnp.asarray(rest, jnp.float32), jnp.asarray(table, jnp.float32),
            None if bias is None else jnp.asarray(bias, jnp.float32))
    loss, grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(*args)
    return (float(loss), *(None if x is None else np.asarray(x, np.float64) for x in grads))


# (tied, bias, logit_scale): untied with an output bias; tied with the logit_scale of an unscaled
# embedding (SPEC §2: d^-1/2), no bias. Both with pad labels (case()'s rows 1 and 2).
BF16_CASES = {"untied_bias": (False, True, 1.0), "tied_logit_scale": (True, False, D ** -0.5)}


def bf16_case(tied: bool, bias: bool):
    """case()'s arrays, rounded to bfloat16 values, flattened to [N, d]; when tied, the tokens
    whose table rows are added to the hidden states."""
    hidden, weight, b, labels = case(seed=2, bias=bias)
    rest, table, b = to_bf16(hidden.reshape(-1, D)), to_bf16(weight), to_bf16(b)
    tokens = np.random.default_rng(7).integers(1, V, size=rest.shape[0]) if tied else None
    return rest, table, b, labels.reshape(-1), tokens


def bf16_hidden(rest, table, tokens):
    """The bfloat16 hidden states the paths see: the float32 sum rounded, as the frameworks do."""
    if tokens is None:
        return rest
    return to_bf16(rest.astype(np.float32) + table.T[tokens].astype(np.float32))


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("case_", BF16_CASES.values(), ids=BF16_CASES.keys())
def test_bfloat16_operands_within_derived_bound_of_float64(framework, case_):
    """bfloat16 hidden states and weights: the loss and the gradients of the hidden states (rest),
    the weight (the tied table's, both uses) and the bias, against the float64 formula on the same
    bfloat16 values, within bfloat16_bounds or rosetta/parity.py's bfloat16 bound (3e-2), the smaller;
    and the plain bfloat16 path within its own, so chunked and plain agree within the sum."""
    tied, bias, scale = case_
    rest, table, b, labels, tokens = bf16_case(tied, bias)
    hidden = bf16_hidden(rest, table, tokens)
    bf16 = TOLERANCES[(framework, "bfloat16")]
    ref_loss, ref_grads = formula(hidden, table, b, labels, 0.1, scale=scale)
    if tied:
        ref_grads = (ref_grads[0], ref_grads[1].copy(), ref_grads[2])
        np.add.at(ref_grads[1].T, tokens, ref_grads[0])
    ref = (ref_loss, *ref_grads)
    got, errors = {}, {}
    for path in ("chunked", "plain"):
        got[path] = run_bf16(framework, path, rest, table, b, labels, 0.1, scale, tokens)
        derived = bfloat16_bounds(hidden, table, b, labels, 0.1, scale, tokens, path)
        # The loss's derived bound is the tighter one (4e-3 chunked); the gradients' worst case is
        # not (3e-2 to 0.15: every rounding aligned against a sum that cancels, Σ_v g_v = 0), so
        # the project's bfloat16 bound holds them (measured: ~3e-3, about U, on either path).
        assert derived[0] < bf16, derived
        bounds = [min(x, bf16) for x in derived]
        errors[path] = [(relative_error(np.atleast_1d(x), np.atleast_1d(r)), bound)
                        for x, r, bound in zip(got[path], ref, bounds, strict=True) if x is not None]
    assert all(err <= bound for errs in errors.values() for err, bound in errs), errors
    between = [relative_error(np.atleast_1d(c), np.atleast_1d(p)) for c, p in zip(*got.values(), strict=True)
               if c is not None]
    assert all(x <= c[1] + p[1] for x, c, p in zip(between, *errors.values(), strict=True)), (between, errors)


# (hidden, weight) dtypes: float32 training; bfloat16 weights cast once per step (all bfloat16);
# bfloat16 hidden states with the float32 weight (the loss casts it).
OPERAND_DTYPES = {"float32": ("float32", "float32"), "bfloat16": ("bfloat16", "bfloat16"),
                  "bfloat16_hidden_float32_weight": ("bfloat16", "float32")}


class TorchOps(TorchDispatchMode):
    """Every aten op that runs under it: (name, input tensors' dtypes, first input's shape, the
    output's dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[torch.dtype, ...], tuple[int, ...], torch.dtype | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        self.ops.append((func.overloadpacket.__name__, tuple(t.dtype for t in tensors),
                         tuple(tensors[0].shape) if tensors else (),
                         out.dtype if isinstance(out, torch.Tensor) else None))
        return out


@pytest.mark.parametrize("dtypes", OPERAND_DTYPES.values(), ids=OPERAND_DTYPES.keys())
def test_torch_matmuls_take_the_hidden_states_dtype(dtypes):
    """Each of the 4 GEMMs per chunk (h Wᵀ; in the backward h Wᵀ again, g W and gᵀ h) takes two
    operands of the hidden states' dtype: bfloat16 GEMMs for bfloat16 hidden states, float32 for float32 (as
    before). A weight of another dtype is cast once per pass (forward, backward), not per chunk;
    the gradients come back in their inputs' dtypes."""
    hidden_dtype, weight_dtype = (getattr(torch, x) for x in dtypes)
    h, w, b, y = torch_leaves(B * T, V, dtypes, seed=8)
    with TorchOps() as log:
        tl.chunked_loss(h, w, b, y, PAD, 0.1, chunk=4)[0].backward()
    chunks = -(-B * T // 4)
    matmuls = [dts for name, dts, _, _ in log.ops if name in ("mm", "addmm", "bmm", "matmul")]
    assert len(matmuls) == 4 * chunks
    assert all(dts == (hidden_dtype, hidden_dtype) for dts in matmuls), matmuls
    weight_casts = [op for op in log.ops if op == ("_to_copy", (weight_dtype,), (V, D), hidden_dtype)]
    assert len(weight_casts) == (0 if weight_dtype == hidden_dtype else 2)
    assert (h.grad.dtype, w.grad.dtype, b.grad.dtype) == (hidden_dtype, weight_dtype, weight_dtype)


@pytest.mark.parametrize("dtypes", OPERAND_DTYPES.values(), ids=OPERAND_DTYPES.keys())
def test_jax_matmuls_take_the_hidden_states_dtype(dtypes):
    """The traced loss and gradients: every dot_general (h W inside the map; h W, g Wᵀ and hᵀ g
    inside the scan) takes operands of the hidden states' dtype and returns float32 (bfloat16 GEMMs,
    float32 accumulation); the weight's cast to that dtype is outside the loops (once a pass)."""
    h, w, b, y = jax_leaves(B * T, V, dtypes)
    program = [(eqn, in_loop) for eqn, in_loop in eqns(jax.make_jaxpr(jax_grads(y, 4))(h, w, b).jaxpr)]
    dots = [eqn for eqn, _ in program if eqn.primitive.name == "dot_general"]
    assert len(dots) == 4 and all(in_loop for eqn, in_loop in program if eqn in dots)
    assert all(tuple(v.aval.dtype for v in eqn.invars) == (h.dtype, h.dtype) for eqn in dots), dots
    assert all(eqn.outvars[0].aval.dtype == jnp.float32 for eqn in dots)
    weight_casts = [in_loop for eqn, in_loop in program if eqn.primitive.name == "convert_element_type"
                    and (eqn.invars[0].aval.shape, eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype)
                    == ((D, V), w.dtype, h.dtype)]
    assert len(weight_casts) == (0 if w.dtype == h.dtype else 2) and not any(weight_casts)


@pytest.mark.parametrize("scale", [1.0, 0.3])
def test_torch_gradcheck_float64(scale):
    """torch.autograd.gradcheck: the Function's backward against central finite differences."""
    hidden, weight, b, labels = case(seed=3)
    h, w, bb = (torch.tensor(a[:2, :3] if a.ndim == 3 else a, requires_grad=True)
                for a in (hidden, weight.T.copy(), b))
    y = torch.tensor(labels[:2, :3])
    y[1, 2] = PAD
    assert torch.autograd.gradcheck(
        lambda h, w, bb: tl.chunked_loss(h, w, bb, y, PAD, 0.1, chunk=4, logit_scale=scale)[0], (h, w, bb))


@pytest.mark.parametrize("scale", [1.0, 0.3])
def test_jax_check_grads_float64(scale):
    """jax.test_util.check_grads (finite differences) and jax.grad of the plain loss, both in
    float64, on the CPU: under 64-bit JAX for this test only (jax.enable_x64, as the suite's float64
    trainers run: dp_case.train_float64), not in an interpreter of its own that imports JAX again."""
    from jax.test_util import check_grads

    hidden, weight, b, labels = case(seed=4)
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        h, w, bb = (jnp.asarray(x, jnp.float64) for x in (hidden, weight, b))
        y = jnp.asarray(labels)
        chunked = jax.jit(lambda h, w, b: jl.chunked_loss(h, w, b, y, 0, 0.1, chunk=4, logit_scale=scale)[0])
        plain = jax.jit(lambda h, w, b: jt.loss_fn(scale * (h @ w) + b, y, 0, 0.1)[0])
        check_grads(chunked, (h, w, bb), order=1, modes=["rev"])
        got, want = (jax.grad(f, argnums=(0, 1, 2))(h, w, bb) for f in (chunked, plain))
        assert str(got[0].dtype) == "float64"
        err = max(float(jnp.abs(g - x).max() / jnp.abs(x).max()) for g, x in zip(got, want, strict=True))
    assert err <= 1e-12


# -- Memory: O(chunk × V), not O(tokens × V) ---------------------------------------------------

N_BIG, V_BIG, CHUNK = 512, 300, 16


def saved_numels(f) -> list[int]:
    """Element counts of every tensor autograd keeps for the backward of f()."""
    sizes: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        f().backward()
    return sizes


def torch_leaves(n: int, v: int, dtypes: tuple[str, str], seed: int = 5):
    """hidden [n, D], weight [v, D], bias [v] (the weight's dtype) leaves and int64 labels."""
    rng = np.random.default_rng(seed)
    hdt, wdt = (getattr(torch, x) for x in dtypes)
    h = torch.tensor(rng.standard_normal((n, D)), dtype=hdt, requires_grad=True)
    w = torch.tensor(rng.standard_normal((v, D)), dtype=wdt, requires_grad=True)
    b = torch.tensor(rng.standard_normal(v), dtype=wdt, requires_grad=True)
    return h, w, b, torch.tensor(rng.integers(0, v, n))


def torch_plain(h, w, b, y) -> torch.Tensor:
    """The plain path's loss in hidden's dtype: the logits written out, then train.loss_fn."""
    return tt.loss_fn(torch.nn.functional.linear(h, w.to(h.dtype), b.to(h.dtype)), y, PAD, 0.1)[0]


@pytest.mark.parametrize("dtypes", OPERAND_DTYPES.values(), ids=OPERAND_DTYPES.keys())
def test_torch_keeps_nothing_of_tokens_by_vocab_for_the_backward(dtypes):
    """Saved for the backward: hidden [N, d], weight [V, d], bias, labels, the logsumexp [N],
    the denominator; never N·V floats (the plain path keeps at least one [N, V] tensor)."""
    h, w, b, y = torch_leaves(N_BIG, V_BIG, dtypes)
    chunked = saved_numels(lambda: tl.chunked_loss(h, w, b, y, PAD, 0.1, chunk=CHUNK)[0])
    plain = saved_numels(lambda: torch_plain(h, w, b, y))
    assert max(plain) >= N_BIG * V_BIG
    assert max(chunked) == max(N_BIG * D, V_BIG * D)
    assert sum(chunked) <= N_BIG * D + V_BIG * D + V_BIG + 2 * N_BIG + 1


# Peak memory: enough tokens that one [N, V] float32 block (8 MB) dwarfs the bound below (~1 MB).
N_PEAK, V_PEAK, CHUNK_PEAK = 2048, 1000, 64


def peak_bound(hidden_bytes: int) -> int:
    """Bytes the chunked loss may hold at once beyond its inputs, forward and backward together,
    for N_PEAK tokens, V_PEAK classes, CHUNK_PEAK tokens a chunk, hidden states of `hidden_bytes`
    each. [chunk, V]: three float32 blocks (12 c V): the logits and logsumexp's shifted copy (the
    forward), or g and its bfloat16 copy with the GEMM's workspace for gᵀ (the backward). [N]:
    logsumexp, masks and counts (16 N). [N, d]: the hidden states' gradient. [V, d]: the weight's
    cast, its gradient's float32 accumulator and a chunk's product (12 V d). [V]: the bias's
    gradient and cast (8 V). [chunk, d]: s·h and a chunk's gradient (12 c d)."""
    n, v, c = N_PEAK, V_PEAK, CHUNK_PEAK
    return 12 * c * v + 16 * n + hidden_bytes * n * D + 12 * v * D + 8 * v + 12 * c * D


def torch_peak_bytes(f) -> int:
    """The most bytes of CPU memory allocated at once while f() runs, beyond what was allocated
    before it: the profiler's allocation records, each with the allocator's running total (the
    record torch.profiler's memory timeline reads; private API, no public one gives it for CPU)."""
    from torch._C._profiler import _EventType

    def walk(nodes):
        for node in nodes:
            yield node
            yield from walk(node.children)

    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu, profile_memory=True) as prof:
        f()
    allocs = sorted((n for n in walk(prof.profiler.kineto_results.experimental_event_tree())
                     if n.typed[0] == _EventType.Allocation), key=lambda n: n.start_time_ns)
    start = allocs[0].typed[1].total_allocated - allocs[0].typed[1].alloc_size
    return max(n.typed[1].total_allocated for n in allocs) - start


@pytest.mark.parametrize("dtypes", OPERAND_DTYPES.values(), ids=OPERAND_DTYPES.keys())
def test_torch_peak_memory_is_a_few_chunks(dtypes):
    """Forward and backward, the chunked loss's peak allocation stays within peak_bound (a few
    [chunk, V] blocks plus O(N d + V d)); the plain path's, measured the same way, is over a
    whole [N, V] float32 block, so the measure would see one."""
    h, w, b, y = torch_leaves(N_PEAK, V_PEAK, dtypes)
    chunked = torch_peak_bytes(lambda: tl.chunked_loss(h, w, b, y, PAD, 0.1, chunk=CHUNK_PEAK)[0].backward())
    plain = torch_peak_bytes(lambda: torch_plain(h, w, b, y).backward())
    bound = peak_bound(h.element_size())
    assert plain >= 4 * N_PEAK * V_PEAK > 4 * bound
    assert 0 < chunked <= bound, (chunked, bound)


def eqns(jaxpr, in_loop: bool = False):
    """(equation, whether it runs inside a scan/map body) for every equation of a jaxpr, inside
    scan/map/custom_vjp bodies too."""
    for eqn in jaxpr.eqns:
        yield eqn, in_loop
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from eqns(inner, in_loop or eqn.primitive.name in ("scan", "while"))


def avals(jaxpr) -> list[tuple[int, ...]]:
    """Shapes of every value a jaxpr computes, inside scan/map/custom_vjp bodies too."""
    return [tuple(v.aval.shape) for eqn, _ in eqns(jaxpr) for v in eqn.outvars if hasattr(v.aval, "shape")]


def jax_leaves(n: int, v: int, dtypes: tuple[str, str]):
    """hidden [n, D], weight [D, v], bias [v] (the weight's dtype) and labels, zeros: only shapes
    and dtypes matter to the traced or compiled program."""
    hdt, wdt = (getattr(jnp, x) for x in dtypes)
    return jnp.zeros((n, D), hdt), jnp.zeros((D, v), wdt), jnp.zeros((v,), wdt), jnp.zeros((n,), jnp.int32)


def jax_grads(y, chunk: int | None):
    """jax.value_and_grad of the chunked loss (chunk given) or of the plain one, wrt h, w, b."""
    def f(h, w, b):
        if chunk is not None:
            return jl.chunked_loss(h, w, b, y, PAD, 0.1, chunk=chunk)[0]
        return jt.loss_fn(h @ w.astype(h.dtype) + b.astype(h.dtype), y, PAD, 0.1)[0]

    return jax.value_and_grad(f, argnums=(0, 1, 2))


@pytest.mark.parametrize("dtypes", OPERAND_DTYPES.values(), ids=OPERAND_DTYPES.keys())
def test_jax_program_never_builds_tokens_by_vocab(dtypes):
    """The traced loss-and-gradient program: no value of N·V elements or more, only [chunk, V]
    blocks inside the map and the scan (the plain path's program has [N, V] logits)."""
    h, w, b, y = jax_leaves(N_BIG, V_BIG, dtypes)
    chunked_sizes = [int(np.prod(s)) for s in avals(jax.make_jaxpr(jax_grads(y, CHUNK))(h, w, b).jaxpr)]
    plain_sizes = [int(np.prod(s)) for s in avals(jax.make_jaxpr(jax_grads(y, None))(h, w, b).jaxpr)]
    assert max(plain_sizes) >= N_BIG * V_BIG
    assert max(chunked_sizes) == max(N_BIG * D, V_BIG * D, CHUNK * V_BIG)


@pytest.mark.parametrize("dtypes", OPERAND_DTYPES.values(), ids=OPERAND_DTYPES.keys())
def test_jax_compiled_temporaries_are_a_few_chunks(dtypes):
    """XLA's own buffer assignment for the compiled loss and gradients: its temporaries (every
    buffer but the arguments and the outputs) within peak_bound, as PyTorch's allocations; the
    plain path's compiled program needs over a whole [N, V] float32 block."""
    h, w, b, y = jax_leaves(N_PEAK, V_PEAK, dtypes)

    def temp_bytes(chunk: int | None) -> int:
        return jax.jit(jax_grads(y, chunk)).lower(h, w, b).compile().memory_analysis().temp_size_in_bytes

    bound, chunked = peak_bound(h.dtype.itemsize), temp_bytes(CHUNK_PEAK)
    assert temp_bytes(None) >= 4 * N_PEAK * V_PEAK > 4 * bound
    assert 0 < chunked <= bound, (chunked, bound)


# -- In the model: the call the trainers make, minus the logits --------------------------------

# One layer each (depth adds nothing here): each config costs the JAX side one compile.
ONE_LAYER = dict(dropout=0.0, attention_dropout=0.0, num_encoder_layers=1, num_decoder_layers=1)
MODEL_CONFIGS = {"tied": ONE_LAYER,
                 "tied_unscaled_logit_scale": dict(ONE_LAYER, scale_embeddings=False, logit_scale=32 ** -0.5),
                 "untied_output_bias": dict(ONE_LAYER, share_embeddings="none", src_vocab_size=50,
                                            tgt_vocab_size=70, output_bias=True)}


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("variant", sorted(MODEL_CONFIGS))
def test_model_loss_and_every_parameter_gradient_match_loss_fn(framework, variant):
    """chunked_loss(decode(...), *generator_params(model)) against loss_fn(model(src, tgt)): the
    same loss and the same gradient for every parameter (the generator's and the tied table's too)."""
    cfg = preset("tiny", **MODEL_CONFIGS[variant])
    rng = np.random.default_rng(6)
    params = {k: (v + 0.05 * rng.standard_normal(v.shape)).astype(np.float32)
              for k, v in init_params(cfg, seed=0).items()}
    src, tgt = random_batch(cfg, 3, 6, 5, seed=6)
    labels = np.where(tgt == cfg.pad_id, cfg.pad_id, np.roll(tgt, -1, axis=1))
    if framework == "torch":
        def grads(chunked: bool):
            module = TorchModel(cfg, {k: v.copy() for k, v in params.items()}, "float32", device="cpu").module
            s, t, y = (torch.tensor(a) for a in (src, tgt, labels))
            if chunked:
                hidden = module.decode(t, module.encode(s), s)
                loss = tl.chunked_loss(hidden, *tl.generator_params(module), y, cfg.pad_id, 0.1, chunk=4,
                                       logit_scale=cfg.logit_scale)[0]
            else:
                loss = tt.loss_fn(module(s, t), y, cfg.pad_id, 0.1)[0]
            loss.backward()
            return float(loss.detach()), {k: p.grad.numpy() for k, p in module.named_parameters()}
    else:
        def grads(chunked: bool):
            model = build_model(cfg, params)
            s, t, y = (jnp.asarray(a) for a in (src, tgt, labels))

            def f(model):
                if chunked:
                    hidden = model.decode(t, model.encode(s), s)
                    weight, bias = jl.generator_params(model)
                    return jl.chunked_loss(hidden, weight, bias, y, cfg.pad_id, 0.1, chunk=4,
                                           logit_scale=cfg.logit_scale)[0]
                return jt.loss_fn(model(s, t), y, cfg.pad_id, 0.1)[0]

            loss, g = nnx.value_and_grad(f)(model)
            return float(loss), {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(g)}
    loss, got = grads(True)
    plain_loss, want = grads(False)
    close(loss, plain_loss, 1e-6)
    assert got.keys() == want.keys()
    errors = {}
    for name in want:
        if name.endswith(".k.bias"):  # true gradient zero: each path returns its own rounding noise
            continue  # (PITFALLS 14)
        # The output projection's own parameters to 1e-6; the layers below it see the float32
        # rounding of d loss / d hidden carried back through attention: ~1e-6 there, so 1e-5.
        errors[name] = (relative_error(got[name], want[name]), 1e-6 if name.startswith("generator") else 1e-5)
    assert all(err <= tol for err, tol in errors.values()), errors


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_bad_input_is_a_clear_error(framework):
    hidden, weight, b, labels = case()
    if framework == "torch":
        f, h, w, bb = tl.chunked_loss, torch.tensor(hidden), torch.tensor(weight.T.copy()), torch.tensor(b)
        y, wrong_w = torch.tensor(labels), torch.tensor(weight)
    else:
        f, h, w, bb = jl.chunked_loss, jnp.asarray(hidden), jnp.asarray(weight), jnp.asarray(b)
        y, wrong_w = jnp.asarray(labels), jnp.asarray(weight.T)
    with pytest.raises(RosettaError, match="labels"):
        f(h, w, bb, y[:, :3], PAD, 0.1)
    with pytest.raises(RosettaError, match="weight"):
        f(h, wrong_w, bb, y, PAD, 0.1)
    with pytest.raises(RosettaError, match="bias"):
        f(h, w, bb[:3], y, PAD, 0.1)
    with pytest.raises(RosettaError, match="chunk"):
        f(h, w, bb, y, PAD, 0.1, chunk=0)
    with pytest.raises(RosettaError, match="integer"):
        f(h, w, bb, y * 1.0, PAD, 0.1)
