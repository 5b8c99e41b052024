"""Issue 47's decoding levers (docs/decoding.md) change no token and no score beyond summation order:
the two-stage top-k of beam search (decode.beam_topk) against numpy's stable argsort over the flat
K x V candidates and against the one-stage top-k; the searches with the levers on against the float64
reference (numpy_ref) and against the searches with them off (decode.TWO_STAGE_TOPK, SHARED_CROSS,
and PyTorch's STACKED_CACHE, STEP_ATTENTION, DROP_FINISHED: the path before issue 47), greedy and beam
4, float32, both frameworks, eager and PyTorch's static step, and PyTorch's new levers one at a time on
sentences that finish at different steps (the batch shrinking as they do); the step's attention against
eq. 1; the stacked cache's one gather a step (counted; its compiled update through inductor:
parity_tests/test_decode_compiled.py); and bfloat16 weights cast once per model, never inside the search
loop (a dispatch count in PyTorch, the loop's jaxpr in JAX); JAX's loop reading its condition every few
steps changes nothing. Speed effects: not measured here (benchmarks/decode_ct2.py, a GPU session)."""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.test_decoding import SCORE_TOLERANCE, _decision_margin, _perturbed
from rosetta import from_params, preset
from rosetta.generation import NEG
from rosetta.parity import random_batch

# Levers on against off, float32: the tokens are equal and the scores differ only where the same
# products are summed in another order (a sentence's K beams as K queries of one cross-attention GEMM
# instead of K GEMMs of one row; attention by two matmuls instead of SDPA's kernel; q, k and v from one
# GEMM; fewer rows once finished sentences leave); the top-k and the reorders move values, they
# compute none. Each log-probability then moves by a few float32 eps (1.2e-7) of the logits' size,
# and a score, a sum of a few such terms over a length penalty, by as much relative to itself: 1e-6,
# as parity_tests/test_decode_compiled.py bounds another summation order of the same step.
LEVERS_SCORE_RTOL = 1e-6
# Each framework's lever switches (module constants of its decode.py; off: the search before them).
LEVERS = {"torch": ("TWO_STAGE_TOPK", "SHARED_CROSS", "STACKED_CACHE", "STEP_ATTENTION", "FUSED_QKV",
                   "DROP_FINISHED", "FIRST_ONE_ROW", "RANK_LOGITS"),
          "jax": ("TWO_STAGE_TOPK", "SHARED_CROSS")}


def _flat_ranking(cand: np.ndarray, k: int, signed_zeros: bool = False) -> np.ndarray:
    """The independent oracle: each sentence's K x V candidates ranked by value, descending, ties to
    the lower flat index (numpy's stable sort), and with `signed_zeros` 0.0 above -0.0 (they compare
    equal in numpy and in torch_impl's keys; jax.lax.top_k, XLA's total order, ranks 0.0 first, as
    JAX's search did before issue 47 too)."""
    flat = cand.reshape(cand.shape[0], -1)
    index = np.broadcast_to(np.arange(flat.shape[1]), flat.shape)
    sign = np.signbit(flat) if signed_zeros else np.zeros(flat.shape, bool)
    return np.stack([np.lexsort((i, z, -x)) for i, z, x in zip(index, sign, flat, strict=True)])[:, :k]


