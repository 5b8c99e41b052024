"""Beam search's selection in JAX: the exact top k of each sentence's beams' candidates (jax.lax.top_k's
order: ties to the lower index), in two stages and through a long row's best chunks. Mirrors
torch_impl/topk.py; jax_impl/decode.py's searches call it."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rosetta.generation import chunk_width


def beam_topk(cand: jax.Array, k: int, two_stage: bool = True) -> tuple[jax.Array, jax.Array]:
    """The k best of a sentence's beams' continuations cand [B, K, V], ranked as jax.lax.top_k ranks
    cand.reshape(B, K * V): by value, ties to the lower flat index beam * V + v; their values [B, k]
    and flat indices. `two_stage` (TWO_STAGE_TOPK): each beam's top k over its V tokens, then the top
    k of those K x k; exact, ties included (the argument: torch_impl/decode.py's beam_topk; it holds
    for any top-k that ranks by value with ties to the lower index, as lax.top_k does)."""
    B, K, V = cand.shape
    if not two_stage or k >= V:
        return jax.lax.top_k(cand.reshape(B, K * V), k)
    values, token = top_k_by_chunks(cand, k)  # [B, K, k] each: a beam's top k, ties to the lower token
    best, survivor = jax.lax.top_k(values.reshape(B, K * k), k)
    return best, (survivor // k) * V + jnp.take_along_axis(token.reshape(B, K * k), survivor, axis=1)


def grouped_max(x: jax.Array) -> jax.Array:
    """x.max(axis=-1), taken over groups of at most 32 at a time where the length allows: XLA's CPU
    backend rewrites a longer reduction into a reduce-window and a reduce (its tree-reduction rewriter,
    meant for float sums' accuracy), 2.6 ms a beam step over [128, 250, 128] int32 against 0.6 ms
    grouped (this project's 2-core Xeon). An integer max is the same in any grouping. (Floats: a jitted
    max over a 32,000-long float32 row dropped a NaN on this CPU, grouped or not: top_k_by_chunks ranks
    int keys.)"""
    while x.shape[-1] > 32:
        inner = max(d for d in range(1, 33) if x.shape[-1] % d == 0)
        if inner == 1:  # a prime length: one reduction, rewritten or not
            break
        x = x.reshape(*x.shape[:-1], x.shape[-1] // inner, inner).max(axis=-1)
    return x.max(axis=-1)


def top_k_by_chunks(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """jax.lax.top_k(x, k) over the last axis, exactly (ties to the lower index, XLA's total order of
    floats: -NaN < -inf < -0.0 < 0.0 < inf < NaN), through the k best chunks of a long row: the
    chunks ranked by their best element in that order (the float's bits made order-preserving int32
    keys, as torch_impl's _topk_by_keys), taken in index order, then lax.top_k over them (the argument:
    torch_impl/decode.py's _best_chunks). lax.top_k over [128, 32000] took 12 ms a beam step on one
    core, as torch.topk did; a short row goes to lax.top_k whole (rosetta.generation.chunk_width)."""
    V = x.shape[-1]
    width = chunk_width(V, k)
    if width is None:
        return jax.lax.top_k(x, k)
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    keys = jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # float order, -0.0 below 0.0, NaNs at the ends
    best = grouped_max(keys.reshape(*x.shape[:-1], V // width, width))
    # Ranked as the floats they are (the key map is its own inverse): XLA's CPU top-k of int32 was a
    # stable sort of every row, its float32 top-k a kernel of its own, the order of lax.top_k(x) itself.
    best = jax.lax.bitcast_convert_type(jnp.where(best < 0, best ^ 0x7FFFFFFF, best), x.dtype)
    chunk = jnp.sort(jax.lax.top_k(best, k)[1], axis=-1)  # index order: lax.top_k's ties stay by index
    position = (chunk[..., :, None] * width + jnp.arange(width)).reshape(*x.shape[:-1], k * width)
    values, index = jax.lax.top_k(jnp.take_along_axis(x, position, axis=-1), k)
    return values, jnp.take_along_axis(position, index, axis=-1)
