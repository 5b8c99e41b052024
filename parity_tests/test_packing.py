"""Sequence packing (docs/packing.md): a packed row gives each of its pairs the logits that pair
gets when run alone, in every backend; the packing batcher; JAX's fused attention.

The expected values are the float64 NumPy reference run on each pair separately (no packing
involved), and for a query with no key left, SPEC §2's formula (uniform weights: the mean of
the values).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jax_impl.ops import fused_attention
from numpy_ref import model as ref
from parity_tests.conftest import variant_config
from rosetta import from_params, init_params
from rosetta.errors import InputError
from rosetta.harness.batching import BatchIterator
from rosetta.harness.data import DataError
from rosetta.inputs import Packing
from rosetta.parity import relative_error

LENGTH = 16  # the packed row length
ROWS = 5  # rows per batch: the pairs below fill 3, two are left as padding rows
# (source tokens, target tokens) per pair, before eos / bos: packed in this order (no shuffle)
# they make rows of 3, 2 and 4 pairs of different lengths.
LENGTHS = [(2, 4), (5, 3), (3, 5), (4, 8), (6, 5), (1, 1), (1, 2), (2, 1), (3, 3)]


def _pairs(cfg, lengths=LENGTHS, seed=0) -> list[tuple[list[int], list[int]]]:
    rng = np.random.default_rng(seed)
    low = 3  # above pad, bos, eos
    return [(rng.integers(low, cfg.src_vocab_size, s).tolist(),
             rng.integers(low, cfg.tgt_vocab_size, t).tolist()) for s, t in lengths]


def _params(cfg, dtype) -> dict[str, np.ndarray]:
    # Perturbed as conftest's fixture does, so that no bias or scale is trivially zero or one.
    rng = np.random.default_rng(1)
    return {k: (v + 0.05 * rng.standard_normal(v.shape)).astype(dtype)
            for k, v in init_params(cfg, seed=0).items()}


def _packed(cfg, pairs):
    it = BatchIterator.from_config(pairs, cfg, max_tokens=LENGTH * ROWS, buckets=[LENGTH], packing=True,
                                   shuffle=False)
    (batch,) = list(it.epoch_batches())
    return batch


def _separate(cfg, params, pair) -> np.ndarray:
    """Logits [T, V] of one pair run alone by the float64 reference, unpacked and unpadded."""
    src = np.array([list(pair[0]) + [cfg.eos_id]])
    tgt_in = np.array([[cfg.bos_id] + list(pair[1])])
    return ref.forward(params, cfg, src, tgt_in)[0]


def _check_against_separate(cfg, batch, logits, params64, tolerance):
    assert np.isfinite(logits).all()  # padding rows and positions too (SPEC §2)
    checked = 0
    for r in range(batch.shape[0]):
        for k, i in enumerate(batch.indices[r].tolist()):
            if i < 0:
                continue
            where = batch.tgt_segments[r] == k + 1
            want = _separate(cfg, params64, _pairs(cfg)[i])
            assert want.shape[0] == where.sum()
            err = relative_error(logits[r][where], want)
            assert err <= tolerance, f"pair {i} (row {r}, segment {k + 1}): relative error {err:.2e}"
            checked += 1
    assert checked == len(LENGTHS)


VARIANTS = ["post_norm_relu", "pre_norm_gelu", "share_none_unequal_vocab_output_bias",
            "start_token_is_pad_eps_1e-6", "concat_t2t_positions"]


def test_the_packed_batch_holds_rows_of_two_to_four_pairs_and_padding_rows():
    batch = _packed(variant_config("post_norm_relu"), _pairs(variant_config("post_norm_relu")))
    per_row = (batch.indices >= 0).sum(axis=1).tolist()
    assert per_row == [3, 2, 4, 0, 0]
    assert batch.src_segments.max(axis=1).tolist() == per_row


@pytest.mark.parametrize("variant", VARIANTS)
def test_numpy_packed_row_gives_each_pair_its_own_logits(variant):
    cfg = variant_config(variant)
    params = _params(cfg, np.float64)
    batch = _packed(cfg, _pairs(cfg))
    logits = ref.forward(params, cfg, batch.src, batch.tgt_in, packing=batch.packing())
    _check_against_separate(cfg, batch, logits, params, 1e-12)


@pytest.mark.parametrize("backend,dtype,tolerance", [
    ("torch", "float32", 1e-5), ("jax", "float32", 1e-5),
    ("torch", "bfloat16", 3e-2), ("jax", "bfloat16", 3e-2)])
@pytest.mark.parametrize("variant", ["pre_norm_gelu", "start_token_is_pad_eps_1e-6"])
def test_backend_packed_row_matches_the_reference_run_separately(backend, dtype, tolerance, variant):
    cfg = variant_config(variant)
    batch = _packed(cfg, _pairs(cfg))
    model = from_params(cfg, _params(cfg, np.float32), backend, dtype)
    with model._context():
        if backend == "torch":
            packing = Packing(*(torch.from_numpy(a) for a in batch.packing()))
            logits = model.module(torch.from_numpy(batch.src), torch.from_numpy(batch.tgt_in),
                                  packing=packing)
            logits = logits.float().numpy()
        else:
            packing = Packing(*(jnp.asarray(a) for a in batch.packing()))
            logits = model.module(jnp.asarray(batch.src), jnp.asarray(batch.tgt_in), packing=packing)
            logits = np.asarray(logits.astype(jnp.float32))
    params64 = {k: v.astype(np.float64) for k, v in _params(cfg, np.float32).items()}  # the same weights
    _check_against_separate(cfg, batch, logits.astype(np.float64), params64, tolerance)


def test_unpacked_call_is_unchanged_and_partial_packing_is_refused():
    cfg = variant_config("post_norm_relu")
    params = _params(cfg, np.float64)
    batch = _packed(cfg, _pairs(cfg))
    packing = batch.packing()
    with pytest.raises(InputError, match="needs all of"):
        ref.forward(params, cfg, batch.src, batch.tgt_in,
                    packing=Packing(packing.src_segments, None, None, None))
    with pytest.raises(InputError, match="tgt_positions must lie"):
        ref.forward(params, cfg, batch.src, batch.tgt_in,
                    packing=packing._replace(tgt_positions=packing.tgt_positions + LENGTH))
    tensors = Packing(*(torch.from_numpy(a) for a in packing))
    tensors = tensors._replace(src_positions=torch.zeros(1, 2, dtype=torch.long))
    model = from_params(cfg, _params(cfg, np.float32), "torch", "float32")
    with pytest.raises(InputError, match="src_positions has shape"):
        model.module(torch.from_numpy(batch.src), torch.from_numpy(batch.tgt_in), packing=tensors)


# -- the batcher ---------------------------------------------------------------------------

def _iterator(pairs, **kwargs) -> BatchIterator:
    settings = dict(max_tokens=4 * 24, max_len=64, buckets=[8, 24], packing=True, seed=3)
    return BatchIterator(pairs, **{**settings, **kwargs})


def _random_pairs(n=60, seed=5):
    rng = np.random.default_rng(seed)
    return [(rng.integers(3, 50, rng.integers(0, 12)).tolist(),
             rng.integers(3, 50, rng.integers(1, 12)).tolist()) for _ in range(n)]


def test_packing_batches_every_pair_once_per_epoch_in_consistent_fixed_rows():
    pairs = _random_pairs() + [([5] * 30, [6])]  # the last one is longer than the row: dropped
    it = _iterator(pairs)
    assert it.pack_length == 24 and it.dropped == [len(pairs) - 1] and it.shapes == [(4, 24)]
    for _ in range(2):
        seen = []
        for batch in it.epoch_batches():
            assert batch.packed and batch.shape == (4, 24)
            assert batch.indices.shape == (4, 24)
            assert batch.num_tgt_tokens == int((batch.labels != 0).sum())
            assert batch.num_src_tokens == int((batch.src != 0).sum())
            for r in range(4):
                row = [i for i in batch.indices[r].tolist() if i >= 0]
                seen += row
                assert (batch.indices[r, len(row):] == -1).all()
                src_at = tgt_at = 0
                for k, i in enumerate(row):
                    s, t = pairs[i][0] + [2], pairs[i][1]
                    ss, ts = slice(src_at, src_at + len(s)), slice(tgt_at, tgt_at + len(t) + 1)
                    assert batch.src[r, ss].tolist() == s
                    assert batch.tgt_in[r, ts].tolist() == [1] + t  # bos per segment
                    assert batch.labels[r, ts].tolist() == t + [2]  # eos per segment
                    assert (batch.src_segments[r, ss] == k + 1).all()
                    assert (batch.tgt_segments[r, ts] == k + 1).all()
                    assert batch.src_positions[r, ss].tolist() == list(range(len(s)))
                    assert batch.tgt_positions[r, ts].tolist() == list(range(len(t) + 1))
                    src_at, tgt_at = ss.stop, ts.stop
                for a, at in ((batch.src, src_at), (batch.tgt_in, tgt_at), (batch.labels, tgt_at)):
                    assert (a[r, at:] == 0).all()
                assert (batch.src_segments[r, src_at:] == 0).all()
                assert (batch.tgt_segments[r, tgt_at:] == 0).all()
        assert sorted(seen) == list(range(len(pairs) - 1))
    assert it.epoch == 2


def test_packing_order_depends_on_seed_and_epoch_only():
    pairs = _random_pairs()
    a, b = _iterator(pairs), _iterator(pairs)
    first = [x.indices for x in a.epoch_batches()]
    assert all((x == y.indices).all() for x, y in zip(first, b.epoch_batches(), strict=True))
    second = [x.indices for x in a.epoch_batches()]
    assert not all(x.shape == y.shape and (x == y).all() for x, y in zip(first, second, strict=False))
    other = [x.indices for x in _iterator(pairs, seed=4).epoch_batches()]
    assert not all(x.shape == y.shape and (x == y).all() for x, y in zip(first, other, strict=False))


def test_packing_resumes_mid_epoch_with_the_identical_continuation():
    pairs = _random_pairs()
    it = _iterator(pairs)
    for _ in range(it.batches_per_epoch + 2):  # into the second epoch
        next(it)
    state = it.state_dict()
    # The default row length: the longest pair (11 ids + eos, or bos + 11 ids) rounded up to 16.
    longest = max(max(len(x) + 1, len(y) + 1) for x, y in pairs)
    assert longest <= 16 and state["pack_length"] == 16 and state["epoch"] == 1
    want = [next(it) for _ in range(it.batches_per_epoch + 3)]  # across the next epoch boundary
    fresh = _iterator(pairs)
    fresh.load_state_dict(state)
    for w in want:
        g = next(fresh)
        for name in ("src", "tgt_in", "labels", "indices", "src_segments", "tgt_segments", "src_positions",
                     "tgt_positions"):
            assert (getattr(g, name) == getattr(w, name)).all(), name
    with pytest.raises(DataError, match="pack_length"):
        BatchIterator(pairs, max_tokens=96, max_len=64, buckets=[8, 24], seed=3).load_state_dict(state)
    with pytest.raises(DataError, match="pack_length"):
        _iterator(pairs, pack_length=20).load_state_dict(state)


def test_packing_arguments_are_checked():
    with pytest.raises(DataError, match="packing is off"):
        BatchIterator(_random_pairs(), max_tokens=96, max_len=64, pack_length=24)
    with pytest.raises(DataError, match="max_len"):
        _iterator(_random_pairs(), pack_length=65)


# -- JAX's fused attention -----------------------------------------------------------------

@pytest.mark.parametrize("dtype,tolerance", [("float32", 1e-5), ("bfloat16", 3e-2)])
def test_jax_fused_attention_equals_the_explicit_path_with_a_row_without_keys(dtype, tolerance):
    cfg = variant_config("post_norm_relu")
    model = from_params(cfg, _params(cfg, np.float32), "jax", dtype)
    attn = model.module.encoder.layers[0].self_attn
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 7, cfg.d_model)), dtype=attn.q.dtype)
    mask = rng.random((3, 1, 7, 7)) < 0.6
    mask[0, 0, 2] = False  # one query without any key
    mask[2] = False  # a row of the batch without any key at all
    mask = jnp.asarray(mask)
    with model._context():
        k, v = attn.project_kv(x)
        explicit = attn.attend(x, k, v, mask, record={})  # record: the explicit softmax path
        # Called directly: attend() takes the fused path on GPUs only (not on this CPU).
        q = attn.split_heads(attn.q(x))
        fused = attn.o(fused_attention(q, k, v, mask).reshape(x.shape))
    explicit, fused = (np.asarray(a.astype(jnp.float32), dtype=np.float64) for a in (explicit, fused))
    assert np.isfinite(fused).all()
    assert relative_error(fused, explicit) <= tolerance
    # SPEC §2's rule, from its formula: uniform weights, so the o projection of the values' mean.
    p = {name: np.asarray(value, dtype=np.float64) for name, value in model.to_params().items()
         if name.startswith("encoder.layers.0.self_attn.")}
    p = ref.sub(p, "encoder.layers.0.self_attn")
    v64 = np.asarray(v.astype(jnp.float32), dtype=np.float64)  # (B, h, Tk, dh)
    mean = v64.mean(axis=2).reshape(3, 1, cfg.d_model)  # heads side by side, as the o projection takes them
    want = ref.dense(ref.sub(p, "o"), mean)
    for b, q in ((0, 2), (2, 0), (2, 6)):
        assert relative_error(fused[b, q], want[b, 0]) <= tolerance, (b, q)


def test_xla_dot_product_attention_gives_uniform_weights_where_no_key_is_left():
    # Why the XLA path needs no fix (jax_impl/ops.py's fused_attention keeps one anyway, for cuDNN).
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 4, 2, 8)), jnp.float32) for _ in range(3))
    mask = jnp.zeros((1, 2, 4, 4), dtype=bool)
    y = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
    uniform = np.broadcast_to(np.asarray(v).mean(axis=1, keepdims=True), y.shape)
    np.testing.assert_allclose(np.asarray(y), uniform, rtol=1e-6, atol=1e-6)


# -- The fused paths, whatever a kernel gives a row without keys ----------------------------------

def _masked(mask):
    """Where a kernel sees a key masked: a boolean mask's False, an additive one's huge negatives."""
    return ~mask if mask.dtype in (torch.bool, jnp.bool_) else mask <= -1e30


@pytest.mark.parametrize("fill", [0.0, float("nan")])
@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_fused_attention_keeps_spec_rows_whatever_the_kernel_gives_them(framework, fill, monkeypatch):
    """SPEC §2 on the fused path (SDPA; jax.nn.dot_product_attention) with a kernel that gives a row
    whose keys are all masked zeros or NaN, as GPU kernels may (an H100's SDPA gave such a row
    another answer: a 1.1e-1 error at 7b235f9, benchmarks/gpu_check.py): the output and the gradients
    equal the float64 formula's (uniform weights: the values' mean; no gradient to q and k)."""
    from torch.nn import functional as F

    from torch_impl.ops import attention as torch_attention

    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((2, 2, 5, 4)) for _ in range(4))
    g = g.transpose(0, 2, 1, 3)  # the output's cotangent, (B, Tq, h, dh)
    mask = rng.random((2, 1, 5, 5)) < 0.6
    mask[:, :, :, 0] = True
    mask[0, 0, 2] = False  # one query without any key
    mask[1] = False  # a row of the batch without any key at all
    # The formula in float64: masked scores at the most negative finite value (uniform where none is left).
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    lowest = torch.finfo(torch.float64).min
    scores = (tq @ tk.transpose(-2, -1) / 2.0).masked_fill(~torch.tensor(mask), lowest)
    want = (scores.softmax(-1) @ tv).transpose(1, 2)
    want_grads = torch.autograd.grad((want * torch.tensor(g)).sum(), (tq, tk, tv))
    if framework == "torch":
        real = F.scaled_dot_product_attention

        def kernel(q, k, v, attn_mask, dropout_p=0.0):
            y = real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)
            return torch.where(_masked(attn_mask).all(-1, keepdim=True), fill, y)

        monkeypatch.setattr(F, "scaled_dot_product_attention", kernel)
        tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
        got = torch_attention(tq, tk, tv, torch.tensor(mask), 0.0)[0]
        grads = torch.autograd.grad((got * torch.tensor(g)).sum(), (tq, tk, tv))
        got, grads = got.detach().numpy(), [x.numpy() for x in grads]
    else:
        real = jax.nn.dot_product_attention

        def kernel(q, k, v, mask, implementation=None):  # BTNH: the rows are (B, N, T)
            y = real(q, k, v, mask=mask, implementation="xla")
            empty = _masked(mask).all(-1)  # (B, N, T)
            return jnp.where(empty.transpose(0, 2, 1)[..., None], fill, y)

        monkeypatch.setattr(jax.nn, "dot_product_attention", kernel)

        def loss(q, k, v):
            return (fused_attention(q, k, v, jnp.asarray(mask)) * g).sum()

        # float32: XLA's dot_product_attention takes its softmax in float32 whatever the inputs
        # (jax_impl/ops.py fused_kernels); a few float32 roundings of O(1) values, well under 1e-5.
        args = tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v))
        got = np.asarray(fused_attention(*args, jnp.asarray(mask)))
        grads = [np.asarray(x) for x in jax.grad(loss, argnums=(0, 1, 2))(*args)]
    bound = 1e-12 if framework == "torch" else 1e-5
    np.testing.assert_allclose(got, want.detach().numpy(), rtol=bound, atol=bound)
    for name, a, b in zip("qkv", grads, want_grads, strict=True):
        np.testing.assert_allclose(a, b.numpy(), rtol=bound, atol=bound, err_msg=name)
    assert not grads[0][0, :, 2].any() and not grads[0][1].any()  # exactly zero where no key is left
