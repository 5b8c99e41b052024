"""Greedy and beam search in JAX with a fixed-size key/value cache: the encoder runs once and
the whole generation loop is one compiled `lax.while_loop` (no Python per token). Step for
step the algorithm of numpy_ref/decode.py (read its docstring first); `cache=False`
recomputes the whole prefix instead (for benchmarks). torch_impl/decode.py holds the same searches
in PyTorch, under the same names in the same order (parity_tests/test_structure.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_impl.model import LayerCache, Transformer, source_mask
from jax_impl.topk import beam_topk
from rosetta.config import ModelConfig
from rosetta.generation import (
    NEG,
    NO_CONSTRAINTS,
    Constraints,
    Generation,
    output_limits,
    strip,
)

# Issue 47's decoding levers (docs/decoding.md), on; False gives the search as it was before them
# (parity_tests/test_decode_levers.py compares the two; their speed effect is to be measured, not
# measured yet). Read when a search is called and passed as static arguments (one compilation each).
# TWO_STAGE_TOPK: beam search's exact top-2K in two stages (beam_topk). SHARED_CROSS: the
# cross-attention keys and values computed once per sentence, not per beam (Steps). torch_impl's
# STACKED_CACHE, STEP_ATTENTION and DROP_FINISHED have no twin here: they cut eager PyTorch's per-op
# dispatch, mask and kernel choice, and its batch; the JAX search is one XLA program with static
# shapes whose CPU attention is already plain dots (docs/decoding.md).
TWO_STAGE_TOPK = True
SHARED_CROSS = True
# Steps run between two evaluations of the loop's condition (`_search_loop`) on GPUs and TPUs, where
# each evaluation is a device-to-host copy of the predicate (issue 47); 1 on the CPU (no transfer
# there, and every step past the last sentence's end is wasted). torch_impl/decode.py's SYNC_EVERY.
SYNC_EVERY = 8


def length_penalty(length: jax.Array | int, alpha: float, rule: str = "wu") -> jax.Array:
    """lp(Y) = ((5 + |Y|) / 6)^alpha, Wu et al. 2016, eq. 14; |Y|^alpha for rule "hf"."""
    n = jnp.asarray(length, dtype=jnp.float32)
    return n**alpha if rule == "hf" else ((5.0 + n) / 6.0) ** alpha


def constrain(logp: jax.Array, cfg: ModelConfig, constraints: Constraints, last: jax.Array,
              banned: np.ndarray, first: jax.Array | bool = False) -> jax.Array:
    """numpy_ref/decode.py's `constrain` (Hugging Face's logits processors, in its order);
    `banned` is constraints.banned_ids(cfg), a constant of the compiled search; `first`: the first
    position (traced: no branch on its value)."""
    if constraints.forced_first is not None:
        is_forced = jnp.arange(logp.shape[-1]) == constraints.forced_first
        forced = jnp.where(is_forced, logp - logp, NEG)  # x - x: 0, NaN kept (as forced_eos below)
        logp = jnp.where(first, forced, logp)
    if constraints.forced_eos:
        is_eos = jnp.arange(logp.shape[-1]) == cfg.eos_id
        # x - x: 0, but a NaN row (non-finite logits) stays NaN for check_scores to refuse
        logp = jnp.where(last[:, None], jnp.where(is_eos, logp - logp, NEG), logp)
    logp = logp.at[:, banned].set(NEG)
    if constraints.renormalize:
        logp = jax.nn.log_softmax(logp, axis=-1)  # exp(NEG - max) is 0: the sum runs over what is left
        logp = logp.at[:, banned].set(NEG)
    return logp


class Steps:
    """next_log_probs(cache, tokens, t) -> ([N, V] log-probabilities of output position t for
    rows whose emitted tokens are `tokens` [N, L] and limits `limits` [N], constrained, new
    cache); `reorder(cache, rows)` follows the beams' reordering. Functional: the cache is loop
    state. `src` [B, S] and `memory` [B, S, d] are per sentence, the rows N = B x `beams` (beam k of
    sentence b: row b*beams + k); the cache's cross-attention keys and values stay per sentence
    (`shared`: SHARED_CROSS, ops.LayerCache.cross_attend), else they and the uncached path take them
    per row. The self-attention cache groups each sentence's rows whatever `shared` says
    (ops.LayerCache: its reordering stays within a sentence)."""

    def __init__(self, module: Transformer, src: jax.Array, memory: jax.Array, length: int,
                 limits: jax.Array, constraints: Constraints = NO_CONSTRAINTS, cache: bool = True,
                 beams: int = 1, shared: bool = True):
        self.beams, self.shared = beams, cache and shared
        self.module, self.sentences, self.cfg = module, memory, module.cfg  # memory per sentence
        if not self.shared:  # cross-attention (and the uncached path) a row a beam
            src, memory = jnp.repeat(src, beams, axis=0), jnp.repeat(memory, beams, axis=0)
        self.src, self.memory = src, memory
        self.limits, self.constraints = limits, constraints
        self.banned = constraints.banned_ids(self.cfg)
        self.use_cache, self.length = cache, length
        self.cross_mask = source_mask(src, self.cfg.pad_id)

    def init_cache(self) -> list[LayerCache]:
        if not self.use_cache:
            return []
        cache = self.module.init_cache(self.sentences, self.length, self.beams)
        if self.shared:
            return cache
        return [c._replace(cross_k=jnp.repeat(c.cross_k, self.beams, axis=0),
                           cross_v=jnp.repeat(c.cross_v, self.beams, axis=0)) for c in cache]

    def next_log_probs(self, cache: list[LayerCache], tokens: jax.Array,
                       t: jax.Array) -> tuple[jax.Array, list[LayerCache]]:
        bos = jnp.full_like(tokens[:, :1], self.cfg.bos_id)
        if self.use_cache:
            fed = jnp.where(t == 0, bos[:, 0], tokens[:, jnp.maximum(t - 1, 0)])
            logits, cache = self.module.decode_step(fed, t, cache, self.cross_mask)
        else:  # the plain way: the whole prefix again (static shape: causality hides > t)
            prefix = jnp.concatenate([bos, tokens[:, :-1]], axis=1)
            hidden = self.module.decode(prefix, self.memory, self.src)
            hidden = jax.lax.dynamic_slice_in_dim(hidden, t, 1, axis=1)
            logits = self.module.generator(hidden, self.module.tgt_table)[:, 0]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return constrain(logp, self.cfg, self.constraints, t + 1 >= self.limits, self.banned, t == 0), cache

    @staticmethod
    def reorder(cache: list[LayerCache], rows: jax.Array) -> list[LayerCache]:
        """The previous step's selection: new caches (ops.LayerCache.reorder)."""
        return [layer_cache.reorder(rows) for layer_cache in cache]