def _candidates(rng, B=16, K=4, V=50) -> np.ndarray:
    """Candidate scores [B, K, V] full of ties: within a beam, across beams, at the top-k boundary;
    -0.0 beside 0.0, the search's NEG and -inf; beams equal to one another (the first step's)."""
    cand = rng.integers(-4, 4, size=(B, K, V)).astype(np.float32) * 0.5
    cand[0, :, :5] = [-0.0, 0.0, -0.0, NEG, -np.inf]
    cand[1] = cand[1, 0]  # every beam the same row: ties across beams everywhere
    cand[2] = NEG  # a sentence with nothing but NEG
    cand[3, 1:] = NEG + cand[3, 0]  # the first step: beams 1..K-1 at NEG plus beam 0's log-probabilities
    cand[4] = rng.normal(size=(K, V)).astype(np.float32)  # distinct values: torch's fast path
    cand[5, 2, 1] = cand[5, 0, 3] = cand[5].max() + 1  # the two best tie across beams
    return cand


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("V", [50, 6])  # 6 < 2K: one stage over the flat candidates (beam_topk's fallback)
def test_two_stage_topk_ranks_as_the_flat_stable_sort(framework, V):
    rng = np.random.default_rng(0)
    cand = _candidates(rng, V=V)
    K = cand.shape[1]
    k = 2 * K
    want = _flat_ranking(cand, k, signed_zeros=framework == "jax")
    if framework == "torch":
        import torch

        from torch_impl import decode

        results = [decode.beam_topk(torch.from_numpy(cand), k, topk) for topk in (decode.topk_stable,
                                                                                   decode.topk_exact)]
        results = [(values.numpy(), index.numpy()) for values, index in results]
    else:
        from jax_impl import decode

        results = [tuple(map(np.asarray, decode.beam_topk(cand, k, two_stage)))
                   for two_stage in (True, False)]
    for values, index in results:
        np.testing.assert_array_equal(index, want)
        np.testing.assert_array_equal(values, np.take_along_axis(cand.reshape(len(cand), -1), want, -1))


def _case():
    """A tiny model with padded sources (the per-sentence cross-attention mask must follow each
    sentence to its beams) whose greedy decisions are far from ties (checked)."""
    cfg = preset("tiny", max_len=40)
    params = _perturbed(cfg, seed=9)
    src, _ = random_batch(cfg, 4, 8, 2, seed=10)
    src[1, 5:] = src[3, 3:] = cfg.pad_id
    reference = from_params(cfg, params, "numpy")
    assert _decision_margin(params, cfg, src, reference.generate(src, 1, max_len_margin=6).tokens) > 0.1
    return cfg, params, src, reference


@pytest.mark.parametrize("beam_size", [1, 4])
@pytest.mark.parametrize("path", ["torch", "torch static step", "jax"])
def test_levers_keep_the_tokens_and_scores(monkeypatch, path, beam_size):
    """With the levers on and off, against the float64 reference and each other."""
    cfg, params, src, reference = _case()
    want = reference.generate(src, beam_size, max_len_margin=6)
    if path.startswith("torch"):
        from torch_impl import compilation, decode
        from torch_impl.backend import Model

        static = path.endswith("static step")
        if static:  # the compiled search's own step (a tensor t, exact top-k), run uncompiled
            monkeypatch.setattr(compilation, "compiled", lambda fn, **kwargs: fn)
        model = Model(cfg, params, "float32", "cpu", compile=static)
    else:
        from jax_impl import decode

        model = from_params(cfg, params, "jax", "float32")
    on = model.generate(src, beam_size, max_len_margin=6)
    for lever in LEVERS[path.split()[0]]:
        monkeypatch.setattr(decode, lever, False)
    off = model.generate(src, beam_size, max_len_margin=6)
    assert on.tokens == off.tokens == want.tokens
    np.testing.assert_allclose(on.scores, off.scores, rtol=LEVERS_SCORE_RTOL)
    np.testing.assert_allclose(on.scores, want.scores, rtol=SCORE_TOLERANCE)


def test_shared_cross_attention_keys_are_per_sentence(monkeypatch):
    """The beam search's cache holds B rows of cross-attention keys (one a sentence) and B x K of
    self-attention ones; with SHARED_CROSS off, B x K of both (the path before issue 47)."""
    import torch

    from torch_impl import decode
    from torch_impl.backend import Model

    cfg, params, src, _ = _case()
    model = Model(cfg, params, "float32", "cpu", compile=False)
    shapes = []
    init_cache = model.module.init_cache

    def recorded(*args, **kwargs):
        caches = init_cache(*args, **kwargs)
        shapes.append([(c.cross_k.shape[0], c.self_k.shape[0]) for c in caches])
        return caches

    monkeypatch.setattr(model.module, "init_cache", recorded)
    with torch.inference_mode():
        model.generate(src, 4, max_len_margin=6)
        monkeypatch.setattr(decode, "SHARED_CROSS", False)
        model.generate(src, 4, max_len_margin=6)
    B = len(src)
    assert shapes == [[(B, 4 * B)] * cfg.num_decoder_layers, [(4 * B, 4 * B)] * cfg.num_decoder_layers]


