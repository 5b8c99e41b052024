"""Incremental decoding and search: cached steps equal full recomputation, the searches agree
token for token across backends, and beam search finds what exhaustive search finds."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from numpy_ref import model as ref
from numpy_ref.decode import length_penalty, log_softmax
from rosetta import InputError, from_params, init_params, preset
from rosetta.generation import NEG
from rosetta.parity import random_batch, relative_error

STEP_TOLERANCE = 1e-5  # float32 cached step logits vs float64 full recomputation
SCORE_TOLERANCE = 1e-5  # beam scores across backends, relative
# fairseq's conventions (M2M100, NLLB, FSMT): pad 1, positions read from row pad + 1 (SPEC §1-2).
FAIRSEQ = dict(norm_first=True, positional_encoding="sinusoidal_concat_t2t", pad_id=1, bos_id=0,
               position_offset=2)


def _perturbed(cfg, seed=0):
    rng = np.random.default_rng(seed)
    return {k: (v + 0.05 * rng.standard_normal(v.shape)).astype(np.float32)
            for k, v in init_params(cfg, seed).items()}


@pytest.mark.parametrize("overrides", [
    {}, dict(norm_first=True, activation="gelu", share_embeddings="none", output_bias=True),
    dict(positional_encoding="sinusoidal_concat_t2t", attention_bias=False, bos_id=0),
    FAIRSEQ,
])
def test_cached_step_logits_equal_full_recomputation(backend, overrides):
    cfg = preset("tiny", **overrides)
    params = _perturbed(cfg)
    src, tgt = random_batch(cfg, 3, 9, 12, seed=4, pad=False)
    src[1:, 6:] = cfg.pad_id  # padded sources still allowed; targets are pad-free prefixes
    want = from_params(cfg, params, "numpy").logits(src, tgt)
    got = from_params(cfg, params, backend, "float32").step_logits(src, tgt)
    assert relative_error(got, want) <= STEP_TOLERANCE


# -- exhaustive search as an independent oracle -----------------------------------------------

def _exhaustive_best(params, cfg, src_row, limit, alpha):
    """Every sequence of non-pad tokens that ends in eos or stops at `limit`, scored by
    log P / lp(length) with the float64 reference: the best one and its score."""
    params = {k: v.astype(np.float64) for k, v in params.items()}
    tokens = [t for t in range(cfg.tgt_vocab_size) if t != cfg.pad_id]
    best = (None, -np.inf)
    for n in range(1, limit + 1):
        for seq in itertools.product(tokens, repeat=n):
            if cfg.eos_id in seq[:-1] or (n < limit and seq[-1] != cfg.eos_id):
                continue
            tgt = np.array([[cfg.bos_id, *seq[:-1]]])
            logp = log_softmax(ref.forward(params, cfg, src_row[None], tgt)[0])
            # Decoding renormalises over non-pad tokens only by excluding pad from the search;
            # its log-probabilities are the full softmax's, so the scores are comparable.
            score = sum(logp[i, tok] for i, tok in enumerate(seq)) / length_penalty(n, alpha)
            if score > best[1]:
                best = (list(seq[: seq.index(cfg.eos_id)] if cfg.eos_id in seq else seq), score)
    return best


@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
def test_wide_beam_search_finds_the_exhaustive_optimum(alpha):
    cfg = preset("tiny", src_vocab_size=6, tgt_vocab_size=4, share_embeddings="none", d_model=16,
                 num_heads=2, num_encoder_layers=1, num_decoder_layers=1, d_ff=32)
    params = _perturbed(cfg, seed=11)  # a seed whose optimum greedy search misses (checked below)
    src = np.array([[3, 4, 5], [4, 4, 0]])
    margin = 0  # limits: the real source lengths, 3 and 2 tokens
    # The widest beam allowed (the target vocabulary, 4) is exhaustive here: pad is never emitted
    # and eos ends a hypothesis, so at most 2 x 2 = 4 prefixes are alive before the last of 3
    # steps, and the 2 x beam candidates kept per step hold every one of their extensions.
    got = from_params(cfg, params, "numpy").generate(src, beam_size=cfg.tgt_vocab_size, alpha=alpha,
                                                      max_len_margin=margin)
    best = [_exhaustive_best(params, cfg, src[b], limit, alpha) for b, limit in enumerate([3, 2])]
    for b, (tokens, score) in enumerate(best):
        assert got.tokens[b] == tokens
        assert got.scores[b] == pytest.approx(score, rel=1e-12)
    greedy = from_params(cfg, params, "numpy").generate(src, 1, max_len_margin=margin)
    assert greedy.tokens != [tokens for tokens, _ in best]  # the search had something to find


# -- the same search in every backend -----------------------------------------------------------

def _decision_margin(params, cfg, src, tokens):
    """Smallest gap between the chosen and the runner-up log-probability along greedy paths:
    a near-tie makes token identity across float32 backends a matter of luck."""
    gaps, params64 = [], {k: v.astype(np.float64) for k, v in params.items()}
    for b, row in enumerate(tokens):
        seq = [*row, cfg.eos_id]
        tgt = np.array([[cfg.bos_id, *seq[:-1]]])
        logp = log_softmax(ref.forward(params64, cfg, src[b: b + 1], tgt)[0])
        logp[:, cfg.pad_id] = -np.inf
        top2 = np.sort(logp, axis=-1)[:, -2:]
        gaps.extend(top2[:, 1] - top2[:, 0])
    return min(gaps)


@pytest.mark.parametrize("overrides", [{}, FAIRSEQ], ids=["default", "fairseq_position_offset"])
@pytest.mark.parametrize("beam_size", [1, 4])
def test_searches_agree_across_backends_on_random_weights(beam_size, overrides):
    cfg = preset("tiny", max_len=40, **overrides)
    params = _perturbed(cfg, seed=5)
    src, _ = random_batch(cfg, 4, 8, 2, seed=6)
    want = from_params(cfg, params, "numpy").generate(src, beam_size, max_len_margin=6)
    if beam_size == 1:
        # Random weights: say so when a decision is a near-tie, rather than pass by luck.
        margin = _decision_margin(params, cfg, src, want.tokens)
        assert margin > 1e-4, f"greedy path has a near-tie ({margin:.1e}): pick another seed"
    for backend in ("torch", "jax"):
        got = from_params(cfg, params, backend).generate(src, beam_size, max_len_margin=6)
        assert got.tokens == want.tokens, backend
        np.testing.assert_allclose(got.scores, want.scores, rtol=SCORE_TOLERANCE)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_torch_topk_ranks_ties_by_index_as_a_stable_sort(dtype):
    """torch_impl's top-k (int64 keys for float32) against numpy's stable argsort: rows full of
    ties, -0.0 beside 0.0, the search's NEG and -inf."""
    import torch

    from rosetta.generation import NEG
    from torch_impl.decode import topk_stable

    rng = np.random.default_rng(0)
    x = rng.integers(-3, 3, size=(64, 50)).astype(dtype) * 0.5
    x[0, :5] = [-0.0, 0.0, -0.0, NEG, -np.inf]
    x[1] = NEG
    x[2] = rng.normal(size=50) * 1e-30  # tiny values keep their order
    # Distinct values, and ties only inside the top k (never at its boundary): torch_impl's
    # float32 fast path (torch.topk, then the k ordered), where the rows above take the keys' path.
    y = rng.normal(size=(64, 50)).astype(dtype)
    y[:, 7] = y[:, 3] = y.max(axis=1) + 1.0  # the two largest equal: ranked 3 before 7
    y[5, 10] = -0.0
    y[5, 20] = 0.0
    for k in (1, 8, 50):
        for matrix in (x, y):
            values, index = topk_stable(torch.from_numpy(matrix), k)
            want = np.argsort(-matrix, axis=-1, kind="stable")[:, :k]
            np.testing.assert_array_equal(index.numpy(), want)
            np.testing.assert_array_equal(values.numpy(), np.take_along_axis(matrix, want, -1))


