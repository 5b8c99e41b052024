"""Greedy and beam search, the plain way: every step re-runs the decoder on the whole prefix.

This is the oracle for the cached searches of torch_impl/decode.py and jax_impl/decode.py,
which follow the same algorithm step for step (same state, same order, same tie-breaking):

- the decoder starts from `bos_id`; sentence b may emit at most `limits[b]` tokens
  (its real source length + `max_len_margin`, capped at `max_len` and `max_new_tokens`), the
  last one forced final;
- pad_id is never emitted (its log-probability is set to NEG, as Marian does), so every
  emitted token is a real key for later steps; nor are the `banned` ids, and the optional
  constraints of Hugging Face's generation config follow its order (`constrain`);
- beam search keeps `beam_size` alive hypotheses ranked by log-probability and `beam_size`
  finished ones ranked by log-probability / lp(length), lp(n) = ((5 + n) / 6)^alpha, the
  length penalty of Wu et al. 2016 (eq. 14); a sentence stops when no alive hypothesis can
  still beat its worst finished one, or at its limit. Ties go to the lower index.
"""

from __future__ import annotations

import numpy as np

from numpy_ref import model as ref
from rosetta.config import ModelConfig
from rosetta.generation import (
    NEG,
    NO_CONSTRAINTS,
    Constraints,
    Generation,
    length_penalty,
    output_limits,
    strip,
)
from rosetta.params import Params


def log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


# In float64 a checkpoint whose activations pass float32's range (embeddings of 3e38, scaled by
# sqrt(d_model)) still computes finite numbers, but their small parts are rounded away (the
# positions, next to 1e39) and the search returns confident nonsense; every float32 backend gets
# NaN there. The reference marks such rows NaN too, so that every backend's search refuses them
# (rosetta.generation.check_scores).
FLOAT32_MAX = float(np.finfo(np.float32).max)


def _past_float32(stages: dict[str, np.ndarray], rows: int) -> np.ndarray:
    """[rows] bool: rows holding a value outside float32's range, or NaN, in any stage."""
    out = np.zeros(rows, dtype=bool)
    for value in stages.values():
        out |= ~(np.abs(value) <= FLOAT32_MAX).reshape(rows, -1).all(axis=1)
    return out


def encode(params: Params, cfg: ModelConfig, src: np.ndarray) -> np.ndarray:
    """The encoder's memory [B, S, d], NaN in rows that pass float32's range."""
    stages: dict[str, np.ndarray] = {}
    memory = ref.encode(params, cfg, src, stages)
    memory[_past_float32(stages, len(src))] = np.nan
    return memory


def constrain(logp: np.ndarray, cfg: ModelConfig, constraints: Constraints, last: np.ndarray,
              first: bool = False) -> np.ndarray:
    """The search's log-probabilities [N, V] from the model's, Hugging Face's logits processors in
    its order: pad and the banned ids out (NoBadWords); with forced_first, at the first position
    (`first`) that token alone, at 0 (ForcedBOSTokenLogitsProcessor); with forced_eos, rows at their
    last allowed
    position (`last` [N]) keep eos alone, at 0 as ForcedEOSTokenLogitsProcessor sets it, whatever
    its log-probability; with renormalize, log_softmax over what is left (LogitNormalization,
    last). What is out gets NEG (finite, as Marian does; Hugging Face: -inf)."""
    banned = constraints.banned_ids(cfg)
    if constraints.forced_first is not None and first:
        is_forced = np.arange(logp.shape[-1]) == constraints.forced_first
        logp = np.where(is_forced, logp - logp, NEG)  # x - x: 0, NaN kept (as forced_eos below)
    if constraints.forced_eos:
        is_eos = np.arange(logp.shape[-1]) == cfg.eos_id
        # x - x: 0, but a NaN row (non-finite logits) stays NaN for check_scores to refuse
        logp = np.where(last[:, None], np.where(is_eos, logp - logp, NEG), logp)
    logp = logp.copy()
    logp[:, banned] = NEG
    if constraints.renormalize:
        logp = log_softmax(logp)  # exp(NEG - max) is 0: the sum runs over what is left
        logp[:, banned] = NEG
    return logp


def next_log_probs(params: Params, cfg: ModelConfig, memory: np.ndarray, src: np.ndarray,
                   tokens: np.ndarray, t: int, limits: np.ndarray,
                   constraints: Constraints = NO_CONSTRAINTS) -> np.ndarray:
    """[N, V] log-probabilities of the token at output position t, recomputing the whole
    prefix [bos, tokens[:, :t]] (no cache: the plain way), constrained for rows whose limit is
    `limits` [N]; NaN in rows past float32's range."""
    prefix = np.concatenate([np.full((len(tokens), 1), cfg.bos_id), tokens[:, :t]], axis=1)
    stages: dict[str, np.ndarray] = {}
    hidden = ref.decode(params, cfg, prefix, memory, src, stages)[:, -1:]
    logp = log_softmax(ref.generator(params, cfg, hidden)[:, 0])
    logp[_past_float32(stages, len(tokens))] = np.nan
    return constrain(logp, cfg, constraints, t + 1 >= limits, t == 0)