def _unbuilt_weights(model, run, monkeypatch) -> int:
    """How many of `run()`'s GEMMs (aten.linear, seen at dispatch: every nn.Linear and the output
    projection) read a bfloat16 weight that the model did not cast when it was built (Model._weights):
    a cast made during the search. (torch.autocast's own casts are not dispatched to a Python mode,
    so the GEMMs' operands are checked, not the casts.) The eager step's q, k and v weights
    concatenated once per search (decode.STEP_ATTENTION: ops.fused_linear, once a layer, checked)
    count as built: made before the first step, from the built weights."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from torch_impl import decode

    built = {w.data_ptr() for w in (model._weights or {}).values()}
    count, fused = [0], []
    make = decode.fused_linear

    def once(linears, rows):
        fn = make(linears, rows)
        fused.append(fn.keywords["weight"] if fn.keywords else fn.args[0])
        built.add(fused[-1].data_ptr())
        return fn

    monkeypatch.setattr(decode, "fused_linear", once)

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.linear.default and args[1].dtype == torch.bfloat16:
                count[0] += args[1].data_ptr() not in built
            return func(*args, **(kwargs or {}))

    with Reads():
        run()
    assert len(fused) in (0, model.config.num_decoder_layers)  # static: none; eager: one a layer
    return count[0]


@pytest.mark.parametrize("static", [False, True])
def test_torch_bfloat16_search_casts_no_weight_per_step(monkeypatch, static):
    """bfloat16 decoding reads the weights the model cast once when built (torch_impl/backend.py's
    compute_weights, kept in Model._weights): no GEMM of a search reads a weight cast during it,
    however many steps it runs. The check sees per-step casts where they happen: under torch.autocast
    every Linear reads a copy of its weight made at the step (more reads than two steps' GEMMs)."""
    import torch

    from torch_impl import compilation, decode
    from torch_impl.backend import Model

    if static:
        monkeypatch.setattr(compilation, "compiled", lambda fn, **kwargs: fn)
    monkeypatch.setattr(decode, "FUSED_QKV", True)  # its weights concatenated once per search: checked too
    cfg, params, src, _ = _case()
    model = Model(cfg, params, "bfloat16", "cpu", compile=static)
    assert model._weights
    assert _unbuilt_weights(model, lambda: model.generate(src, 4, max_len_margin=6), monkeypatch) == 0
    plain = Model(cfg, params, "float32", "cpu", compile=static)

    def autocast() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            plain.generate(src, 4, max_len_margin=6)

    linears = sum(isinstance(m, torch.nn.Linear) for m in plain.module.decoder.modules())
    assert _unbuilt_weights(plain, autocast, monkeypatch) > 2 * linears


def _loop_weight_casts(graphdef, state, src, limits, length) -> int:
    """convert_element_type equations inside the beam search's while loop (its body and the jaxprs
    nested in it) that cast a floating array shaped as one of the model's weight matrices: a weight
    cast per iteration. (The case's other floating arrays in the loop, [N, ...] activations with
    N = 16 rows and logits [16, 64], have no weight's shape: the weights are [32, 32], [32, 64],
    [64, 32] and the table [64, 32].)"""
    import jax
    import jax.numpy as jnp
    from jax.extend.core import jaxprs_in_params

    from jax_impl import decode

    shapes = {x.shape for x in jax.tree.leaves(state) if x.ndim == 2}
    jaxpr = jax.make_jaxpr(lambda s: decode._beam_search(
        graphdef, s, src, limits, beam_size=4, alpha=0.6, length=length, cache=True, rule="wu",
        constraints=decode.NO_CONSTRAINTS))(state)

    def casts(j, inside: bool) -> int:
        n = 0
        for eqn in j.eqns:
            if inside and eqn.primitive.name == "convert_element_type":
                x, y = eqn.invars[0].aval, eqn.outvars[0].aval
                n += x.shape in shapes and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != y.dtype
            for sub in jaxprs_in_params(eqn.params):
                n += casts(sub, inside or eqn.primitive.name == "while")
        return n

    assert len(src) * 4 == 16 and all(16 not in shape for shape in shapes)  # the docstring's premise
    return casts(jaxpr.jaxpr, False)


def test_jax_bfloat16_search_loop_casts_no_weight():
    """JAX's bfloat16 model holds bfloat16 weights (jax_impl/backend.py's compute_weights, cast once
    when built): the traced search loop converts no weight matrix. The same check finds the casts of
    float32 weights into the bfloat16 layers inside the loop when the state is left uncast."""
    from flax import nnx

    from rosetta.generation import output_limits

    cfg, params, src, _ = _case()
    model = from_params(cfg, params, "jax", "bfloat16")
    limits, length = output_limits(cfg, src, 6, None)
    assert _loop_weight_casts(model.graphdef, model.state, src, limits, length) == 0
    graphdef, state = nnx.split(model.module)  # float32 weights, bfloat16 layers: cast where used
    assert _loop_weight_casts(graphdef, state, src, limits, length) > 0


@pytest.mark.parametrize("beam_size", [1, 4])
def test_jax_loop_reading_its_condition_every_few_steps_changes_nothing(beam_size):
    """jax_impl/decode.py's _search_loop with its condition read every 8 steps (GPUs: SYNC_EVERY)
    gives the every-step loop's tokens and scores bit for bit, and the float64 reference's tokens: the
    steps run after the stop change nothing (a sentence that reaches its limit of 14 takes the loop
    past the buffer's 14 positions, not a multiple of 8). The chunk is a fixed-length loop (a scan of
    `every` steps) inside the while loop."""
    import jax

    from jax_impl import decode
    from rosetta.generation import NO_CONSTRAINTS, output_limits, strip

    cfg, params, src, reference = _case()
    want = reference.generate(src, beam_size, max_len_margin=6)
    model = from_params(cfg, params, "jax", "float32")
    limits, length = output_limits(cfg, src, 6, None)
    assert length % 8 != 0

    def search(every: int, trace: bool = False):
        if beam_size == 1:
            fn, kwargs = decode._greedy_search, {}
        else:
            fn, kwargs = decode._beam_search, dict(beam_size=beam_size, alpha=0.6, rule="wu")
        run = (lambda *a, **k: jax.make_jaxpr(lambda s: fn(*a[:1], s, *a[2:], **k))(a[1])) if trace else fn
        with model._context():
            return run(model.graphdef, model.state, src, limits, length=length, cache=True,
                       constraints=NO_CONSTRAINTS, every=every, **kwargs)

    outputs = {every: [np.asarray(x) for x in search(every)] for every in (1, 8)}
    for got, base in zip(outputs[8], outputs[1], strict=True):
        np.testing.assert_array_equal(got, base)
    assert strip(cfg, outputs[8][0]) == want.tokens
    loops = [eqn for eqn in search(8, trace=True).jaxpr.eqns if eqn.primitive.name == "while"]
    inner = [e for e in loops[0].params["body_jaxpr"].jaxpr.eqns if e.primitive.name == "scan"]
    assert len(loops) == 1 and [e.params["length"] for e in inner] == [8]


def _finishing_case(padded: bool = True):
    """A tiny model leaning to eos (an output bias) and padded sources of different lengths: its
    sentences end at different steps (their limits differ, and beam search ends one with eos at
    once), so that finished sentences leave the batch while others go on. Unpadded: no cross-attention
    mask (the single-query path's mask-free case)."""
    cfg = preset("tiny", max_len=40, output_bias=True)
    params = _perturbed(cfg, seed=9)
    params["generator.bias"][cfg.eos_id] += EOS_BIAS
    src, _ = random_batch(cfg, 6, 8, 2, seed=10, pad=padded)
    reference = from_params(cfg, params, "numpy")
    return cfg, params, src, reference


EOS_BIAS = 2.0  # a logit added to eos: beam search ends a sentence with eos (checked)


@pytest.mark.parametrize("beam_size", [1, 4])
@pytest.mark.parametrize("lever", ["STACKED_CACHE", "STEP_ATTENTION", "STEP_ATTENTION unpadded", "FUSED_QKV",
                                   "DROP_FINISHED", "FIRST_ONE_ROW", "RANK_LOGITS"])
def test_each_new_torch_lever_alone_keeps_the_tokens_and_scores(monkeypatch, lever, beam_size):
    """Issue 47's PyTorch levers one at a time (the others off) against all off and the float64
    reference, on sentences that finish at different steps: the same tokens, the scores within a few
    float32 eps of all off. With DROP_FINISHED the rows a step computes shrink as sentences finish
    (the lever acts); without it they stay B x beams throughout (the control)."""
    import torch

    from torch_impl import decode
    from torch_impl.backend import Model

    lever, padded = lever.split()[0], not lever.endswith("unpadded")
    cfg, params, src, reference = _finishing_case(padded)
    want = reference.generate(src, beam_size, max_len_margin=6)
    if padded:  # sentences end at different steps (limits: real length + 6), one with eos in beam search
        assert len({len(row) for row in want.tokens}) > 3
        assert beam_size == 1 or min(map(len, want.tokens)) == 0
    model = Model(cfg, params, "float32", "cpu", compile=False)
    for name in LEVERS["torch"]:
        monkeypatch.setattr(decode, name, False)
    off = model.generate(src, beam_size, max_len_margin=6)
    monkeypatch.setattr(decode, lever, True)
    if lever == "FIRST_ONE_ROW":  # its one row a sentence reads the sentence's cross-attention keys
        monkeypatch.setattr(decode, "SHARED_CROSS", True)
    if lever == "FUSED_QKV":  # a part of the single-query path
        monkeypatch.setattr(decode, "STEP_ATTENTION", True)
    rows, ranked = [], []
    logits = decode.Steps.logits
    monkeypatch.setattr(decode.Steps, "logits",
                        lambda self, tokens, t: rows.append(len(tokens)) or logits(self, tokens, t))
    ranked_on_logits = decode.ranked_on_logits
    monkeypatch.setattr(decode, "ranked_on_logits",
                        lambda *args: ranked.append(ranked_on_logits(*args)) or ranked[-1])
    with torch.inference_mode():
        on = model.generate(src, beam_size, max_len_margin=6)
    assert on.tokens == off.tokens == want.tokens
    np.testing.assert_allclose(on.scores, off.scores, rtol=LEVERS_SCORE_RTOL)
    np.testing.assert_allclose(on.scores, want.scores, rtol=SCORE_TOLERANCE)
    full = len(src) * beam_size
    if lever == "DROP_FINISHED":
        assert rows[0] == full and rows[-1] < full and rows == sorted(rows, reverse=True)
    elif lever == "FIRST_ONE_ROW" and beam_size > 1:  # step 0 on a row a sentence, then the beams'
        assert rows[0] == len(src) and set(rows[1:]) == {full}
    else:
        assert set(rows) == {full}
    # RANK_LOGITS ranks on the logits from step 1 (a beam search's; step 0 has dead beams: NEG ties).
    assert (lever == "RANK_LOGITS" and beam_size > 1) == any(r is not None for r in ranked)


def test_plain_attention_is_the_formula():
    """ops.plain_attention (the eager step's attention) against eq. 1 in float64 NumPy, with a mask
    that hides some keys, and a query whose keys are all hidden: uniform weights, the values' mean
    (SPEC §2). float32 inputs of size ~1, sums of 16 products: a few float32 eps, bound 1e-5."""
    import torch

    from torch_impl.ops import plain_attention

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((3, 2, 4, 16), (3, 2, 5, 16),
                                                                           (3, 2, 5, 16)))
    mask = rng.random((3, 1, 4, 5)) < 0.6
    mask[0, 0, 1] = False  # no key left
    scores = np.where(mask, q.astype(np.float64) @ k.transpose(0, 1, 3, 2) / 4.0, -np.inf)
    scores = np.where(mask.any(-1, keepdims=True), scores, 0.0)  # uniform where nothing is left
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    want = (weights / weights.sum(-1, keepdims=True)) @ v
    for m, expected in ((mask, want), (None, None)):
        got = plain_attention(*map(torch.from_numpy, (q, k, v)), None if m is None else torch.from_numpy(m))
        if expected is None:  # no mask: every key
            s = q.astype(np.float64) @ k.transpose(0, 1, 3, 2) / 4.0
            w = np.exp(s - s.max(-1, keepdims=True))
            expected = (w / w.sum(-1, keepdims=True)) @ v
        np.testing.assert_allclose(got.numpy(), expected.transpose(0, 2, 1, 3), atol=1e-5)
    np.testing.assert_allclose(want[0, 0, 1], v[0, 0].mean(0), atol=1e-6)  # the oracle's own rule