# XLA's CPU backend fuses the output projection with the log-softmax's max (a reduce) into one
# YNNPACK fusion that runs 2.5x slower than the projection alone: 63 ms of a 140 ms beam step of a
# base-sized model (benchmarks/decode_ct2.py, this project's CPU). The searches compile with
# YNNPACK's individual dots only, what XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=-reduce
# leaves of jax 0.10's default (3.8 s -> 2.7 s, the same tokens); training keeps the default
# (faster there: 2.8 s against 3.3 s a `small` step). And max/min without NaN propagation
# (xla_cpu_enable_fast_min_max): the log-softmax's max over [128, 32000] (XLA's reduce-windows) took
# 61 ms of a beam-4 search, 26 ms so (issue 55; the same tokens). A NaN among the logits still makes
# the row's log-probabilities NaN (x - max, the sum of exp): the searches' NaN check still sees it.
CPU_SEARCH_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
                      "xla_cpu_enable_fast_min_max": True}


def _search_jit(fn, static_argnames: tuple[str, ...]):
    """`jax.jit(fn)`, compiled with CPU_SEARCH_OPTIONS on a CPU; a jaxlib that does not know an
    option gets the plain compilation."""
    plain = jax.jit(fn, static_argnames=static_argnames)
    tuned = jax.jit(fn, static_argnames=static_argnames, compiler_options=CPU_SEARCH_OPTIONS)
    usable = [True]

    def call(*args, **kwargs):
        if usable[0] and jax.default_backend() == "cpu":
            try:
                return tuned(*args, **kwargs)
            except jax.errors.JaxRuntimeError as e:
                if not any(option in str(e) for option in CPU_SEARCH_OPTIONS):
                    raise
                usable[0] = False
        return plain(*args, **kwargs)

    return call


