"""The label-smoothed cross-entropy (SPEC §4) with its own backward: `cross_entropy` on logits
(jax_impl/train.py's loss_fn), and the output projection with the loss in chunks of tokens
(`chunked_loss`): no [tokens, V] float32 array is ever alive for the whole batch, only one
[chunk, V] block at a time. Same loss and gradients as `loss_fn(hidden @ W + b, ...)`; the math
and the choice of chunk: docs/loss.md. The matmuls take their operands in the hidden states' dtype
(bfloat16 in, bfloat16 GEMMs with float32 accumulation; float32 and float64 as they are); logits,
logsumexp, sums and the weight's gradient are float32 at least.

Maintained kernels that do this (Liger-Kernel's fused linear cross-entropy, Apple's Cut
Cross-Entropy) are PyTorch/Triton only; JAX has none we could install, so this custom_vjp over a
lax.map (forward) and a lax.scan (backward) of chunks is the one used.

Mirrors torch_impl/loss.py, the same names in the same order (parity_tests/test_structure.py);
diff them to see only framework differences.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from rosetta.errors import RosettaError

# Tokens per chunk: the [chunk, V] float32 logits block is 4·chunk·V bytes (1024 × 32k: 128 MiB).
DEFAULT_CHUNK = 1024


def _matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b with both operands in their own (compute) dtype, the product accumulated and returned
    in float32 at least (dot_general's preferred_element_type: one bfloat16 GEMM with a float32
    result on a GPU); float32 and float64 operands run as they are, unchanged."""
    return jnp.matmul(a, b, preferred_element_type=jnp.promote_types(a.dtype, jnp.float32))


def _chunk_logits(h: jax.Array, w: jax.Array, bias: jax.Array | None, scale: float) -> jax.Array:
    """Logits [n, V] = scale * (h W) (+ b) of one chunk, in float32 at least (§3.4), as
    jax_impl/model.py's Generator (`scale`: the config's logit_scale, SPEC §2). h and w (already
    in h's dtype) are the matmul's operands; `bias` is already in the logits' dtype."""
    logits = _matmul(h, w)
    logits = logits if scale == 1.0 else logits * scale
    return logits if bias is None else logits + bias


def _chunks(hidden: jax.Array, labels: jax.Array, pad_id: int, chunk: int) -> tuple[jax.Array, jax.Array]:
    """[N, d], [N] -> [n, chunk, d], [n, chunk]: the last chunk filled up with pad labels (masked
    out), because lax.map and lax.scan need equal chunks where torch slices a shorter last one."""
    fill = -hidden.shape[0] % chunk
    hidden = jnp.pad(hidden, ((0, fill), (0, 0)))
    labels = jnp.pad(labels, (0, fill), constant_values=pad_id)
    return hidden.reshape(-1, chunk, hidden.shape[-1]), labels.reshape(-1, chunk)


def _token_losses(logits: jax.Array, y: jax.Array, pad_id: int, label_smoothing: float
                  ) -> tuple[jax.Array, jax.Array]:
    """(Σ over non-pad tokens of the cross-entropy against q, logsumexp per token) of logits
    [..., V] in their own (float32 or wider) dtype."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    nll = lse - jnp.take_along_axis(logits, y[..., None], axis=-1)[..., 0]  # -log p[y]
    smooth = lse - logits.mean(axis=-1)  # -(1/V) Σ_v log p[v]: ε over all V (PITFALLS 11)
    per_token = (1.0 - label_smoothing) * nll + label_smoothing * smooth
    return jnp.where(y != pad_id, per_token, 0.0).sum(), lse


def _logits_grad(logits: jax.Array, lse: jax.Array, y: jax.Array, pad_id: int, label_smoothing: float,
                 scale: jax.Array) -> jax.Array:
    """d loss / d logits = mask · (softmax - q) · scale, from the logits and their logsumexp."""
    V = logits.shape[-1]
    g = jnp.exp(logits - lse[..., None]) - label_smoothing / V  # softmax - ε/V
    g = g - (1.0 - label_smoothing) * jax.nn.one_hot(y, V, dtype=logits.dtype)  # - (1-ε)·onehot(y)
    return g * jnp.where(y != pad_id, scale, 0.0)[..., None]


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def cross_entropy(logits: jax.Array, labels: jax.Array, denominator: jax.Array, pad_id: int,
                  label_smoothing: float) -> jax.Array:
    """Σ over non-pad tokens of the cross-entropy against q = (1-ε)·onehot(y) + ε/V, divided by
    `denominator`, for logits [..., V] already in float32 or wider: train.loss_fn's core. Its own
    backward is the closed form; XLA's autodiff of log_softmax, take_along_axis and mean (a
    scatter and five passes over [tokens, V]) took 1.4x as long in a `small` step on this
    project's CPU (docs/benchmarks.md)."""
    return _cross_entropy_forward(logits, labels, denominator, pad_id, label_smoothing)[0]