def greedy_search(params: Params, cfg: ModelConfig, src: np.ndarray, max_len_margin: int = 50,
                  constraints: Constraints = NO_CONSTRAINTS) -> Generation:
    B = src.shape[0]
    limits, L = output_limits(cfg, src, max_len_margin, constraints.max_new_tokens)
    memory = encode(params, cfg, src)
    tokens = np.full((B, L), cfg.pad_id)
    scores, done = np.zeros(B), np.zeros(B, dtype=bool)
    for t in range(L):
        logp = next_log_probs(params, cfg, memory, src, tokens, t, limits, constraints)
        best = logp.argmax(axis=-1)  # first maximum: the lower index wins ties
        scores = np.where(done, scores, scores + logp[np.arange(B), best])
        tokens[:, t] = np.where(done, cfg.pad_id, best)
        done |= (best == cfg.eos_id) | (t + 1 >= limits)
        if done.all():
            break
    return Generation(strip(cfg, tokens), scores)


def beam_search(params: Params, cfg: ModelConfig, src: np.ndarray, beam_size: int = 4,
                alpha: float = 0.6, max_len_margin: int = 50, rule: str = "wu",
                constraints: Constraints = NO_CONSTRAINTS) -> Generation:
    B, K = src.shape[0], beam_size
    limits, L = output_limits(cfg, src, max_len_margin, constraints.max_new_tokens)
    memory = np.repeat(encode(params, cfg, src), K, axis=0)  # beam k of sentence b: row b*K+k
    src_k = np.repeat(src, K, axis=0)
    seqs = np.full((B, K, L), cfg.pad_id)
    alive = np.tile([0.0] + [NEG] * (K - 1), (B, 1))  # only beam 0 expands at the first step
    fin_seqs, fin_scores = seqs.copy(), np.full((B, K), NEG)
    done, broken = np.zeros(B, dtype=bool), np.zeros(B, dtype=bool)
    for t in range(L):
        logp = next_log_probs(params, cfg, memory, src_k, seqs.reshape(B * K, L), t,
                              np.repeat(limits, K), constraints)
        V = logp.shape[-1]
        cand = (alive[:, :, None] + logp.reshape(B, K, V)).reshape(B, K * V)
        # A NaN candidate (non-finite logits) sorts last and would be dropped without a word:
        # the sentence's score becomes NaN instead, for the caller to refuse.
        broken |= ~done & np.isnan(cand).any(axis=-1)
        top = np.argsort(-cand, axis=-1, kind="stable")[:, : 2 * K]  # ties: lower index first
        top_logp = np.take_along_axis(cand, top, axis=-1)
        origin, token = top // V, top % V
        top_seqs = np.take_along_axis(seqs, origin[:, :, None], axis=1)
        top_seqs[:, :, t] = token
        final = (token == cfg.eos_id) | (t + 1 >= limits)[:, None]
        # Finished: keep the best K of the old finished and the new final candidates (Hugging
        # Face's rule takes them only from the top K of the 2K).
        finishes = final & (np.arange(2 * K) < K) if rule == "hf" else final
        new_scores = np.where(finishes, top_logp / length_penalty(t + 1, alpha, rule), NEG)
        all_scores = np.concatenate([fin_scores, new_scores], axis=1)
        keep = np.argsort(-all_scores, axis=-1, kind="stable")[:, :K]
        new_fin_scores = np.take_along_axis(all_scores, keep, axis=1)
        new_fin_seqs = np.take_along_axis(np.concatenate([fin_seqs, top_seqs], axis=1),
                                          keep[:, :, None], axis=1)
        # Alive: the best K candidates that did not finish.
        alive_cand = np.where(final, NEG, top_logp)
        keep = np.argsort(-alive_cand, axis=-1, kind="stable")[:, :K]
        new_alive = np.take_along_axis(alive_cand, keep, axis=1)
        new_seqs = np.take_along_axis(top_seqs, keep[:, :, None], axis=1)
        # Sentences already done keep their state.
        frozen = done[:, None]
        fin_scores = np.where(frozen, fin_scores, new_fin_scores)
        fin_seqs = np.where(frozen[:, :, None], fin_seqs, new_fin_seqs)
        alive = np.where(frozen, alive, new_alive)
        seqs = np.where(frozen[:, :, None], seqs, new_seqs)
        # Stop when no alive hypothesis can beat the worst kept finished one: log-probs only
        # fall and, for alpha >= 0, lp grows, so alive/lp(limit) bounds any future score.
        # Hugging Face's heuristic divides by lp of the current length instead.
        bound = length_penalty(t + 1 if rule == "hf" else limits, alpha, rule)
        hopeless = fin_scores[:, -1] >= alive[:, 0] / bound
        done |= (t + 1 >= limits) | hopeless
        if done.all():
            break
    return Generation(strip(cfg, fin_seqs[:, 0]), np.where(broken, np.nan, fin_scores[:, 0]))