def test_torch_topk_of_long_rows_through_their_best_chunks_ranks_as_a_stable_sort():
    """topk_stable's preselection (rows of 4,000 and 32,000: chunks of 125 and 128) against numpy's
    stable argsort: ties across and inside chunks at the top-k boundary, rows all equal (NEG), -0.0
    beside 0.0, -inf, a NaN row (the whole row's keys instead), and the beam's [B, K, V] shape."""
    import torch

    from rosetta.generation import NEG
    from torch_impl.topk import _best_chunks, topk_stable

    rng = np.random.default_rng(1)
    for V in (4000, 32000):
        x = rng.normal(size=(6, 2, V)).astype(np.float32)
        x[0, 0, [5, 300, 3999 - 7]] = x[0, 0, 900] = 9.0  # four equal best, in three chunks
        x[0, 1] = rng.integers(-2, 3, size=V) * 0.5  # ties everywhere, across every chunk
        x[1, 0] = NEG
        x[1, 1, :] = -np.inf
        x[1, 1, [10, 2000]] = [-0.0, 0.0]
        x[2, 0, 17] = np.nan
        for k in (1, 8):
            finite = torch.from_numpy(np.delete(x, 2, 0))
            assert _best_chunks(finite, k) is not None  # the preselection's path, checked below
            assert _best_chunks(torch.from_numpy(x), k) is None  # a NaN: the whole row's keys
            want = np.argsort(-finite.numpy(), axis=-1, kind="stable")[..., :k]
            values, index = topk_stable(finite, k)
            np.testing.assert_array_equal(index.numpy(), want)
            np.testing.assert_array_equal(values.numpy(), np.take_along_axis(finite.numpy(), want, -1))
            index = topk_stable(torch.from_numpy(x), k)[1].numpy()
            assert np.isnan(x[2, 0, index[2, 0, 0]])  # NaN first, as the keys order it


