"""Greedy and beam search in PyTorch with a preallocated key/value cache: the encoder runs
once, each step feeds one token. Step for step the algorithm of numpy_ref/decode.py (read its
docstring first); `cache=False` recomputes the whole prefix instead (for benchmarks)."""

from __future__ import annotations

import torch

from rosetta.config import ModelConfig
from rosetta.generation import NEG, NO_CONSTRAINTS, Constraints, Generation, output_limits, strip
from torch_impl.model import Transformer, source_mask


def length_penalty(length: torch.Tensor | int, alpha: float, rule: str = "wu") -> torch.Tensor:
    """lp(Y) = ((5 + |Y|) / 6)^alpha, Wu et al. 2016, eq. 14; |Y|^alpha for rule "hf"."""
    n = torch.as_tensor(length, dtype=torch.float32)
    return n**alpha if rule == "hf" else ((5.0 + n) / 6.0) ** alpha


def constrain(logp: torch.Tensor, cfg: ModelConfig, constraints: Constraints, last: torch.Tensor,
              banned: torch.Tensor) -> torch.Tensor:
    """numpy_ref/decode.py's `constrain` (Hugging Face's logits processors, in its order);
    `banned` is constraints.banned_ids(cfg) on logp's device, built once per search."""
    if constraints.forced_eos:
        is_eos = torch.arange(logp.shape[-1], device=logp.device) == cfg.eos_id
        # x - x: 0, but a NaN row (non-finite logits) stays NaN for check_scores to refuse
        logp = torch.where(last[:, None], torch.where(is_eos, logp - logp, NEG), logp)
    logp[:, banned] = NEG
    if constraints.renormalize:
        logp = torch.log_softmax(logp, dim=-1)  # exp(NEG - max) is 0: the sum runs over what is left
        logp[:, banned] = NEG
    return logp


class Steps:
    """next_log_probs(tokens, t): [N, V] log-probabilities of output position t for rows whose
    emitted tokens are `tokens` [N, L] and limits `limits` [N], constrained; `reorder(rows)`
    follows the beams' reordering."""

    def __init__(self, module: Transformer, src: torch.Tensor, memory: torch.Tensor, length: int,
                 limits: torch.Tensor, constraints: Constraints = NO_CONSTRAINTS, cache: bool = True):
        self.module, self.src, self.memory, self.cfg = module, src, memory, module.cfg
        self.limits, self.constraints = limits, constraints
        self.banned = torch.as_tensor(constraints.banned_ids(self.cfg), device=src.device)
        self.cache = module.init_cache(memory, length) if cache else None
        self.cross_mask = source_mask(src, self.cfg.pad_id)

    def next_log_probs(self, tokens: torch.Tensor, t: int) -> torch.Tensor:
        bos = torch.full_like(tokens[:, :1], self.cfg.bos_id)
        if self.cache is not None:
            fed = bos[:, 0] if t == 0 else tokens[:, t - 1]
            logits = self.module.decode_step(fed, t, self.cache, self.cross_mask)
        else:  # the plain way: the whole prefix again
            prefix = torch.cat([bos, tokens[:, :t]], dim=1)
            hidden = self.module.decode(prefix, self.memory, self.src)[:, -1:]
            logits = self.module.generator(hidden, self.module.tgt_table)[:, 0]
        logp = torch.log_softmax(logits.float(), dim=-1)
        return constrain(logp, self.cfg, self.constraints, t + 1 >= self.limits, self.banned)

    def reorder(self, rows: torch.Tensor, t: int) -> None:
        """After step t: only positions <= t hold keys and values, so only they move."""
        for layer_cache in self.cache or []:
            layer_cache.self_k[:, :, :t + 1] = layer_cache.self_k[rows, :, :t + 1]
            layer_cache.self_v[:, :, :t + 1] = layer_cache.self_v[rows, :, :t + 1]


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
        return _topk_by_keys(x, x.shape[-1], torch.arange(x.shape[-1], device=x.device))
    values, index = torch.topk(x, k + 1, dim=-1)
    if bool((values[..., k - 1] == values[..., k]).any()) or bool(values.isnan().any()):
        return _topk_by_keys(x, k, torch.arange(x.shape[-1], device=x.device))
    order = _topk_by_keys(values[..., :k], k, index[..., :k])[1]
    return values.gather(-1, order), index.gather(-1, order)