def _search_loop(body, init: tuple, length: int, done: int, every: int) -> tuple:
    """`init` through `body` while t (init[0]) < length and some sentence is not done (init[done]),
    the condition read every `every` steps: a lax.while_loop whose body is a fixed-length
    lax.fori_loop of `every` steps (XLA knows its trip count: no predicate goes to the host inside
    it). The up to every - 1 steps after the stop change nothing: a search freezes its finished
    sentences, and every sentence is finished once t reaches `length` (limits <= length), where the
    writes past the buffer are dropped (JAX's out-of-bounds scatter) or land in a cache no step reads
    again."""
    def keep_going(c: tuple) -> jax.Array:
        return (c[0] < length) & ~c[done].all()

    if every == 1:
        return jax.lax.while_loop(keep_going, body, init)
    def chunk(c: tuple) -> tuple:
        return jax.lax.fori_loop(0, every, lambda _, c: body(c), c)

    return jax.lax.while_loop(keep_going, chunk, init)


def _greedy_search(graphdef, state, src, limits, *, length: int, cache: bool, constraints: Constraints,
                   every: int = 1):
    module = nnx.merge(graphdef, state)
    cfg, B = module.cfg, src.shape[0]
    steps = Steps(module, src, module.encode(src), length, limits, constraints, cache)

    def body(carry):
        t, tokens, scores, done, kv = carry
        logp, kv = steps.next_log_probs(kv, tokens, t)
        best = jnp.argmax(logp, axis=-1)  # first maximum: the lower index wins ties
        scores = jnp.where(done, scores, scores + jnp.take_along_axis(logp, best[:, None], 1)[:, 0])
        tokens = tokens.at[:, t].set(jnp.where(done, cfg.pad_id, best))
        done = done | (best == cfg.eos_id) | (t + 1 >= limits)
        return t + 1, tokens, scores, done, kv

    init = (0, jnp.full((B, length), cfg.pad_id), jnp.zeros(B), jnp.zeros(B, bool), steps.init_cache())
    _, tokens, scores, _, _ = _search_loop(body, init, length, 3, every)
    return tokens, scores


_greedy = _search_jit(_greedy_search, ("graphdef", "length", "cache", "constraints", "every"))