def test_jax_top_k_of_long_rows_through_their_best_chunks_is_lax_top_k():
    """jax_impl's chunked top-k against jax.lax.top_k itself (the order JAX's search always had): ties
    across chunks at the boundary, rows of ties, NEG, -inf, signed zeros (XLA ranks 0.0 above -0.0),
    NaN and -NaN (XLA's total order puts them at the ends)."""
    pytest.importorskip("jax")
    import jax

    from jax_impl.topk import top_k_by_chunks

    rng = np.random.default_rng(2)
    for V in (4000, 32000):
        x = rng.normal(size=(5, 2, V)).astype(np.float32)
        x[0, 0, [5, 300, 900, V - 7]] = 9.0
        x[0, 1] = rng.integers(-2, 3, size=V) * 0.5
        x[1, 0] = NEG
        x[1, 1] = -np.inf
        x[1, 1, [10, 2000]] = [-0.0, 0.0]
        x[2, 0, 17] = np.nan
        x[2, 1] = np.where(np.arange(V) % 7 == 0, -0.0, 0.0)
        x[3, 0, 99] = -np.nan
        for k in (1, 8):
            want, got = jax.lax.top_k(x, k), top_k_by_chunks(x, k)
            np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
            np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))


def test_jax_grouped_max_is_numpys_max_at_every_length():
    """jax_impl.topk.grouped_max (a max in groups of at most 32, past XLA's reduce-window rewrite)
    against NumPy's max: lengths under 32, with divisors up to 32, nested (32,000 = 1000 x 32, 1000 = 40
    x 25, 40 = 20 x 2), prime (no grouping); int32 keys as top_k_by_chunks gives it, and floats."""
    pytest.importorskip("jax")
    import jax

    from jax_impl.topk import grouped_max

    rng = np.random.default_rng(3)
    for length in (7, 32, 33, 128, 250, 32000, 31991):
        keys = rng.integers(-2**31, 2**31 - 1, size=(3, length), dtype=np.int64).astype(np.int32)
        np.testing.assert_array_equal(np.asarray(jax.jit(grouped_max)(keys)), keys.max(axis=-1))
        floats = rng.normal(size=(2, length)).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(jax.jit(grouped_max)(floats)), floats.max(axis=-1))


@pytest.mark.ported
@pytest.mark.parametrize("beam_size", [1, 3])
def test_cache_off_gives_the_same_search(backend, beam_size):
    cfg = preset("tiny", max_len=32)
    params = _perturbed(cfg, seed=7)
    src, _ = random_batch(cfg, 3, 6, 2, seed=8)
    model = from_params(cfg, params, backend)
    with_cache = model._generate(src, beam_size, 0.6, 5, cache=True)
    without = model._generate(src, beam_size, 0.6, 5, cache=False)
    assert with_cache.tokens == without.tokens
    np.testing.assert_allclose(with_cache.scores, without.scores, rtol=1e-5)