def _topk_by_keys(x: torch.Tensor, k: int, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of float32 `x` along the last axis, ties to the lower `position` (the
    element's index in its row; `position` broadcasts against x), through torch.topk on unique
    int64 keys: the float's bits made order-preserving in the high half, the complemented
    position in the low half. Returns the values and the indices into x's last axis."""
    bits = (x + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into 0.0: equal values, equal keys
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)  # float order as ints
    index = torch.topk(ordered * 2**32 + ((2**32 - 1) - position), k, dim=-1).indices
    return x.gather(-1, index), index


def greedy_search(module: Transformer, cfg: ModelConfig, src: torch.Tensor, max_len_margin: int = 50,
                  cache: bool = True, constraints: Constraints = NO_CONSTRAINTS) -> Generation:
    B = src.shape[0]
    limits_np, L = output_limits(cfg, src.cpu().numpy(), max_len_margin, constraints.max_new_tokens)
    limits = torch.as_tensor(limits_np, device=src.device)
    steps = Steps(module, src, module.encode(src), L, limits, constraints, cache)
    tokens = torch.full((B, L), cfg.pad_id, device=src.device)
    scores = torch.zeros(B, device=src.device)
    done = torch.zeros(B, dtype=torch.bool, device=src.device)
    for t in range(L):
        logp = steps.next_log_probs(tokens, t)
        best = logp.argmax(dim=-1)  # first maximum: the lower index wins ties
        scores = torch.where(done, scores, scores + logp.gather(1, best[:, None])[:, 0])
        tokens[:, t] = torch.where(done, cfg.pad_id, best)
        done |= (best == cfg.eos_id) | (t + 1 >= limits)
        if bool(done.all()):
            break
    return Generation(strip(cfg, tokens.cpu().numpy()), scores.double().cpu().numpy())


def beam_search(module: Transformer, cfg: ModelConfig, src: torch.Tensor, beam_size: int = 4,
                alpha: float = 0.6, max_len_margin: int = 50, cache: bool = True,
                rule: str = "wu", constraints: Constraints = NO_CONSTRAINTS) -> Generation:
    B, K, dev = src.shape[0], beam_size, src.device
    limits_np, L = output_limits(cfg, src.cpu().numpy(), max_len_margin, constraints.max_new_tokens)
    limits = torch.as_tensor(limits_np, device=dev)
    memory = module.encode(src).repeat_interleave(K, dim=0)  # beam k of sentence b: row b*K+k
    steps = Steps(module, src.repeat_interleave(K, dim=0), memory, L, limits.repeat_interleave(K),
                  constraints, cache)
    seqs = torch.full((B, K, L), cfg.pad_id, device=dev)
    alive = torch.tensor([0.0] + [NEG] * (K - 1), device=dev).repeat(B, 1)  # beam 0 expands first
    fin_seqs, fin_scores = seqs.clone(), torch.full((B, K), NEG, device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    broken = torch.zeros(B, dtype=torch.bool, device=dev)
    for t in range(L):
        logp = steps.next_log_probs(seqs.view(B * K, L), t)
        V = logp.shape[-1]
        cand = (alive[:, :, None] + logp.view(B, K, V)).view(B, K * V)
        broken |= ~done & cand.isnan().any(dim=-1)  # non-finite logits: a NaN score (see numpy_ref)
        top_logp, top = topk_stable(cand, 2 * K)
        origin, token = top // V, top % V
        top_seqs = seqs.gather(1, origin[:, :, None].expand(B, 2 * K, L)).clone()
        top_seqs[:, :, t] = token
        final = (token == cfg.eos_id) | (t + 1 >= limits)[:, None]
        # Finished: keep the best K of the old finished and the new final candidates (Hugging
        # Face's rule takes them only from the top K of the 2K).
        finishes = final & (torch.arange(2 * K, device=dev) < K) if rule == "hf" else final
        new_scores = torch.where(finishes, top_logp / length_penalty(t + 1, alpha, rule), NEG)
        all_scores = torch.cat([fin_scores, new_scores], dim=1)
        new_fin_scores, keep = topk_stable(all_scores, K)
        new_fin_seqs = torch.cat([fin_seqs, top_seqs], dim=1).gather(1, keep[:, :, None].expand(B, K, L))
        # Alive: the best K candidates that did not finish.
        new_alive, keep = topk_stable(torch.where(final, NEG, top_logp), K)
        new_seqs = top_seqs.gather(1, keep[:, :, None].expand(B, K, L))
        steps.reorder((torch.arange(B, device=dev)[:, None] * K + origin.gather(1, keep)).view(-1), t)
        # Sentences already done keep their state.
        frozen = done[:, None]
        fin_scores = torch.where(frozen, fin_scores, new_fin_scores)
        fin_seqs = torch.where(frozen[:, :, None], fin_seqs, new_fin_seqs)
        alive = torch.where(frozen, alive, new_alive)
        seqs = torch.where(frozen[:, :, None], seqs, new_seqs)
        # Stop when no alive hypothesis can beat the worst kept finished one (see numpy_ref).
        bound = length_penalty(t + 1 if rule == "hf" else limits, alpha, rule)
        hopeless = fin_scores[:, -1] >= alive[:, 0] / bound
        done |= (t + 1 >= limits) | hopeless
        if bool(done.all()):
            break
    scores = torch.where(broken, torch.nan, fin_scores[:, 0])
    return Generation(strip(cfg, fin_seqs[:, 0].cpu().numpy()), scores.double().cpu().numpy())
