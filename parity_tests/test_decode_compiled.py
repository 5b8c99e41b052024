"""PyTorch decoding as one captured step (torch_impl/decode.py, docs/decoding.md): the search step
compiled whole (fullgraph: a graph break or a host read is an error) gives the eager search's
tokens, greedy and beam, float32 and bfloat16, with Hugging Face's constraints; it compiles once
per search kind however the batch and the output length vary. Graph capture through a counting
backend (aot_eager or eager), not inductor's code generation (~15-35 s a search graph on a 2-core
CPU), but for one small graph (the beam cache update). The code a GPU runs is the same but for the
device (CUDA graphs there: not testable here)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

from parity_tests.test_decoding import _decision_margin, _perturbed
from rosetta import from_params, preset
from rosetta.parity import random_batch
from torch_impl import compilation, decode
from torch_impl.backend import Model

# Compiled against eager scores in float32: the compiled step attends over the whole static cache
# (positions > t weigh exactly 0) where eager attends over positions <= t only; SDPA's sums then
# group differently, so the last bits differ (the tokens do not). A few float32 eps, relative.
EAGER_SCORE_RTOL = 1e-6


@pytest.fixture
def counter(monkeypatch):
    """Compiles through a counting backend that runs the captured graph with eager kernels (aot_eager:
    AOT autograd's functionalized graph); dynamo's caches are emptied before and after."""
    torch._dynamo.reset()
    backend = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(compilation, "BACKEND", backend)
    yield backend
    torch._dynamo.reset()


def _case(seed=9):
    """A tiny model whose greedy decisions are far from ties (checked): token identity across
    arithmetic orders is then a real check, not luck."""
    cfg = preset("tiny", max_len=40)
    params = _perturbed(cfg, seed=seed)
    src, _ = random_batch(cfg, 4, 8, 2, seed=seed + 1)
    return cfg, params, src


def _uncompiled(monkeypatch):
    """The compiled search's own step (a tensor t, static cache, exact top-k), run without compiling."""
    monkeypatch.setattr(compilation, "compiled", lambda fn, **kwargs: fn)


@pytest.mark.parametrize("beam_size", [1, 4])
def test_compiled_search_equals_eager_and_the_reference(counter, monkeypatch, beam_size):
    cfg, params, src = _case()
    reference = from_params(cfg, params, "numpy")
    assert _decision_margin(params, cfg, src, reference.generate(src, 1, max_len_margin=6).tokens) > 0.1
    want = reference.generate(src, beam_size, max_len_margin=6)
    eager = Model(cfg, params, "float32", "cpu", compile=False).generate(src, beam_size, max_len_margin=6)
    got = Model(cfg, params, "float32", "cpu", compile=True).generate(src, beam_size, max_len_margin=6)
    assert counter.frame_count == 1  # one graph, whole (fullgraph: a break would have raised)
    assert got.tokens == eager.tokens == want.tokens
    np.testing.assert_allclose(got.scores, eager.scores, rtol=EAGER_SCORE_RTOL)
    _uncompiled(monkeypatch)  # the same step uncompiled: the same arithmetic, bit for bit
    same = Model(cfg, params, "float32", "cpu", compile=True).generate(src, beam_size, max_len_margin=6)
    assert same.tokens == got.tokens
    np.testing.assert_array_equal(same.scores, got.scores)


@pytest.mark.parametrize("beam_size", [1, 4])
def test_steps_after_every_sentence_finished_change_nothing(counter, monkeypatch, beam_size):
    """A compiled search reads its done flags every SYNC_EVERY steps: it runs up to SYNC_EVERY - 1
    steps more than eager, which stops at once; finished sentences are frozen, so the result is
    the same. A model leaning to eos (an output bias), so that sentences end before the limit."""
    cfg = preset("tiny", max_len=40, output_bias=True)
    params = _perturbed(cfg, seed=9)
    params["generator.bias"][cfg.eos_id] = 4.0
    src, _ = random_batch(cfg, 4, 8, 2, seed=10)
    L = 8 + 20  # source length + margin
    eager_steps, compiled_steps = [], []
    logits = decode.Steps.logits  # a step's decoder pass, greedy's and beam search's
    monkeypatch.setattr(decode.Steps, "logits",
                        lambda self, *args: eager_steps.append(1) or logits(self, *args))
    eager = Model(cfg, params, "float32", "cpu", compile=False).generate(src, beam_size, 0.6, 20)
    monkeypatch.setattr(decode.Steps, "logits", logits)
    original = compilation.compiled

    def counting(fn, **kwargs):
        step = original(fn, **kwargs)
        return lambda state: compiled_steps.append(1) or step(state)

    monkeypatch.setattr(compilation, "compiled", counting)
    got = Model(cfg, params, "float32", "cpu", compile=True).generate(src, beam_size, 0.6, 20)
    every = decode.SYNC_EVERY
    assert len(eager_steps) < len(compiled_steps) == min(L, -(-len(eager_steps) // every) * every)
    assert got.tokens == eager.tokens
    np.testing.assert_allclose(got.scores, eager.scores, rtol=EAGER_SCORE_RTOL)


@pytest.mark.parametrize("beam_size", [1, 4])
def test_compiled_bfloat16_search_equals_eager(counter, monkeypatch, beam_size):
    """Autocast around the compiled step, the cache in bfloat16; eager bfloat16 on a CPU runs
    unpacked (torch_impl.ops._can_pack: oneDNN's packed float32 weights refuse bfloat16 input)."""
    cfg, params, src = _case()
    eager = Model(cfg, params, "bfloat16", "cpu", compile=False).generate(src, beam_size, max_len_margin=6)
    got = Model(cfg, params, "bfloat16", "cpu", compile=True).generate(src, beam_size, max_len_margin=6)
    assert counter.frame_count == 1
    assert got.tokens == eager.tokens
    np.testing.assert_allclose(got.scores, eager.scores, rtol=1e-2)  # bfloat16: 2^-8 relative steps
    _uncompiled(monkeypatch)
    same = Model(cfg, params, "bfloat16", "cpu", compile=True).generate(src, beam_size, max_len_margin=6)
    assert same.tokens == got.tokens
    np.testing.assert_array_equal(same.scores, got.scores)


def test_bfloat16_on_a_cpu_does_not_pack_and_decodes_as_unpacked():
    """`rosetta translate --dtype bfloat16` on a CPU died in oneDNN ("could not create a primitive
    descriptor"): packed_linears packed float32 weights for bfloat16 activations under autocast. Now
    the weights are cast to bfloat16 once (torch_impl/backend.py: compute_context): nothing to pack."""
    from torch_impl.ops import _can_pack

    cfg, params, src = _case()
    model = Model(cfg, params, "bfloat16", "cpu", compile=False)
    got = model.generate(src, 1, max_len_margin=6)
    with model._context():  # the model's bfloat16 weights in place, as generate computes
        assert not _can_pack(model.module)
        plain = decode.greedy_search(model.module, cfg, torch.from_numpy(src), 6)
    assert got.tokens == plain.tokens
    np.testing.assert_array_equal(got.scores, plain.scores)


@pytest.mark.parametrize("beam_size", [1, 4])
def test_compilations_stay_bounded_as_batches_and_outputs_vary(monkeypatch, beam_size):
    """torch_impl/decode.py's `run`: automatic dynamic shapes, with the rows N, the source length S
    and the cache length L marked dynamic before the first call: one graph for every batch of two
    sentences or more and every length of two or more, and one more for one-sentence batches
    (dynamo specializes size 1)."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("eager")  # capture only: cheapest
    monkeypatch.setattr(compilation, "BACKEND", counter)
    cfg = preset("tiny", max_len=64)
    model = Model(cfg, _perturbed(cfg, seed=3), "float32", "cpu", compile=True)
    try:
        for (B, S, margin) in [(3, 5, 2), (3, 5, 9), (3, 5, 17), (5, 7, 3), (2, 9, 12), (4, 4, 0)]:
            src, _ = random_batch(cfg, B, S, 2, seed=B + S)
            model.generate(src, beam_size, 0.6, margin)
        assert counter.frame_count == 1
        for (S, margin) in [(6, 5), (3, 11)]:
            model.generate(random_batch(cfg, 1, S, 2, seed=S)[0], beam_size, 0.6, margin)
        assert counter.frame_count == 2
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("beam_size,rule", [(1, "wu"), (4, "hf")])
def test_compiled_constraints_equal_eager(counter, beam_size, rule):
    """Hugging Face's generation settings (rosetta.generation.Constraints) inside the compiled step."""
    cfg, params, src = _case()
    kwargs = dict(length_rule=rule, banned=(5, 7, 11), renormalize=True, max_new_tokens=5, forced_eos=True,
                  forced_first=13)
    want = from_params(cfg, params, "numpy").generate(src, beam_size, 1.0, 6, **kwargs)
    eager = Model(cfg, params, "float32", "cpu", compile=False).generate(src, beam_size, 1.0, 6, **kwargs)
    got = Model(cfg, params, "float32", "cpu", compile=True).generate(src, beam_size, 1.0, 6, **kwargs)
    assert counter.frame_count == 1
    assert got.tokens == eager.tokens == want.tokens
    assert all(len(row) < 5 for row in got.tokens)  # forced eos at the 5th token, stripped
    assert all(row[0] == 13 for row in got.tokens)  # forced first (a tensor t == 0 in the step)
    np.testing.assert_allclose(got.scores, eager.scores, rtol=EAGER_SCORE_RTOL)


def test_static_cache_step_logits_equal_the_reference():
    """step_logits of a compiling model: the compiled step's static-cache path (a tensor t, the whole
    cache attended, positions > t masked), one position at a time, against the float64 reference."""
    from parity_tests.test_decoding import STEP_TOLERANCE
    from rosetta.parity import relative_error

    cfg = preset("tiny", norm_first=True, share_embeddings="none", output_bias=True)
    params = _perturbed(cfg)
    src, tgt = random_batch(cfg, 3, 9, 12, seed=4, pad=False)
    src[1:, 6:] = cfg.pad_id
    want = from_params(cfg, params, "numpy").logits(src, tgt)
    got = Model(cfg, params, "float32", "cpu", compile=True).step_logits(src, tgt)
    assert relative_error(got, want) <= STEP_TOLERANCE


@pytest.mark.parametrize("stacked", [False, True])
def test_inductor_compiles_the_beam_cache_update_as_eager(stacked):
    """The one test through inductor's code generation (a small graph: a few seconds): a beam step's
    cache update, reorder then write (torch_impl/ops.py's LayerCache; `stacked`: reorder_stack over
    every layer's stacked cache, decode.STACKED_CACHE, the layer a slice of it), as eager computes
    it. In the other order inductor reads rows it has already overwritten (pytorch/pytorch#198270)."""
    from torch_impl.ops import LayerCache, reorder_stack

    def update(cache: LayerCache, rows: torch.Tensor, t: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        if stacked:
            reorder_stack(cache.stack, rows, t)
        else:
            cache.reorder(rows, t)
        return cache.write(t, k, -k, torch.ones(10, dtype=torch.bool))[0] * 2.0  # read after the write

    torch._dynamo.reset()
    generator = torch.Generator().manual_seed(0)
    N, h, L, dh = 12, 2, 10, 8
    want = LayerCache(torch.randn(3, 2, N, h, L, dh, generator=generator), 1,  # layer 1 of 3
                      *(torch.randn(N, h, 3, dh, generator=generator) for _ in range(2)))
    got = LayerCache(want.stack.clone(), 1, want.cross_k.clone(), want.cross_v.clone())
    for x in got.tensors():
        torch._dynamo.mark_static_address(x)
    step = compilation.compiled(update, dynamic=None)
    try:
        with torch.inference_mode():
            for t in map(torch.tensor, range(3)):
                rows = torch.randint(0, N, (N,), generator=generator)
                k = torch.randn(N, h, 1, dh, generator=generator)
                assert torch.equal(step(got, rows, t, k), update(want, rows, t, k))
                for a, b in zip(got.tensors(), want.tensors(), strict=True):
                    assert torch.equal(a, b)
    finally:
        torch._dynamo.reset()


def test_compiled_topk_keys_need_no_constant_past_int32():
    """topk_exact through inductor (a small graph: a few seconds): the beam's tie-broken top-k as
    eager gives it, and no integer constant in [2^31, 2^32) in the generated code. Triton's index
    arithmetic is int32: a `2**32 - 1 - position` key failed to compile for beam-4 decoding of `base`
    on an H200 (torch 2.11); the CPU's C++ takes it, so the constant itself is what is checked here."""
    import re

    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    x = torch.randn(6, 148, generator=torch.Generator().manual_seed(0))
    x[:, 7] = x[:, 3]  # ties: the lower index first
    step = compilation.compiled(lambda x: decode.topk_exact(x, 8), dynamic=None)
    try:
        (values, index), codes = run_and_get_code(step, x)
    finally:
        torch._dynamo.reset()
    want_values, want_index = decode.topk_stable(x, 8)
    assert torch.equal(values, want_values) and torch.equal(index, want_index)
    constants = {int(c) for code in codes for c in re.findall(r"(?<![\w.])(\d{10,})L?(?![\w.])", code)}
    assert not [c for c in constants if 2**31 <= c < 2**32], constants