def test_output_length_limit_and_eos():
    cfg = preset("tiny", max_len=20)
    params = _perturbed(cfg, seed=9)
    src = np.array([[5, 6, 7, 8, 9, 10, 11], [5, 6, 0, 0, 0, 0, 0]])
    for beam_size in (1, 3):
        out = from_params(cfg, params, "numpy").generate(src, beam_size, max_len_margin=2)
        assert len(out.tokens[0]) <= 9 and len(out.tokens[1]) <= 4  # real length + margin
        assert all(cfg.eos_id not in row and cfg.pad_id not in row for row in out.tokens)
    out = from_params(cfg, params, "numpy").generate(src, 1, max_len_margin=100)
    assert all(len(row) <= cfg.max_len for row in out.tokens)


@pytest.mark.parametrize("kwargs,message", [
    (dict(beam_size=0), "beam_size must be an integer >= 1"),
    (dict(beam_size=2.0), "beam_size must be an integer >= 1"),
    (dict(alpha=-1.0), "alpha must be a number >= 0"),
    (dict(max_len_margin=-3), "max_len_margin must be an integer >= 0"),
])
def test_bad_search_arguments_are_refused(backend, kwargs, message):
    cfg = preset("tiny")
    with pytest.raises(InputError, match=message):
        from_params(cfg, init_params(cfg), backend).generate(np.array([[5, 6]]), **kwargs)


@pytest.mark.parametrize("kwargs,message", [
    (dict(beam_size=True), "beam_size must be an integer >= 1, got True"),
    (dict(beam_size=np.bool_(True)), "beam_size must be an integer >= 1"),
    (dict(beam_size=65), "beam_size 65 is larger than the target vocabulary (64 tokens)"),
    (dict(beam_size=np.int64(10_000)), "beam_size 10000 is larger than the target vocabulary"),
    (dict(alpha=True), "alpha must be a number >= 0 and finite, got True"),
    (dict(alpha=float("nan")), "alpha must be a number >= 0 and finite, got nan"),
    (dict(alpha=np.float32("inf")), "alpha must be a number >= 0 and finite"),
    (dict(alpha="0.6"), "alpha must be a number >= 0 and finite, got '0.6'"),
    (dict(max_len_margin=True), "max_len_margin must be an integer >= 0, got True"),
    (dict(max_len_margin=np.float64(3.0)), "max_len_margin must be an integer >= 0"),
])
def test_search_arguments_follow_one_rule_in_every_backend(backend, kwargs, message):
    cfg = preset("tiny")  # target vocabulary: 64 tokens
    with pytest.raises(InputError) as err:
        from_params(cfg, init_params(cfg), backend).generate(np.array([[5, 6]]), **kwargs)
    assert message in str(err.value)


def test_numpy_scalars_are_numbers_and_the_vocabulary_is_the_widest_beam():
    cfg = preset("tiny", max_len=16)
    model = from_params(cfg, _perturbed(cfg, seed=2), "numpy")
    src = np.array([[5, 6, 7], [8, 9, 0]])
    want = model.generate(src, 2, 0.6, 3)
    got = model.generate(src, np.int64(2), np.float32(0.6), np.int32(3))
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got.scores, want.scores, rtol=1e-6)  # alpha 0.6 rounded to float32
    assert model.generate(src, 3, np.int64(1), 3).tokens == model.generate(src, 3, 1.0, 3).tokens
    assert len(model.generate(src, 64, 0.6, 1).tokens) == 2  # beam = target vocabulary: allowed


# -- a trained model: confident decisions, so token identity is a real check -------------------

