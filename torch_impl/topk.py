"""Beam search's selection in PyTorch: the exact top k of each sentence's beams' candidates, ties to
the lower index (as numpy's stable sort and jax.lax.top_k: torch.topk leaves their order unspecified),
in two stages, through a long row's best chunks, and ranked on the logits (RANK_LOGITS). Mirrors
jax_impl/topk.py; torch_impl/decode.py's searches call it."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rosetta.generation import NEG, chunk_width

TopK = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]  # topk_stable, topk_exact


def beam_topk(cand: torch.Tensor, k: int, topk: TopK,
              two_stage: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best of a sentence's beams' continuations cand [B, K, V], ranked as `topk` (topk_stable or
    topk_exact) ranks cand.view(B, K * V): by value, ties to the lower flat index beam * V + v; their
    values [B, k] and flat indices. `two_stage` (decode.TWO_STAGE_TOPK): each beam's top k over its V
    tokens, then the top k of those K x k (issue 47: B x K rows of V and B rows of K x k, instead of B
    rows of K x V). Exact, ties included: (1) within a beam the flat index order is the token order, so a
    beam's ranking is the whole ranking restricted to it; an element of the overall top k has fewer than k
    elements before it overall, hence fewer than k in its beam: it is in its beam's top k, and the K x k
    survivors hold the overall top k. (2) The second stage ranks survivor p = beam * k + j by value, ties
    to the lower p; among equal values a lower beam is a lower flat index, and within a beam the first
    stage put equal values in token order: the lower p is the lower flat index. NaN: topk_stable and
    topk_exact order bit patterns (_topk_by_keys), one total order in both stages."""
    B, K, V = cand.shape
    if not two_stage or k >= V:
        return topk(cand.view(B, K * V), k)
    return second_stage(*topk(cand, k), V, topk)  # [B, K, k] each: a beam's top k, ties to the lower token


def second_stage(values: torch.Tensor, token: torch.Tensor, V: int,
                 topk: TopK) -> tuple[torch.Tensor, torch.Tensor]:
    """beam_topk's second stage: the k best of the beams' K x k survivors `values` [B, K, k] (each
    beam's in order, ties to the lower `token`), their values and flat indices beam * V + token."""
    B, K, k = values.shape
    best, survivor = topk(values.view(B, K * k), k)
    origin = survivor // k
    return best, origin * V + token.reshape(B, K * k).gather(1, survivor)