def test_jax_slot_cache_attends_as_a_gathered_cache():
    """jax_impl's self-attention cache (ops.LayerCache) keeps each row's keys and values where they
    were written, and beam search's reordering moves its `slots` only: at every step of a search-like
    run (3 sentences x 4 beams, 6 positions, rows redrawn within their sentence after each step,
    repeats allowed as when one beam spawns two), LayerCache.self_attend equals eq. 1 in float64 NumPy
    over a cache whose rows were gathered (the reordering it replaces): q, k and v by the layer's own
    weights, the keys and values of positions <= t. float64 both: a few eps of 1, bound 1e-12."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jax_impl.model import MultiHeadAttention
    from jax_impl.ops import LayerCache

    rng = np.random.default_rng(0)
    B, K, L = 3, 4, 6
    N = B * K
    with jax.enable_x64(True):
        cfg = preset("tiny").replace(attention_bias=True)
        h, dh = cfg.num_heads, cfg.d_model // cfg.num_heads
        attention = MultiHeadAttention(cfg, jnp.float64, nnx.Rngs(0))
        for linear in (attention.q, attention.k, attention.v, attention.o):  # nonzero biases
            linear.bias[...] = jnp.asarray(rng.standard_normal(cfg.d_model), linear.bias.dtype)
        weights = {name: (np.asarray(lin.kernel[...]), np.asarray(lin.bias[...])) for name, lin in
                   (("q", attention.q), ("k", attention.k), ("v", attention.v), ("o", attention.o))}
        cache = LayerCache(jnp.zeros((B, h, dh, L * K)), jnp.zeros((B, h, L * K, dh)),
                           jnp.zeros((N, L), jnp.int32), None, None)
        keys, values = np.zeros((N, h, L, dh)), np.zeros((N, h, L, dh))  # the gathered cache

        def linear(name: str, x: np.ndarray) -> np.ndarray:
            kernel, bias = weights[name]
            return x @ kernel + bias

        for t in range(L):
            x = rng.standard_normal((N, 1, cfg.d_model))
            mask = (jnp.arange(L) <= t)[None, None, None, :]
            got, cache = cache.self_attend(attention, jnp.asarray(x), jnp.asarray(t), mask)
            q, k, v = (linear(name, x[:, 0]).reshape(N, h, dh) for name in "qkv")
            keys[:, :, t], values[:, :, t] = k, v
            scores = np.einsum("nhd,nhpd->nhp", q, keys[:, :, :t + 1]) / np.sqrt(dh)
            w = np.exp(scores - scores.max(-1, keepdims=True))
            y = np.einsum("nhp,nhpd->nhd", w / w.sum(-1, keepdims=True), values[:, :, :t + 1])
            want = linear("o", y.reshape(N, cfg.d_model))
            np.testing.assert_allclose(np.asarray(got)[:, 0], want, rtol=0, atol=1e-12)
            rows = (np.arange(B)[:, None] * K + rng.integers(0, K, (B, K))).reshape(-1)
            cache = cache.reorder(jnp.asarray(rows))
            keys, values = keys[rows], values[rows]
        assert len(set(rows.tolist())) < N  # some beam was taken twice at least once (the draw)


@pytest.mark.parametrize("stacked", [True, False])
def test_stacked_cache_reorders_every_layer_by_one_gather(monkeypatch, stacked):
    """A beam step's reordering of the self-attention cache: one gather over the stacked cache's row
    axis (STACKED_CACHE) against one per layer and keys/values (off): counted at dispatch
    (aten.index and index_select, any overload) inside Steps.reorder, over a whole beam-4 search."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from torch_impl import decode
    from torch_impl.backend import Model

    cfg, params, src, _ = _case()
    monkeypatch.setattr(decode, "STACKED_CACHE", stacked)
    monkeypatch.setattr(decode, "DROP_FINISHED", False)
    monkeypatch.setattr(decode, "FIRST_ONE_ROW", False)  # its step 1 gathers B x K rows of B: stacked
    gathers, calls = [0], [0]

    class Gathers(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            gathers[0] += func.overloadpacket in (torch.ops.aten.index, torch.ops.aten.index_select)
            return func(*args, **(kwargs or {}))

    reorder = decode.Steps.reorder

    def counted(self, rows, t):
        calls[0] += 1
        with Gathers():
            reorder(self, rows, t)

    monkeypatch.setattr(decode.Steps, "reorder", counted)
    Model(cfg, params, "float32", "cpu", compile=False).generate(src, 4, max_len_margin=6)
    assert calls[0] > 3
    assert gathers[0] == calls[0] * (1 if stacked else 2 * cfg.num_decoder_layers)



def test_torch_eager_log_softmax_writes_one_buffer_a_search(monkeypatch):
    """Steps.log_softmax (issue 55): an eager beam search's steps write their log-probabilities into one
    buffer kept for the search (a second only when the rows grow: step 0's one row a sentence, then
    the beams'), not a new [N, V] tensor a step; the tokens are the float64 reference's."""
    from torch_impl import decode
    from torch_impl.backend import Model

    cfg, params, src, reference = _finishing_case(True)
    model = Model(cfg, params, "float32", "cpu", compile=False)
    addresses = []
    log_softmax = decode.Steps.log_softmax
    monkeypatch.setattr(decode.Steps, "log_softmax",
                        lambda self, logits, t: addresses.append(log_softmax(self, logits, t).data_ptr())
                        or self.logp[:len(logits)])
    want = reference.generate(src, 4, max_len_margin=6).tokens
    assert model.generate(src, 4, max_len_margin=6).tokens == want
    assert len(addresses) > 3 and len(set(addresses)) <= 2


def test_a_cpu_search_keeps_freed_memory_for_its_next_tensors():
    """torch_impl.ops.keep_heap (every CPU search calls it): once it has run, under glibc, a 64 MB
    block is served from malloc's heap, not mapped on its own, and freed it stays there (glibc's own
    accounting, mallinfo2: `hblks` counts blocks mapped on their own, `uordblks` the heap's bytes in
    use, `arena` its bytes from the OS). By default glibc maps any block over 32 MB and unmaps it when
    freed, so each step's large tensors came in fresh pages (~44,800 page faults a beam-4 call of
    decode_ct2's model; docs/decoding.md). In the test's own thread: the main one, whose heap is the
    one keep_heap's settings govern. Other C libraries: keep_heap changes nothing (no mallopt)."""
    import ctypes
    import platform
    import threading

    from torch_impl.ops import keep_heap

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("keep_heap acts under glibc only (mallopt): nothing to check on this C library")
    assert threading.current_thread() is threading.main_thread()

    libc = ctypes.CDLL(None)
    # glibc >= 2.33's mallinfo2 (size_t fields); before it, mallinfo's int fields (the same names)
    wide = hasattr(libc, "mallinfo2")

    class Mallinfo(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t if wide else ctypes.c_int)
                    for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                 "uordblks", "fordblks", "keepcost")]

    mallinfo = libc.mallinfo2 if wide else libc.mallinfo
    mallinfo.restype, libc.malloc.restype, libc.free.argtypes = Mallinfo, ctypes.c_void_p, [ctypes.c_void_p]
    keep_heap("cpu")
    size = 64 << 20
    before = mallinfo()
    block = libc.malloc(size)
    during = mallinfo()
    libc.free(block)
    after = mallinfo()
    assert during.hblks == before.hblks and during.uordblks >= before.uordblks + size  # the heap's
    assert after.arena == during.arena  # kept, not trimmed