@pytest.fixture(scope="module")
def copy_model():
    """A tiny model trained here for 400 steps on the copy task (PyTorch, seeded)."""
    import torch

    from rosetta.harness.data import synthetic_pairs
    from rosetta.training import TrainConfig
    from torch_impl import train as torch_train
    from torch_impl.backend import Model as TorchModel
    from torch_impl.convert import from_state_dict

    cfg = preset("tiny", src_vocab_size=16, tgt_vocab_size=16, dropout=0.0, max_len=32)
    tc = TrainConfig(warmup_steps=100, lr_factor=1.0, label_smoothing=0.0)
    torch.manual_seed(0)
    module = TorchModel(cfg, init_params(cfg, seed=0), "float32", device="cpu").module
    optimizer, scheduler = torch_train.make_optimizer(module, tc)
    pairs = synthetic_pairs("copy", num_examples=400 * 32, vocab_size=16, min_len=2, max_len=8, seed=0)
    for step in range(400):
        chunk = pairs[step * 32: (step + 1) * 32]
        T = max(len(x) for x, _ in chunk) + 1
        src, tgt, labels = (np.full((32, T), cfg.pad_id) for _ in range(3))
        for i, (x, y) in enumerate(chunk):
            src[i, : len(x) + 1] = [*x, cfg.eos_id]
            tgt[i, : len(y) + 1] = [cfg.bos_id, *y]
            labels[i, : len(y) + 1] = [*y, cfg.eos_id]
        torch_train.train_step(module, optimizer, scheduler, *map(torch.from_numpy, (src, tgt, labels)), tc)
    return cfg, from_state_dict(cfg, module.state_dict())


@pytest.mark.parametrize("beam_size", [1, 4])
def test_trained_copy_model_decodes_identically_in_every_backend(copy_model, beam_size):
    cfg, params = copy_model
    rng = np.random.default_rng(11)
    src = np.full((6, 9), cfg.pad_id)
    for b in range(6):
        n = int(rng.integers(2, 9))
        src[b, : n + 1] = [*rng.integers(3, 16, size=n), cfg.eos_id]
    want = from_params(cfg, params, "numpy").generate(src, beam_size, alpha=0.6, max_len_margin=4)
    # Training worked: the model copies, so its decisions are far from ties.
    copied = [list(row[: list(row).index(cfg.eos_id)]) for row in src]
    assert sum(w == c for w, c in zip(want.tokens, copied, strict=True)) >= 5
    assert _decision_margin(params, cfg, src, want.tokens) > 1e-2
    # The model is confident, so its scores are near 0 (about -0.01), where a relative bound alone
    # asks more than float32 holds: each step's float32 log-softmax is exact only to a few
    # eps32 x |logits| in absolute terms, and a score sums one such term per emitted token.
    steps = max(map(len, want.tokens)) + 1
    tgt = np.full((len(src), steps), cfg.pad_id)
    tgt[:, 0] = cfg.bos_id
    for b, tokens in enumerate(want.tokens):
        tgt[b, 1: len(tokens) + 1] = tokens
    logit_scale = np.abs(from_params(cfg, params, "numpy").logits(src, tgt)).max()
    atol = 4 * steps * np.finfo(np.float32).eps * logit_scale
    for backend in ("torch", "jax"):
        got = from_params(cfg, params, backend).generate(src, beam_size, alpha=0.6, max_len_margin=4)
        assert got.tokens == want.tokens, backend
        np.testing.assert_allclose(got.scores, want.scores, rtol=SCORE_TOLERANCE, atol=atol)


@pytest.mark.parametrize("overrides, intel", [
    ({}, True), ({}, False), (dict(share_embeddings="none", output_bias=True, logit_scale=0.5), False),
    (dict(output_bias=True), True), (dict(output_bias=True), False)])
