"""JAX-only speed paths and helpers of jax_impl/model.py: attention through
jax.nn.dot_product_attention where it is faster (and the choice of when), dropout's CPU draw and
its key per platform, the output projection's backward, the incremental-decoding cache (a pytree,
written and reordered into new caches), and the variable type of the positional table.
torch_impl/ops.py holds PyTorch's, under the same names where they match, in the same order
(parity_tests/test_structure.py); numpy_ref/model.py computes the same numbers the plain way (and
decodes without a cache).

Shapes: B batch, h heads, Tq query length, Tk key length, dh d_head.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, dropout: nnx.Dropout,
              rngs: nnx.Rngs | None = None, weights: bool = False) -> tuple[jax.Array, jax.Array | None]:
    """Eq. 1, softmax(q k^T / sqrt(dh), masked) v, for q (B, h, Tq, dh), k, v (B, h, Tk, dh) and
    a boolean mask broadcastable to (B, h, Tq, Tk), with `dropout` on the attention weights:
    (B, Tq, h, dh), and with `weights` the softmax (before dropout). Keys and values (a cache's
    dtype, maybe) are cast to the queries' type."""
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    dropout_off = dropout.rate == 0 or dropout.deterministic
    if not weights and dropout_off and fused_kernels(q.dtype):
        return fused_attention(q, k, v, mask), None
    # The explicit path: its probabilities are recorded, or dropped out (the fused call has
    # no attention dropout), or the CPU. Scores and softmax in float32 at least (float64 stays
    # float64) even for bfloat16, as fused kernels do.
    wide = jnp.promote_types(q.dtype, jnp.float32)
    scores = (q @ k.transpose(0, 1, 3, 2)).astype(wide) / math.sqrt(q.shape[-1])
    # Masked scores are replaced by the most negative finite value: uniform weights, not
    # NaN, where every key is masked (SPEC §2, PITFALLS 4).
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)  # (B, h, Tq, Tk)
    probabilities = jax.nn.softmax(scores, axis=-1)
    y = dropout(probabilities, rngs=rngs).astype(q.dtype) @ v  # (B, h, Tq, dh)
    return y.transpose(0, 2, 1, 3), probabilities if weights else None


def fused_kernels(dtype) -> bool:
    """Whether attention takes jax.nn.dot_product_attention (fused_attention) for `dtype`: on GPUs,
    not on the CPU, where XLA's implementation (transposed to BTNH and back) measured ~12% slower per
    `small` training step than the explicit path (docs/benchmarks.md). Not for float64: XLA's
    implementation takes its softmax in float32 (a 1.4e-7 error on float64 inputs, where the
    float64 contract is 1e-12; seen on an H100 by benchmarks/gpu_check.py)."""
    return jax.default_backend() != "cpu" and dtype != jnp.float64


def fused_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """softmax(q k^T / sqrt(dh), masked) v for q (B, h, Tq, dh), k, v (B, h, Tk, dh) and a
    boolean mask broadcastable to (B, h, Tq, Tk), in one jax.nn.dot_product_attention call: cuDNN's
    fused kernel on a GPU for 16-bit types, XLA's implementation elsewhere. Returns (B, Tq, h, dh)."""
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))  # BTNH, its layout
    mask = jnp.broadcast_to(mask, (q.shape[0], mask.shape[1], q.shape[1], k.shape[1]))
    # SPEC §2: a query with no key left gets uniform weights, i.e. the mean of the values. XLA's
    # path fills masked scores with -0.7 * finfo.max and would agree; cuDNN's kernels need not
    # (zeros or NaN, and NaN in gradients), so such a row attends to every key and its output is
    # replaced below, whichever path ran.
    no_key = ~mask.any(axis=-1, keepdims=True)  # (B, h or 1, Tq, 1)
    mask = mask | no_key
    y = None
    if jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16):
        try:
            y = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="cudnn")
        except Exception:  # noqa: BLE001 - a shape or GPU cuDNN cannot take: XLA's path below
            y = None
    if y is None:
        y = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
    return jnp.where(no_key.transpose(0, 2, 1, 3), v.mean(axis=1, keepdims=True), y)


def cpu_dropout(x: jax.Array, p: float, key: jax.Array) -> jax.Array:
    """Inverted dropout (§5.4) at rate 0 < p < 1 from 16 random bits per value (threefry's classic
    mode hashes one 32-bit word pair per four values instead of per two: nnx.Dropout's float draws
    were 190 ms of a 2.1 s `small` step on this project's CPU, docs/benchmarks.md). Row r of x (its
    first axis, the batch's: every dropout site's) draws from fold_in(key, r): a row's mask depends on
    its index in the global batch alone, not on the batch's padding or on how a mesh splits it, so one
    device and several draw the same masks (issue 57; docs/distributed.md). p is rounded to a multiple
    of 2^-16 (0.1 -> 0.100006) and the scale is exactly 1/(1-p) for that p."""
    dropped = min(round(p * 65536), 65535)  # of a 16-bit draw's 65536 values, those dropped
    rows = jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.arange(x.shape[0]))
    bits = jax.vmap(lambda k: jax.random.bits(k, x.shape[1:], jnp.uint16))(rows)
    return jnp.where(bits >= dropped, x * (65536 / (65536 - dropped)), jnp.zeros_like(x))


