"""Greedy and beam search in PyTorch with a preallocated key/value cache: the encoder runs
once, each step feeds one token. Step for step the algorithm of numpy_ref/decode.py (read its
docstring first); `cache=False` recomputes the whole prefix instead (for benchmarks).

Each search is, as in jax_impl/decode.py, an initial state and `body(state) -> state`: one step
(the decoder step, the float32 log-softmax, the constraints, the selection, the beams' cache
reordering, the freezing of finished sentences), run by a Python loop (`run`). Eager, body gets an
int t and reads the host where that is faster (topk_stable's fast path, attention over positions
<= t only, a stop as soon as every sentence is done). Compiled (`compiled=True`), body is captured
whole once (torch_impl/compilation.py: fullgraph; CUDA graphs on GPUs through "reduce-overhead")
with no host read and no branch on data: t is a 0-d tensor on the device, the top-k the exact keys'
one, the key/value cache static (written and reordered in place, attended whole with positions > t
masked), and `done` is read every SYNC_EVERY steps only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rosetta.config import ModelConfig
from rosetta.generation import (
    NEG,
    NO_CONSTRAINTS,
    Constraints,
    Generation,
    output_limits,
    strip,
)
from torch_impl import compilation
from torch_impl.model import Transformer, source_mask
from torch_impl.ops import fused_linear, reorder_stack
from torch_impl.topk import beam_topk, ranked_on_logits, second_stage, topk_exact, topk_stable

State = tuple[torch.Tensor | int, ...]  # (t, done, ...): the step, sentences finished [B], the rest

# How often a compiled search reads `done` on the host to stop early. A step after every sentence
# is done changes nothing (finished sentences are frozen), so up to SYNC_EVERY - 1 extra steps cost
# time, never tokens; each read is a host sync that a CUDA graph replay would otherwise not wait for.
SYNC_EVERY = 8

# Issue 47's decoding levers (docs/decoding.md), on; False gives the search as it was before them
# (parity_tests/test_decode_levers.py compares the two; their speed effect is to be measured, not
# measured yet). TWO_STAGE_TOPK: beam search's exact top-2K in two stages (beam_topk). SHARED_CROSS:
# the cross-attention keys and values computed once per sentence, not per beam (Steps).
# STACKED_CACHE: beam search reorders every layer's self-attention cache (one tensor: ops.LayerCache)
# by one gather a step, not one per layer and keys/values (Steps.reorder). STEP_ATTENTION, eager:
# the decoder step's attention by plain matmuls, no mask where nothing is masked (ops.LayerCache's
# self_attend and cross_attend); with FUSED_QKV too, q, k and v from one GEMM over weights
# concatenated once per search. DROP_FINISHED, eager: finished sentences leave the batch, their
# results kept (run).
TWO_STAGE_TOPK = True
SHARED_CROSS = True
STACKED_CACHE = True
STEP_ATTENTION = True  # issue 55: SDPA's CPU kernel took 2x plain matmuls for these shapes (docs/decoding.md)
FUSED_QKV = False  # off: slower in whole beam-4 calls on the 2-core AMD EPYC (docs/decoding.md)
DROP_FINISHED = True
# Issue 55's, eager beam search on a CPU: FIRST_ONE_ROW, step 0 on one row a sentence, not K equal ones
# (Steps.one_row_first; with SHARED_CROSS, whose keys are a sentence's). RANK_LOGITS, from step 1: each
# beam's top 2K ranked on its logits, the scores added to those 2K only, not over [B, K, V], and no NaN
# sum over them (topk.ranked_on_logits; the general path where it cannot tell).
FIRST_ONE_ROW = True
RANK_LOGITS = True


def length_penalty(length: torch.Tensor | int, alpha: float, rule: str = "wu") -> torch.Tensor:
    """lp(Y) = ((5 + |Y|) / 6)^alpha, Wu et al. 2016, eq. 14; |Y|^alpha for rule "hf"."""
    n = torch.as_tensor(length, dtype=torch.float32)
    return n**alpha if rule == "hf" else ((5.0 + n) / 6.0) ** alpha


def constrain(logp: torch.Tensor, cfg: ModelConfig, constraints: Constraints, last: torch.Tensor,
              banned: torch.Tensor, first: bool | torch.Tensor = False) -> torch.Tensor:
    """numpy_ref/decode.py's `constrain` (Hugging Face's logits processors, in its order);
    `banned` is constraints.banned_ids(cfg) on logp's device, built once per search; `first`: the
    first position (a 0-d tensor in a compiled step: no branch on its value)."""
    if constraints.forced_first is not None and (not isinstance(first, bool) or first):
        is_forced = torch.arange(logp.shape[-1], device=logp.device) == constraints.forced_first
        forced = torch.where(is_forced, logp - logp, NEG)  # x - x: 0, NaN kept (as forced_eos below)
        logp = forced if isinstance(first, bool) else torch.where(first, forced, logp)
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
    emitted tokens are `tokens` [N, L], constrained; `reorder(rows, t)` follows the beams'
    reordering; `keep(sentences)` drops the others (DROP_FINISHED). t is an int (eager) or a 0-d
    tensor (a compiled step). `static`: the tensors a compiled step reads keep their addresses
    (mark_static_address, as Hugging Face's StaticCache), so that CUDA graphs mutate the cache in
    place and copy none of them per replay. `src` [B, S], `memory` [B, S, d] and `limits` [B] are
    per sentence (`sentence_limits`; `limits`: per row), the rows N = B x `beams` (beam k of
    sentence b: row b*beams + k); the cache's cross-attention keys and values stay per sentence
    (SHARED_CROSS, ops.LayerCache.cross_attend), else they and the uncached path take them per row."""

    def __init__(self, module: Transformer, src: torch.Tensor, memory: torch.Tensor, length: int,
                 limits: torch.Tensor, constraints: Constraints = NO_CONSTRAINTS, cache: bool = True,
                 static: bool = False, beams: int = 1):
        self.beams = beams if cache and SHARED_CROSS else 1  # self-attention rows a sentence's cache has
        if self.beams != beams:
            src, memory = src.repeat_interleave(beams, dim=0), memory.repeat_interleave(beams, dim=0)
        self.module, self.src, self.memory, self.cfg = module, src, memory, module.cfg
        self.per_sentence, self.sentence_limits, self.limits = beams, limits, limits.repeat_interleave(beams)
        self.constraints = constraints
        self.banned = torch.as_tensor(constraints.banned_ids(self.cfg), device=src.device)
        module.position_table(length)  # grown here if too short, never inside a compiled step
        self.cache = module.init_cache(memory, length, self.beams) if cache else None
        self.full = self.cache[0].stack if cache else None  # the stacked cache's buffer (reorder)
        self.spare: torch.Tensor | None = None
        self.logp: torch.Tensor | None = None  # log_softmax's output buffer [rows, V], eager
        self.first_rows = 0  # one_row_first: the beams a sentence's one row of step 0 stands for
        self.cross_mask = source_mask(src, self.cfg.pad_id)
        if self.cache and STEP_ATTENTION and not static:  # eager: the single-query path
            for layer, layer_cache in zip(module.decoder.layers, self.cache, strict=True):
                layer_cache.plain = True
                if FUSED_QKV:
                    attention = layer.self_attn
                    rows = len(self.limits)  # what oneDNN packs the fused weight for
                    layer_cache.fused_qkv = fused_linear([attention.q, attention.k, attention.v], rows)
            self.cross_mask = None if bool(self.cross_mask.all()) else self.cross_mask  # no padding
        if static:
            import torch._dynamo as dynamo  # compiling: imported here, not at start (compilation.py)

            for x in self.tensors():
                dynamo.mark_static_address(x)

    def tensors(self) -> list[torch.Tensor]:
        """What a compiled step reads besides the state and the weights."""
        caches = [x for layer_cache in self.cache or [] for x in layer_cache.tensors()[1:]]
        stack = [self.cache[0].stack] if self.cache else []  # every layer's (ops.LayerCache)
        return [self.limits, self.sentence_limits, self.banned, self.cross_mask, *stack, *caches]

    def next_log_probs(self, tokens: torch.Tensor, t: int | torch.Tensor) -> torch.Tensor:
        return self.log_probs(self.logits(tokens, t), t, self.limits)

    def log_probs(self, logits: torch.Tensor, t: int | torch.Tensor, limits: torch.Tensor,
                  logp: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 log-softmax of `logits` [N, V] (or `logp`, already taken), constrained in place
        (`limits` [N]: each row's length limit)."""
        logp = self.log_softmax(logits, t) if logp is None else logp
        return constrain(logp, self.cfg, self.constraints, t + 1 >= limits, self.banned, t == 0)

    def log_softmax(self, logits: torch.Tensor, t: int | torch.Tensor) -> torch.Tensor:
        """The float32 log-softmax of `logits` [N, V]. Eager, into one buffer kept for the search: a new
        [N, V] float32 tensor a step (16 MB at 128 rows of 32,000) came in new pages from the allocator,
        a third of the log-softmax's time on a CPU (issue 55). The step's caller may change it in
        place; the next step overwrites it. A compiled step allocates (no state mutated in a graph)."""
        logits = logits.float()
        if not isinstance(t, int):
            return torch.log_softmax(logits, dim=-1)
        if self.logp is None or self.logp.shape[0] < len(logits) or self.logp.shape[1:] != logits.shape[1:]:
            self.logp = torch.empty_like(logits)
        return torch.log_softmax(logits, dim=-1, out=self.logp[:len(logits)])

    def one_row_first(self) -> bool:
        """Eager beam search's step 0 on one row a sentence (FIRST_ONE_ROW): every beam of a sentence
        feeds the same start token over the same empty cache, so its K rows would be K copies of one.
        The self-attention cache shows its first B rows for that step; the next `reorder` takes row
        b for each beam of sentence b (CTranslate2 expands its beams after the first step too).
        False where the rows are not per sentence (no cache, or the cross-attention kept per row)."""
        if not (FIRST_ONE_ROW and self.cache and self.beams > 1):
            return False
        sentences = len(self.sentence_limits)
        for layer_cache in self.cache:
            layer_cache.stack = self.full[:, :, :sentences]
        self.first_rows = self.beams
        return True

    def logits(self, tokens: torch.Tensor, t: int | torch.Tensor) -> torch.Tensor:
        """The decoder's logits [N, V] of output position t for rows whose emitted tokens are `tokens`."""
        bos = torch.full_like(tokens[:, :1], self.cfg.bos_id)
        if self.cache is not None:
            if isinstance(t, int):
                fed = bos[:, 0] if t == 0 else tokens[:, t - 1]
            else:  # no branch on t's value (jax_impl's jnp.where)
                fed = torch.where(t == 0, bos[:, 0], column(tokens, (t - 1).clamp(min=0)))
            logits = self.module.decode_step(fed, t, self.cache, self.cross_mask)
        else:  # the plain way: the whole prefix again (eager only: an int t)
            prefix = torch.cat([bos, tokens[:, :t]], dim=1)
            hidden = self.module.decode(prefix, self.memory, self.src)[:, -1:]
            logits = self.module.generator(hidden, self.module.tgt_table)[:, 0]
        return logits.float()

    def reorder(self, rows: torch.Tensor, t: int | torch.Tensor) -> None:
        """At the start of step t, the previous step's selection, in place: with STACKED_CACHE (or
        fewer rows: dropped sentences), every layer's by one gather (ops.reorder_stack), else layer by
        layer (ops.LayerCache.reorder)."""
        if not self.cache:
            return
        if self.first_rows:  # after one_row_first's step: beam k of sentence b reads row b
            rows, self.first_rows = rows // self.first_rows, 0
        stack = self.cache[0].stack
        if not STACKED_CACHE and len(rows) == stack.shape[2]:
            for layer_cache in self.cache:
                layer_cache.reorder(rows, t)
            return
        if not isinstance(t, int):  # compiled: in place
            reorder_stack(stack, rows, t)
            return
        # Eager: into the other of two buffers (allocated at the first reorder), which becomes the stack.
        self.spare = torch.empty_like(self.full) if self.spare is None else self.spare
        kept = reorder_stack(stack, rows, t, self.spare)
        self.full, self.spare = self.spare, self.full
        for layer_cache in self.cache:
            layer_cache.stack = kept

    def keep(self, sentences: torch.Tensor) -> None:
        """Only `sentences` (indices into the current batch, ascending) go on (DROP_FINISHED, eager):
        their rows of the limits and of the cross-attention keys, values and mask. The self-attention
        cache follows at the next `reorder`, given the kept sentences' rows."""
        def rows(per: int) -> torch.Tensor:  # the rows of `sentences`, `per` a sentence
            return (sentences[:, None] * per + torch.arange(per, device=sentences.device)).view(-1)

        self.sentence_limits = self.sentence_limits[sentences]
        self.limits = self.limits[rows(self.per_sentence)]
        cross = rows(self.per_sentence // self.beams)
        self.cross_mask = None if self.cross_mask is None else self.cross_mask[cross]
        for layer_cache in self.cache or []:
            layer_cache.cross_k, layer_cache.cross_v = layer_cache.cross_k[cross], layer_cache.cross_v[cross]


def column(x: torch.Tensor, t: int | torch.Tensor) -> torch.Tensor:
    """x[..., t]; a tensor t is gathered (static shapes, no host read)."""
    return x[..., t] if isinstance(t, int) else x.index_select(-1, t.view(1))[..., 0]


def put_column(x: torch.Tensor, t: int | torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """x with x[..., t] = value: in place for an int t; a new tensor for a tensor t (a compiled
    step mutates no state it is given: CUDA graphs would copy it back or skip the graph)."""
    if isinstance(t, int):
        x[..., t] = value
        return x
    return x.index_copy(x.dim() - 1, t.view(1), value[..., None])


# A search's way to drop finished sentences (DROP_FINISHED): (subset, results), where subset(state,
# kept) is the state of the kept sentences only (the indices into the batch, ascending; it tells Steps
# too), and `results` the indices of the state's per-sentence entries the search returns.
Drop = tuple[Callable[[State, torch.Tensor], State], tuple[int, ...]]


def run(body: Callable[[State], State], state: State, length: int, compiled: bool,
        dynamic: list[tuple[torch.Tensor, tuple[int, ...]]], drop: Drop | None = None) -> State:
    """`state = body(state)` for t = 0 .. length - 1, stopping once every sentence is done (state[1]).
    Eager: body gets an int t and `done` is read every step; with `drop` (and DROP_FINISHED), the
    finished sentences leave the state (`drop_finished`). Compiled: body is compiled once for
    all steps (and, guards permitting, for later searches), t is a 0-d tensor on the device, `done`
    is read every SYNC_EVERY steps. `dynamic`: (tensor, dims) whose sizes vary from search to
    search (rows N, source length S, cache length L), marked dynamic before the first call."""
    if not compiled:
        return drop_finished(body, state, length, drop if DROP_FINISHED else None)
    device = state[1].device
    # Dynamic shapes: `dynamic=None` (automatic) plus maybe_mark_dynamic on N, S and L, so that the
    # first graph is already general in them and the other sizes (heads, widths, the beam) stay
    # static: one graph per search kind whatever the batch and lengths, plus a graph each for the
    # sizes dynamo specializes (0 and 1: a one-sentence batch, a one-token cache) and for sizes
    # equal by chance in the first call (duck sizing); dynamic=False would compile one graph per
    # (N, S, L), and dynamic=True would make the constant sizes symbolic too.
    import torch._dynamo as dynamo  # compiling: imported here, not at start (compilation.py)

    for x, dims in dynamic:
        for dim in dims:
            dynamo.maybe_mark_dynamic(x, dim)
    step = compilation.compiled(body, dynamic=None, mode="reduce-overhead" if device.type == "cuda" else None)
    state = (torch.zeros((), dtype=torch.int64, device=device), *state[1:])
    for i in range(length):
        # CUDA graphs (torch.compiler_cudagraph_trees): a replay overwrites the previous replay's
        # outputs, so each step starts a new generation and the small state is cloned out of the
        # graph's memory before the next replay (the documented remedy; no-ops on a CPU but the clone).
        torch.compiler.cudagraph_mark_step_begin()
        state = tuple(x.clone() for x in step(state))
        if i % SYNC_EVERY == SYNC_EVERY - 1 and bool(state[1].all()):
            break
    return state


def drop_finished(body: Callable[[State], State], state: State, length: int, drop: Drop | None) -> State:
    """run's eager loop. With `drop`, after a step that finished some sentence but not all, the state
    and the cache keep the others' rows only: a finished sentence's state is frozen (the searches'
    `where(done, ...)`), so the steps it leaves would not change it; its returned entries are copied
    into full-batch tensors first, which the returned state holds (its other entries: the last kept
    sentences' only). The same tokens and scores, up to the GEMMs' summation order over fewer rows."""
    index, results = None, {}  # each state row's sentence of the whole batch; the returned entries
    for _ in range(length):
        state = body(state)
        done = state[1]
        if bool(done.all()):
            break
        if drop is not None and bool(done.any()):
            subset, returned = drop
            if index is None:
                index = torch.arange(len(done), device=done.device)
                results = {i: state[i].clone() for i in returned}
            for i in returned:
                results[i][index] = state[i]
            kept = (~done).nonzero()[:, 0]
            state, index = subset(state, kept), index[kept]
    if index is None:
        return state
    for i, x in results.items():
        x[index] = state[i]
    return tuple(results.get(i, x) for i, x in enumerate(state))


def greedy_search(module: Transformer, cfg: ModelConfig, src: torch.Tensor, max_len_margin: int = 50,
                  cache: bool = True, constraints: Constraints = NO_CONSTRAINTS,
                  compiled: bool = False) -> Generation:
    """`compiled` with `cache` only (the uncached way is a benchmark, eager)."""
    B, dev, compiled = src.shape[0], src.device, compiled and cache
    limits_np, L = output_limits(cfg, src.cpu().numpy(), max_len_margin, constraints.max_new_tokens)
    limits = torch.as_tensor(limits_np, device=dev)
    steps = Steps(module, src, module.encode(src), L, limits, constraints, cache, static=compiled)

    def body(state: State) -> State:
        t, done, tokens, scores = state
        logp = steps.next_log_probs(tokens, t)
        best = logp.argmax(dim=-1)  # first maximum: the lower index wins ties
        scores = torch.where(done, scores, scores + logp.gather(1, best[:, None])[:, 0])
        tokens = put_column(tokens, t, torch.where(done, cfg.pad_id, best))
        done = done | (best == cfg.eos_id) | (t + 1 >= steps.sentence_limits)
        return t + 1, done, tokens, scores

    def subset(state: State, kept: torch.Tensor) -> State:  # DROP_FINISHED (run)
        t, done, tokens, scores = state
        steps.keep(kept)
        steps.reorder(kept, t)  # a row a sentence: the cache keeps the kept rows now
        return t, done[kept], tokens[kept], scores[kept]

    init = (0, torch.zeros(B, dtype=torch.bool, device=dev), torch.full((B, L), cfg.pad_id, device=dev),
            torch.zeros(B, device=dev))
    dynamic = [(init[1], (0,)), (init[2], (0, 1)), (init[3], (0,)), *_dynamic_dims(steps)]
    _, _, tokens, scores = run(body, init, L, compiled, dynamic, (subset, (2, 3)) if cache else None)
    return Generation(strip(cfg, tokens.cpu().numpy()), scores.double().cpu().numpy())


def beam_search(module: Transformer, cfg: ModelConfig, src: torch.Tensor, beam_size: int = 4,
                alpha: float = 0.6, max_len_margin: int = 50, cache: bool = True,
                rule: str = "wu", constraints: Constraints = NO_CONSTRAINTS,
                compiled: bool = False) -> Generation:
    """`compiled` with `cache` only (the uncached way is a benchmark, eager)."""
    B, K, dev, compiled = src.shape[0], beam_size, src.device, compiled and cache
    limits_np, L = output_limits(cfg, src.cpu().numpy(), max_len_margin, constraints.max_new_tokens)
    limits = torch.as_tensor(limits_np, device=dev)
    # Beam k of sentence b: row b*K+k; the encoder's output stays per sentence (Steps).
    steps = Steps(module, src, module.encode(src), L, limits, constraints, cache, static=compiled, beams=K)
    topk = topk_exact if compiled else topk_stable

    def body(state: State) -> State:
        t, done, broken, rows, seqs, alive, fin_seqs, fin_scores = state
        B, L = seqs.shape[0], seqs.shape[2]  # from the state: sizes a compiled step keeps dynamic
        limits = steps.sentence_limits  # per sentence (of those left: DROP_FINISHED)
        # The cache follows the previous step's selection now, before this step writes it (jax_impl
        # reorders at the end of a step: the same order of operations; see ops.LayerCache.reorder).
        steps.reorder(rows, t)
        eager = isinstance(t, int)
        first = eager and t == 0 and steps.one_row_first()  # every beam's row the same: one a sentence
        logits = steps.logits(seqs[:, 0] if first else seqs.view(B * K, L), t)
        V = logits.shape[-1]
        ranked, logp = None, steps.log_softmax(logits, t)
        if eager and RANK_LOGITS and not first and not steps.constraints.renormalize \
                and not (steps.constraints.forced_first is not None and t == 0) \
                and not (steps.constraints.forced_eos and bool((t + 1 >= steps.limits).any())):
            ranked = ranked_on_logits(logits, logp, alive, steps.banned, 2 * K)
        if ranked is not None:  # every row's log-softmax finite: no sentence broke
            top_logp, top = second_stage(*ranked, V, topk)
        else:
            logp = steps.log_probs(logits, t, limits if first else steps.limits, logp)
            logp = logp[:, None].expand(B, K, V) if first else logp.view(B, K, V)
            # In place where logp is this step's own; step 0's one row a sentence stands for K beams.
            cand = logp + alive[:, :, None] if first else logp.add_(alive[:, :, None])
            # Non-finite logits (numpy_ref): a NaN in a sentence's cand. By the sum over V, one read of it:
            # cand holds no +inf (log-probabilities <= 0, scores <= 0, -inf at worst), so a sum is NaN
            # exactly where a term is (a bool pass and a reduction over [B, K, V] took 3 ms a step).
            broken = broken | (~done & cand.sum(dim=-1).isnan().any(dim=-1))
            top_logp, top = beam_topk(cand, 2 * K, topk, TWO_STAGE_TOPK)
        origin, token = top // V, top % V
        top_seqs = put_column(seqs.gather(1, origin[:, :, None].expand(B, 2 * K, L)), t, token)
        final = (token == cfg.eos_id) | (t + 1 >= limits)[:, None]
        # Finished: keep the best K of the old finished and the new final candidates (Hugging
        # Face's rule takes them only from the top K of the 2K).
        finishes = final & (torch.arange(2 * K, device=dev) < K) if rule == "hf" else final
        new_scores = torch.where(finishes, top_logp / length_penalty(t + 1, alpha, rule), NEG)
        new_fin_scores, keep = topk(torch.cat([fin_scores, new_scores], dim=1), K)
        new_fin_seqs = torch.cat([fin_seqs, top_seqs], dim=1).gather(1, keep[:, :, None].expand(B, K, L))
        # Alive: the best K candidates that did not finish.
        new_alive, keep = topk(torch.where(final, NEG, top_logp), K)
        new_seqs = top_seqs.gather(1, keep[:, :, None].expand(B, K, L))
        rows = (torch.arange(B, device=dev)[:, None] * K + origin.gather(1, keep)).view(-1)
        # Sentences already done keep their state.
        frozen = done[:, None]
        fin_scores = torch.where(frozen, fin_scores, new_fin_scores)
        fin_seqs = torch.where(frozen[:, :, None], fin_seqs, new_fin_seqs)
        alive = torch.where(frozen, alive, new_alive)
        seqs = torch.where(frozen[:, :, None], seqs, new_seqs)
        # Stop when no alive hypothesis can beat the worst kept finished one (see numpy_ref).
        bound = length_penalty(t + 1 if rule == "hf" else limits, alpha, rule)
        hopeless = fin_scores[:, -1] >= alive[:, 0] / bound
        done = done | (t + 1 >= limits) | hopeless
        return t + 1, done, broken, rows, seqs, alive, fin_seqs, fin_scores

    def subset(state: State, kept: torch.Tensor) -> State:  # DROP_FINISHED (run)
        t, done, broken, rows, *rest = state
        steps.keep(kept)
        rows = rows.view(-1, K)[kept].view(-1)  # the next reorder gathers these rows only
        return (t, done[kept], broken[kept], rows, *(x[kept] for x in rest))

    seqs = torch.full((B, K, L), cfg.pad_id, device=dev)
    alive = torch.tensor([0.0] + [NEG] * (K - 1), device=dev).repeat(B, 1)  # beam 0 expands first
    no = torch.zeros(B, dtype=torch.bool, device=dev)
    rows = torch.arange(B * K, device=dev)  # cache rows: each its own before the first step
    init = (0, no, no.clone(), rows, seqs, alive, seqs.clone(), torch.full((B, K), NEG, device=dev))
    dynamic = [(x, (0,)) for x in init[1:]] + [(init[4], (2,)), (init[6], (2,))]
    dynamic += _dynamic_dims(steps)
    drop = (subset, (2, 6, 7)) if cache else None
    _, _, broken, _, _, _, fin_seqs, fin_scores = run(body, init, L, compiled, dynamic, drop)
    scores = torch.where(broken, torch.nan, fin_scores[:, 0])
    return Generation(strip(cfg, fin_seqs[:, 0].cpu().numpy()), scores.double().cpu().numpy())


def _dynamic_dims(steps: Steps) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    """The sizes of a search's tensors that vary between searches: rows N, S, L (Steps.tensors)."""
    dims = [(steps.limits, (0,)), (steps.sentence_limits, (0,)), (steps.cross_mask, (0, 3))]
    dims += [(steps.cache[0].stack, (2, 4))] if steps.cache else []  # rows N, length L
    for c in steps.cache or []:
        dims += [(c.cross_k, (0, 2)), (c.cross_v, (0, 2))]
    return dims