def test_torch_packed_linears_change_only_the_summation_order(overrides, intel, monkeypatch, request):
    """torch_impl.ops.packed_linears (oneDNN's packed weights for CPU decoding) computes the same
    logits as the plain forward within float32's bound for the model (rosetta.parity.TOLERANCES:
    only the GEMMs' summation order differs; the output bias inside the GEMM where logit_scale is
    1, after the scale otherwise), decodes the same tokens, and leaves the module as it found it;
    with gradients on it changes nothing. The output projection's two ways both run on any CPU:
    MKL's packing where the CPU is said to be Intel's, oneDNN's where it is not (ops._mkl_packs)."""
    import torch

    from rosetta.parity import TOLERANCES
    from torch_impl import ops
    from torch_impl.ops import _can_pack, packed_linears

    monkeypatch.setattr(ops, "intel_cpu", lambda: intel)
    ops._mkl_packs.cache_clear()
    request.addfinalizer(ops._mkl_packs.cache_clear)  # the real CPU's answer for the next test
    assert ops._mkl_packs() == (intel and torch.backends.mkl.is_available()
                                and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"))
    calls, projections = [], []
    packed_linear, packed_projection = ops._packed_linear, ops._packed_projection
    monkeypatch.setattr(ops, "_packed_linear", lambda *args: calls.append(1) or packed_linear(*args))
    monkeypatch.setattr(ops, "_packed_projection",
                        lambda *args: projections.append(1) or packed_projection(*args))
    cfg = preset("tiny", max_len=32, d_model=128, d_ff=256, **overrides)
    model = from_params(cfg, _perturbed(cfg, seed=3), "torch", "float32")
    src, tgt = random_batch(cfg, 3, 7, 5, seed=4)
    src_t, tgt_t = torch.from_numpy(src), torch.from_numpy(tgt)
    with torch.inference_mode():
        if not _can_pack(model.module):
            pytest.skip("this torch build has no oneDNN packed linear: packed_linears does nothing")
        plain = model.module(src_t, tgt_t).numpy()
        with packed_linears(model.module, rows=3):
            packed = model.module(src_t, tgt_t).numpy()
    # Every linear and the output projection went through the packed weights (2 stacks x 2
    # layers: 6 linears an encoder layer, 10 a decoder layer; the output by MKL's where it packs).
    assert len(calls) == 2 * 6 + 2 * 10 + (0 if ops._mkl_packs() else 1) and len(projections) == 1
    assert relative_error(packed, plain) < TOLERANCES["torch", "float32"]
    assert not any("forward" in vars(m) for m in model.module.modules())  # restored
    assert not _can_pack(model.module)  # outside inference mode: gradients on, nothing packed
    unpacked = model._generate(src, 3, 0.6, 8)  # the backend packs: compare with a plain search
    with torch.inference_mode():
        from torch_impl import decode

        plain_search = decode.beam_search(model.module, cfg, src_t, 3, 0.6, 8)
    assert unpacked.tokens == plain_search.tokens


def test_torch_packed_weights_are_kept_until_a_weight_or_the_rows_change(monkeypatch):
    """packed_linears keeps its packing on the module (CTranslate2 packs once, at load): a second
    search with the same rows packs nothing; other rows, or a weight changed in place (an optimizer
    step, a loaded state dict: its version counter moves), repack, and the logits then follow the
    new weights and biases as the plain forward computes them (float32's bound)."""
    import torch

    from rosetta.parity import TOLERANCES
    from torch_impl.ops import _can_pack, packed_linears

    cfg = preset("tiny", max_len=32, output_bias=True)
    model = from_params(cfg, _perturbed(cfg, seed=3), "torch", "float32")
    src_t, tgt_t = (torch.from_numpy(x) for x in random_batch(cfg, 3, 7, 5, seed=4))
    original, packs = torch.ops.mkldnn._reorder_linear_weight, []
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight",
                        lambda w, batch_size: packs.append(batch_size) or original(w, batch_size=batch_size))
    if hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"):  # the output projection's (ops._pack_projection)
        mkl_original = torch.ops.mkl._mkl_reorder_linear_weight
        monkeypatch.setattr(torch.ops.mkl, "_mkl_reorder_linear_weight",
                            lambda w, rows: packs.append(rows) or mkl_original(w, rows))

    def packed(rows: int) -> int:  # the weights packed on entering packed_linears
        before = len(packs)
        with packed_linears(model.module, rows):
            pass
        return len(packs) - before

    with torch.inference_mode():
        if not _can_pack(model.module):
            pytest.skip("this torch build has no oneDNN packed linear: packed_linears does nothing")
        every = sum(isinstance(m, torch.nn.Linear) for m in model.module.modules()) + 1  # and the table
        assert packed(3) == every and packed(3) == 0
        assert packed(12) == every and packs[-1] == 12
        linear = next(m for m in model.module.modules() if isinstance(m, torch.nn.Linear))
        with torch.no_grad():
            linear.weight.mul_(1.5)  # in place: the same address, a new version
            model.module.generator.bias.add_(1.0)  # biases are not packed: read as they are
        assert packed(12) == every
        plain = model.module(src_t, tgt_t).numpy()
        with packed_linears(model.module, 12):
            assert relative_error(model.module(src_t, tgt_t).numpy(), plain) < TOLERANCES["torch", "float32"]
        # A weight made in inference mode has no version counter: packed anew at every call.
        linear.weight = torch.nn.Parameter(linear.weight.clone(), requires_grad=False)
        assert packed(12) == every and packed(12) == every