class Dropout(nnx.Dropout):
    """Inverted dropout (§5.4: zero each value with probability p, scale the rest by 1/(1-p)), as
    torch_impl.ops.Dropout: on CPUs by cpu_dropout (its own stream: the trainer's nnx.Rngs).
    Elsewhere, or with rngs other than an nnx.Rngs, nnx.Dropout's own draw."""

    def __call__(self, x: jax.Array, *, deterministic: bool | None = None,
                 rngs: nnx.Rngs | None = None) -> jax.Array:
        off = self.deterministic if deterministic is None else deterministic
        if off or self.rate == 0.0 or not isinstance(rngs, nnx.Rngs) or jax.default_backend() != "cpu":
            return super().__call__(x, deterministic=deterministic, rngs=rngs)
        return cpu_dropout(x, self.rate, rngs[self.rng_collection]())


def dropout_rng(seed: int, platform: str) -> nnx.Rngs:
    """The trainer's dropout generator, nnx.Rngs(dropout=...), by platform. The CPU keeps the integer
    seed's threefry key (the stream the determinism tests pin). GPUs and TPUs take an `rbg` key: its
    bits come from XLA's RngBitGenerator, one op instead of threefry's hash rounds: the lever for
    masks regenerated in the backward pass rather than kept (whether XLA does so is for a GPU
    profile to show); its split and fold_in stay threefry's. Another stream, backend-dependent
    (docs/training.md: dropout streams), but the same whatever the mesh's layout (JAX's table of
    key implementations), so the draws of a global batch and a resume on another number of devices
    stay as with threefry; rbg is not "efficiently shardable" there: on a mesh each device may
    generate more bits than its own. GPU effect (memory, time): not measured."""
    if platform == "cpu":
        return nnx.Rngs(dropout=seed)
    return nnx.Rngs(dropout=jax.random.key(seed, impl="rbg"))