def _cross_entropy_forward(logits, labels, denominator, pad_id, label_smoothing):
    total, lse = _token_losses(logits, labels, pad_id, label_smoothing)
    return total / jnp.asarray(denominator).astype(logits.dtype), (logits, labels, lse, denominator)


def _cross_entropy_backward(pad_id, label_smoothing, residuals, grad_out):
    logits, labels, lse, denominator = residuals
    scale = grad_out.astype(logits.dtype) / jnp.asarray(denominator).astype(logits.dtype)
    return _logits_grad(logits, lse, labels, pad_id, label_smoothing, scale), None, None


cross_entropy.defvjp(_cross_entropy_forward, _cross_entropy_backward)


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def chunked_cross_entropy(hidden: jax.Array, weight: jax.Array, bias: jax.Array | None, labels: jax.Array,
                          denominator: jax.Array, pad_id: int, label_smoothing: float,
                          chunk: int, scale: float) -> jax.Array:
    """Σ over non-pad tokens of the cross-entropy against q = (1-ε)·onehot(y) + ε/V, divided by
    `denominator`; forward and backward both walk the tokens `chunk` at a time."""
    return _chunked_forward(hidden, weight, bias, labels, denominator, pad_id, label_smoothing, chunk,
                            scale)[0]


def _chunked_forward(hidden, weight, bias, labels, denominator, pad_id, label_smoothing, chunk, scale):
    """The operands of the matmuls are in hidden's dtype (the compute dtype: bfloat16 when training
    in bfloat16), the weight cast to it once; logits, logsumexp and sums in float32 at least."""
    dtype = jnp.promote_types(hidden.dtype, jnp.float32)
    w, b = weight.astype(hidden.dtype), None if bias is None else bias.astype(dtype)

    def one(args: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        h, y = args
        return _token_losses(_chunk_logits(h, w, b, scale), y, pad_id, label_smoothing)

    sums, lse = jax.lax.map(one, _chunks(hidden, labels, pad_id, chunk))  # lse [n, chunk]: O(N)
    total = sums.sum() / jnp.asarray(denominator).astype(dtype)
    return total, (hidden, weight, bias, labels, lse, denominator)


def _chunked_backward(pad_id, label_smoothing, chunk, s, residuals, grad_out):
    """d loss / d logits = mask · (softmax - q) / denominator, recomputed chunk by chunk from
    the saved logsumexp in float32; then through logits = s (h W) + b: d/dh = s g W^T, d/dW = s h^T g,
    matmuls whose operands (g rounded to it, h, W) are in hidden's dtype, accumulated in float32."""
    hidden, weight, bias, labels, lse, denominator = residuals
    eps, (d, V) = label_smoothing, weight.shape
    dtype = lse.dtype
    scale = grad_out.astype(dtype) / jnp.asarray(denominator).astype(dtype)
    w, b = weight.astype(hidden.dtype), None if bias is None else bias.astype(dtype)

    def step(carry: tuple[jax.Array, jax.Array], args: tuple[jax.Array, ...]):
        grad_w, grad_b = carry
        h, y, lse_c = args
        g = _logits_grad(_chunk_logits(h, w, b, s), lse_c, y, pad_id, eps, scale)
        g_op = g.astype(hidden.dtype)  # the matmuls' operand (the same array in float32)
        # s multiplies the [chunk, d] sides (exact when s = 1), never the [chunk, V] block; the bias
        # is added after the scale (its gradient: the float32 g).
        return ((grad_w + _matmul((s * h).T, g_op), grad_b + g.sum(axis=0)),
                (s * _matmul(g_op, w.T)).astype(hidden.dtype))

    hs, ys = _chunks(hidden, labels, pad_id, chunk)
    zeros = (jnp.zeros((d, V), dtype), jnp.zeros((V,), dtype))
    (grad_w, grad_b), grad_h = jax.lax.scan(step, zeros, (hs, ys, lse))
    grad_h = grad_h.reshape(-1, d)[:hidden.shape[0]]
    grad_b = None if bias is None else grad_b.astype(bias.dtype)
    return grad_h, grad_w.astype(weight.dtype), grad_b, None, None


chunked_cross_entropy.defvjp(_chunked_forward, _chunked_backward)


def chunked_loss(hidden: jax.Array, weight: jax.Array, bias: jax.Array | None, labels: jax.Array,
                 pad_id: int, label_smoothing: float, num_tokens: jax.Array | int | None = None,
                 chunk: int = DEFAULT_CHUNK, logit_scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """train.loss_fn(Generator(hidden), labels, ...) without the [tokens, V] logits:
    hidden [B, T, d] or [N, d] (the decoder's output after its final norm), weight the canonical
    [d, V] kernel (the target table's transpose when tied, §3.4), bias [V] or None, labels
    hidden's leading shape, `logit_scale` the config's (SPEC §2: logits = logit_scale * (hidden W)
    + bias). Returns (loss, number of non-pad labels); the loss is the masked sum over that
    number, or over `num_tokens` when given (a part of a global batch: rosetta/distributed.py);
    a batch with no labels gives loss 0."""
    if hidden.ndim < 1 or tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise RosettaError(f"chunked_loss: labels {tuple(labels.shape)} must be hidden's "
                           f"{tuple(hidden.shape)} leading shape")
    if weight.ndim != 2 or weight.shape[0] != hidden.shape[-1]:
        raise RosettaError(f"chunked_loss: weight {tuple(weight.shape)} must be [d, V] with "
                           f"d = {hidden.shape[-1]} (hidden's last dimension)")
    if bias is not None and tuple(bias.shape) != (weight.shape[1],):
        raise RosettaError(f"chunked_loss: bias {tuple(bias.shape)} must be [V] = ({weight.shape[1]},)")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise RosettaError(f"chunked_loss: chunk must be a positive int, not {chunk!r}")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise RosettaError(f"chunked_loss: labels must be integer ids, not {labels.dtype}")
    h, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    chunk = min(chunk, max(h.shape[0], 1))  # no filler beyond one chunk's worth of tokens
    count = (y != pad_id).sum()
    denominator = jnp.maximum(count if num_tokens is None else num_tokens, 1)
    loss = chunked_cross_entropy(h, weight, bias, y, denominator, pad_id, float(label_smoothing), chunk,
                                 float(logit_scale))
    return loss, count


def generator_params(model) -> tuple[jax.Array, jax.Array | None]:
    """(kernel [d, V], bias [V] or None) of a Transformer's Generator: the target embedding
    table's transpose when tied (§3.4), as jax_impl/model.py's Generator.__call__ picks it. Pass
    the model's `cfg.logit_scale` to chunked_loss with them."""
    generator = model.generator
    kernel = model.tgt_table.embedding[...].T if generator.kernel is None else generator.kernel[...]
    return kernel, None if generator.bias is None else generator.bias[...]