def _beam_search(graphdef, state, src, limits, *, beam_size: int, alpha: float, length: int, cache: bool,
                 rule: str, constraints: Constraints, two_stage: bool = True, shared: bool = True,
                 every: int = 1):
    module = nnx.merge(graphdef, state)
    cfg, B, K, L = module.cfg, src.shape[0], beam_size, length
    # Beam k of sentence b: row b*K+k; the encoder's output stays per sentence (Steps).
    steps = Steps(module, src, module.encode(src), L, jnp.repeat(limits, K), constraints, cache,
                  beams=K, shared=shared)

    def body(carry):
        t, seqs, alive, fin_seqs, fin_scores, done, broken, kv = carry
        logp, kv = steps.next_log_probs(kv, seqs.reshape(B * K, L), t)
        V = logp.shape[-1]
        cand = alive[:, :, None] + logp.reshape(B, K, V)
        broken = broken | (~done & jnp.isnan(cand).any(axis=(1, 2)))  # non-finite logits (see numpy_ref)
        top_logp, top = beam_topk(cand, 2 * K, two_stage)  # ties: lower index first
        origin, token = top // V, top % V
        top_seqs = jnp.take_along_axis(seqs, origin[:, :, None], axis=1).at[:, :, t].set(token)
        final = (token == cfg.eos_id) | (t + 1 >= limits)[:, None]
        # Finished: keep the best K of the old finished and the new final candidates (Hugging
        # Face's rule takes them only from the top K of the 2K).
        finishes = final & (jnp.arange(2 * K) < K) if rule == "hf" else final
        new_scores = jnp.where(finishes, top_logp / length_penalty(t + 1, alpha, rule), NEG)
        new_fin_scores, keep = jax.lax.top_k(jnp.concatenate([fin_scores, new_scores], axis=1), K)
        new_fin_seqs = jnp.take_along_axis(jnp.concatenate([fin_seqs, top_seqs], axis=1),
                                           keep[:, :, None], axis=1)
        # Alive: the best K candidates that did not finish.
        new_alive, keep = jax.lax.top_k(jnp.where(final, NEG, top_logp), K)
        new_seqs = jnp.take_along_axis(top_seqs, keep[:, :, None], axis=1)
        kv = steps.reorder(kv, (jnp.arange(B)[:, None] * K
                                + jnp.take_along_axis(origin, keep, axis=1)).reshape(-1))
        # Sentences already done keep their state.
        frozen = done[:, None]
        fin_scores = jnp.where(frozen, fin_scores, new_fin_scores)
        fin_seqs = jnp.where(frozen[:, :, None], fin_seqs, new_fin_seqs)
        alive = jnp.where(frozen, alive, new_alive)
        seqs = jnp.where(frozen[:, :, None], seqs, new_seqs)
        # Stop when no alive hypothesis can beat the worst kept finished one (see numpy_ref).
        bound = length_penalty(t + 1 if rule == "hf" else limits, alpha, rule)
        hopeless = fin_scores[:, -1] >= alive[:, 0] / bound
        done = done | (t + 1 >= limits) | hopeless
        return t + 1, seqs, alive, fin_seqs, fin_scores, done, broken, kv

    seqs = jnp.full((B, K, L), cfg.pad_id)
    alive = jnp.tile(jnp.array([0.0] + [NEG] * (K - 1)), (B, 1))  # beam 0 expands first
    init = (0, seqs, alive, seqs, jnp.full((B, K), NEG), jnp.zeros(B, bool), jnp.zeros(B, bool),
            steps.init_cache())
    out = _search_loop(body, init, L, 5, every)
    return out[3][:, 0], jnp.where(out[6], jnp.nan, out[4][:, 0])


_beam = _search_jit(_beam_search, ("graphdef", "beam_size", "alpha", "length", "cache", "rule",
                                   "constraints", "two_stage", "shared", "every"))


def greedy_search(graphdef, state, cfg: ModelConfig, src: np.ndarray, max_len_margin: int = 50,
                  cache: bool = True, constraints: Constraints = NO_CONSTRAINTS) -> Generation:
    limits, L = output_limits(cfg, src, max_len_margin, constraints.max_new_tokens)
    tokens, scores = _greedy(graphdef, state, src, limits, length=L, cache=cache, constraints=constraints,
                             every=_sync_every())
    return Generation(strip(cfg, np.asarray(tokens)), np.asarray(scores, dtype=np.float64))


def beam_search(graphdef, state, cfg: ModelConfig, src: np.ndarray, beam_size: int = 4,
                alpha: float = 0.6, max_len_margin: int = 50, cache: bool = True,
                rule: str = "wu", constraints: Constraints = NO_CONSTRAINTS) -> Generation:
    limits, L = output_limits(cfg, src, max_len_margin, constraints.max_new_tokens)
    tokens, scores = _beam(graphdef, state, src, limits, beam_size=beam_size, alpha=float(alpha),
                           length=L, cache=cache, rule=rule, constraints=constraints,
                           two_stage=TWO_STAGE_TOPK, shared=SHARED_CROSS, every=_sync_every())
    return Generation(strip(cfg, np.asarray(tokens)), np.asarray(scores, dtype=np.float64))


def _sync_every() -> int:
    """SYNC_EVERY on GPUs and TPUs, 1 on the CPU (see SYNC_EVERY)."""
    return 1 if jax.default_backend() == "cpu" else SYNC_EVERY