def ranked_on_logits(logits: torch.Tensor, logp: torch.Tensor, alive: torch.Tensor, banned: torch.Tensor,
                     k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """RANK_LOGITS: each beam's top k candidates, values logp + alive (as the general path's cand has
    them: its log-softmax `logp` [B*K, V], unconstrained, plus the beam's score) and tokens, ordered by
    value, ties to the lower token, ranked on `logits` [B*K, V] (float32; overwritten at the banned
    tokens) and `alive` [B, K] without the scores added over [B, K, V] nor its NaN sum. x -> logp + alive
    (a row's constants subtracted, rounded) never reverses an order, so the k + 1 best logits (ties to
    the lower token) hold the top k by value wherever their k-th value is strictly above the (k+1)-th
    and above a banned token's (NEG + alive, constrain's). A row's log-softmax holds a NaN (the general
    path's broken sentence) exactly where its best logit's log-probability is not finite: a NaN or +inf
    logit, or every logit -inf. None where any of that fails (a NaN, an infinity, a tie at the
    boundary, too few tokens): the caller takes the general path with `logp`."""
    B, K = alive.shape
    V = logits.shape[-1]
    if k + 1 > V - len(banned):
        return None
    logits[:, banned] = -torch.inf  # ranked last; their value would be NEG + alive (constrain)
    top, token = topk_stable(logits.view(B, K, V), k + 1)
    values = logp.view(B, K, V).gather(-1, token)
    if not bool(values[..., 0].isfinite().all()):
        return None
    cand = values + alive[:, :, None]
    floor = torch.maximum(cand[..., k], NEG + alive)
    if not bool((cand[..., k - 1] > floor).all()):
        return None
    # Equal values of distinct logits (the rounding's): ranked by token, as the general path ranks them.
    order = _topk_by_keys(cand[..., :k], k, token[..., :k], V)[1]
    return cand[..., :k].gather(-1, order), token[..., :k].gather(-1, order)


def topk_stable(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest along the last axis, ties to the lower index (as numpy's stable argsort
    and jax.lax.top_k; torch.topk leaves tie order unspecified). float32: torch.topk picks k + 1
    values (the values are exact; only which of equal elements it picks is unspecified), then
    the k are ordered by value, ties by index; when the k-th and the (k + 1)-th value are equal,
    or a value is NaN, which elements are the k is ambiguous, and `_topk_by_keys` decides over
    the whole row. One pass over the row instead of the keys' eight: the beam's K x V candidates
    made this a third of CPU decoding time."""
    if x.dtype != torch.float32:
        values, index = torch.sort(x, dim=-1, descending=True, stable=True)
        return values[..., :k], index[..., :k]
    if k >= x.shape[-1]:
        return _topk_by_keys(x, x.shape[-1], torch.arange(x.shape[-1], device=x.device), x.shape[-1])
    chosen = _best_chunks(x, k)
    if chosen is not None:  # a long row: the keys' exact top k over its k best chunks only
        values, index = _topk_by_keys(x.gather(-1, chosen), k, chosen, x.shape[-1])
        return values, chosen.gather(-1, index)
    values, index = torch.topk(x, k + 1, dim=-1)
    if bool((values[..., k - 1] == values[..., k]).any()) or bool(values.isnan().any()):
        return _topk_by_keys(x, k, torch.arange(x.shape[-1], device=x.device), x.shape[-1])
    order = _topk_by_keys(values[..., :k], k, index[..., :k], x.shape[-1])[1]
    return values.gather(-1, order), index.gather(-1, order)


def _best_chunks(x: torch.Tensor, k: int) -> torch.Tensor | None:
    """The positions [..., k * width] of the k best chunks of each row of float32 `x` (contiguous
    runs of `width` elements, ranked by their maximum, ties to the lower chunk), or None where that
    saves nothing (a short row, no width dividing it, a NaN). The k best elements (value, ties to the
    lower index) lie in them: an element e of chunk C outside them has k chunks ranked above C, each
    of whose maxima ranks above e (it is > e, or = e at a lower index: chunks are in index order), so
    k elements rank above e. One pass of maxima over the row then replaces torch.topk's over it
    (12 ms of a beam-4 step's [128, 32000] on one core: a search's largest cost besides the GEMMs)."""
    V = x.shape[-1]
    width = chunk_width(V, k)  # rosetta/generation.py
    if width is None or not x.is_contiguous():
        return None
    maxima = x.view(*x.shape[:-1], V // width, width).amax(dim=-1)
    if bool(maxima.isnan().any()):  # NaN: the keys' order over the whole row (topk_stable)
        return None
    chunk = _topk_by_keys(maxima, k, torch.arange(V // width, device=x.device), V // width)[1]
    return (chunk[..., :, None] * width + torch.arange(width, device=x.device)).flatten(-2)


def topk_exact(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_stable without its fast path's host reads (for a compiled step): the keys' top-k over
    the whole row (float32), a stable sort otherwise. The same values and indices."""
    if x.dtype != torch.float32:
        values, index = torch.sort(x, dim=-1, descending=True, stable=True)
        return values[..., :k], index[..., :k]
    return _topk_by_keys(x, k, torch.arange(x.shape[-1], device=x.device), x.shape[-1])


def _topk_by_keys(x: torch.Tensor, k: int, position: torch.Tensor,
                  span: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of float32 `x` along the last axis, ties to the lower `position` (the
    element's index in its row, 0 <= position < span; it broadcasts against x), through torch.topk
    on unique int64 keys: the float's bits made order-preserving in the high half, the position
    complemented to span - 1 in the low half. Returns the values and the indices into x's last axis."""
    bits = (x + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into 0.0: equal values, equal keys
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)  # float order as ints
    # span - 1, not 2**32 - 1: Inductor folds the constant into Triton's int32 index arithmetic,
    # which refused 4294967295 (beam-4 decoding of `base` on an H200, torch 2.11).
    index = torch.topk(ordered * 2**32 + ((span - 1) - position), k, dim=-1).indices
    return x.gather(-1, index), index