@jax.custom_vjp
def project(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x [..., d] @ kernel [d, V], whose backward computes d/dkernel = x^T g as [d, V]. For a tied
    kernel (E^T, §3.4) XLA's autodiff asks for E's gradient g^T x [V, d] instead, and its CPU dot
    then first copies the [tokens, V] gradient transposed: 270 ms of a 2.1 s `small` step on this
    project's CPU (docs/benchmarks.md). Same numbers either way; GPUs take both forms natively."""
    return x @ kernel


def _project_forward(x: jax.Array, kernel: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return x @ kernel, (x, kernel)


def _project_backward(residuals: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, kernel = residuals
    rows = tuple(range(x.ndim - 1))  # the token axes, summed over
    grad_kernel = jax.lax.dot_general(x, g, ((rows, rows), ((), ())))  # x^T g: [d, V]
    return g @ kernel.T, grad_kernel.astype(kernel.dtype)


project.defvjp(_project_forward, _project_backward)


def fused_linear(linears: Sequence[nnx.Linear], x: jax.Array) -> list[jax.Array]:
    """The outputs of `linears` (one input size; all with a bias or none) for x by one dot, their
    kernels side by side (nnx.Linear's dtype promotion and dot): the decoding step's q, k and v
    (issue 55: XLA's CPU backend ran the three dots of a base-sized beam-4 step concurrently, each
    slower; the one dot took ~60% of their summed time). In the search's loop the concatenation is
    loop-invariant: XLA computes it once. Each output the dot products of its own Linear, up to the
    dot's summation order."""
    first = linears[0]
    kernel = jnp.concatenate([linear.kernel[...] for linear in linears], axis=1)
    bias = None if first.bias is None else jnp.concatenate([linear.bias[...] for linear in linears])
    x, kernel, bias = first.promote_dtype((x, kernel, bias), dtype=first.dtype)
    y = first.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=first.precision)
    return jnp.split(y if bias is None else y + bias, len(linears), axis=-1)


class LayerCache(NamedTuple):
    """One decoder layer's keys and values for incremental decoding, a speed path: self-attention
    over the L output positions (filled as decoding goes), cross-attention over the S source positions
    (computed once, per sentence: `cross_attend`). The self-attention rows are N = B x K (K beams a
    sentence, 1 in greedy search); their keys and values stay where they were written: `slots` [N, L]
    says which of its sentence's K rows holds each position of row n, and beam search's reordering
    moves those integers only (`reorder`, issue 55: gathering the whole cache was ~15% of a beam-4
    search of a base-sized model on this project's CPU). Keys (B, h, dh, L x K) and values (B, h,
    L x K, dh), position p of row k at p x K + k, and the cross-attention keys (B, h, dh, S): the
    layouts XLA's CPU dots read as they are (in others XLA copied or transposed each cache every
    step). A NamedTuple, so a pytree for lax loops."""

    self_k: jax.Array
    self_v: jax.Array
    slots: jax.Array
    cross_k: jax.Array
    cross_v: jax.Array

    def write(self, t: jax.Array, k: jax.Array, v: jax.Array) -> LayerCache:
        """The cache with row n's keys and values (N, h, 1, dh) of position t written into row n's own
        slot (cast to the cache's dtype): the whole cache is attended, positions > t masked
        (torch_impl's static-cache path)."""
        (N, _), (B, h, dh, _) = self.slots.shape, self.self_k.shape
        K = N // B
        k, v = (x.reshape(B, K, h, dh).astype(self.self_v.dtype) for x in (k, v))
        mine = (jnp.arange(N, dtype=self.slots.dtype) % K)[:, None]
        return self._replace(
            self_k=jax.lax.dynamic_update_slice_in_dim(self.self_k, k.transpose(0, 2, 3, 1), t * K, axis=3),
            self_v=jax.lax.dynamic_update_slice_in_dim(self.self_v, v.transpose(0, 2, 1, 3), t * K, axis=2),
            slots=jax.lax.dynamic_update_slice_in_dim(self.slots, mine, t, axis=1))

    def reorder(self, rows: jax.Array) -> LayerCache:
        """Beam search's reordering: row i takes row rows[i] (of the same sentence), its slots only."""
        return self._replace(slots=self.slots[rows])

    def self_attend(self, attention: nnx.Module, h: jax.Array, t: jax.Array,
                    mask: jax.Array) -> tuple[jax.Array, LayerCache]:
        """Self-attention of the new tokens h [N, 1, d] at position t by `attention` (the layer's
        MultiHeadAttention) with `mask` [..., L], and the new cache: their keys and values written
        (`write`), then eq. 1 for each row over its own positions, position p's key and value taken
        from the row `slots` names. Each sentence's K queries meet its K rows' keys in one dot, a score
        kept where the slot matches (the others add an exact 0), the values weighted in their slots
        (0 elsewhere): the same numbers as a reordered cache, up to the dots' summation order (as
        attention's explicit path: scores in float32 at least, masked by the most negative finite
        value, SPEC §2)."""
        projected = fused_linear([attention.q, attention.k, attention.v], h)
        q, k, v = (attention.split_heads(x) for x in projected)
        new = self.write(t, k, v)
        (N, L), (B, heads, dh, _) = new.slots.shape, new.self_k.shape
        K = N // B
        q = q.reshape(B, K, heads, dh).transpose(0, 2, 1, 3)
        k, v = new.self_k.astype(q.dtype), new.self_v.astype(q.dtype)
        mine = (new.slots.reshape(B, 1, K, L, 1) == jnp.arange(K)).reshape(B, 1, K, L * K)  # (B, 1, Kq, L K)
        scores = jnp.where(mine, jnp.einsum("bhqd,bhdp->bhqp", q, k), 0).reshape(B, heads, K, L, K).sum(-1)
        wide = jnp.promote_types(q.dtype, jnp.float32)
        scores = jnp.where(mask, scores.astype(wide) / math.sqrt(dh), jnp.finfo(wide).min)  # (B, h, Kq, L)
        weights = jnp.repeat(jax.nn.softmax(scores, axis=-1).astype(q.dtype), K, axis=-1)
        y = jnp.einsum("bhqp,bhpd->bhqd", jnp.where(mine, weights, 0), v)  # (B, h, Kq, dh)
        return attention.o(y.transpose(0, 2, 1, 3).reshape(h.shape)), new

    def cross_attend(self, attend: Callable[..., jax.Array], h: jax.Array, mask: jax.Array) -> jax.Array:
        """Cross-attention of h [N, 1, d] over the cached encoder keys and values by `attend(x_q, k,
        v, mask)` (MultiHeadAttention.attend). The keys and values (B, h, S, dh) may be a sentence's,
        B dividing N (beam search: rows b*K .. b*K + K - 1 are sentence b's K beams): each sentence's
        K rows are then K queries (B, K, d) of one attention over them, with `mask` [B, 1, 1, S]:
        keys and values computed and read once per sentence, not per beam (issue 47). The same
        numbers up to the dots' summation order (torch_impl/ops.py). B = N (greedy): each row its own."""
        rows, keys = self.cross_k.shape[0], self.cross_k.swapaxes(2, 3)  # stored (B, h, dh, S)
        return attend(h.reshape(rows, -1, h.shape[-1]), keys, self.cross_v, mask).reshape(h.shape)


class Positions(nnx.Variable):
    """The sinusoidal table: state, but not a trainable parameter and not in the checkpoint
    (torch_impl registers a non-persistent buffer)."""
