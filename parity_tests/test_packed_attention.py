"""Attention restricted to the packed blocks (docs/packing.md): FlexAttention over a BlockMask of the
segment ids (torch_impl/ops.py: packed_mask, block_mask, SegmentMask), CUDA's default for packed
rows, run here on the CPU as its twin by setting ops.PACKED_ATTENTION["cpu"]. It equals the dense
block-diagonal mask and the float64 NumPy reference (encoder self-attention, the decoder's causal
self-attention, cross-attention; a whole packed forward; a training step's loss and gradients), a
query with no key gets exactly the dense path's output (SPEC §2's mean of the values), and the
BlockMask leaves out the tiles between segments, counted by hand for a hand-built layout.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters
from torch.nn.attention import flex_attention as flex_module

from numpy_ref import model as ref
from parity_tests.conftest import variant_config
from parity_tests.test_packing import _packed, _pairs, _params
from rosetta.inputs import Packing
from rosetta.parity import TOLERANCES, relative_error
from torch_impl import ops
from torch_impl.convert import build_model
from torch_impl.train import forward_loss

FLOAT32 = TOLERANCES[("torch", "float32")]  # 1e-5, the float32 parity bound (rosetta/parity.py)
FLOAT64 = TOLERANCES[("torch", "float64")]  # 1e-12


@pytest.fixture
def kernel(monkeypatch):
    """Sets packed attention's kernel on the CPU for one test (the module's choice, read by
    packed_mask; CUDA's default, "flex_compiled", is what the CPU twin runs) and returns the list
    of FlexAttention calls made since (each call's `compiled`), so a test sees that it ran."""
    calls: list[bool] = []
    attend = ops.SegmentMask.attend

    def counted(self, q, k, v):
        calls.append(self.compiled)
        return attend(self, q, k, v)

    monkeypatch.setattr(ops.SegmentMask, "attend", counted)

    def choose(name: str) -> list[bool]:
        monkeypatch.setitem(ops.PACKED_ATTENTION, "cpu", name)
        return calls
    return choose


def _segments(*rows: list[tuple[int, int]]) -> torch.Tensor:
    """[B, T] segment ids from runs (segment, length) per row."""
    return torch.tensor([[s for s, n in row for _ in range(n)] for row in rows])


# -- The BlockMask skips the tiles between segments ------------------------------------------------

# Rows of 384 target and 256 source positions: tiles of 128 (FlexAttention's default), 3 x 3 for
# self-attention, 3 x 2 for cross-attention. Row 0 packs three pairs, row 1 is a padding row, row 2
# is one pair filling the row (every tile needed).
TGT = _segments([(1, 128), (2, 172), (3, 60), (0, 24)], [(0, 384)], [(1, 384)])
SRC = _segments([(1, 100), (2, 100), (3, 40), (0, 16)], [(0, 256)], [(1, 256)])
# By hand, (non-empty tiles, of which full) per row, tile (i, j) = query tile i, key tile j:
# - encoder-style self-attention on TGT, row 0: query tile 0 is segment 1 alone: (0, 0) full, (0, 1)
#   and (0, 2) empty. Tile 1 (positions 128-255) is segment 2 alone: (1, 0) empty, (1, 1) full, (1, 2)
#   partial (its keys 256-299). Tile 2 (segment 2's 256-299, 3, padding): (2, 0) empty, (2, 1) and
#   (2, 2) partial. 5 of 9, 2 full. Row 1: none. Row 2: 9, all full.
# - causal, row 0: (0, 0), (1, 1), (2, 2) cut by the diagonal (partial), (1, 2) now empty (keys after
#   every query), (2, 1) partial (segment 3's queries see none of it): 4, none full. Row 2: the 3
#   diagonal tiles partial, the 3 below full: 6, 3 full.
# - cross-attention (TGT queries, SRC keys), row 0: source tile 0 holds segments 1 and 2, tile 1
#   segments 2, 3 and padding. Query tile 0 (segment 1): (0, 0) partial, (0, 1) empty; tiles 1 and 2
#   (segments 2, 3) meet segment 2 or 3 in both key tiles: 5 of 6, none full. Row 2: 6, all full.
TILES = {"encoder": ([5, 0, 9], [2, 0, 9]), "causal": ([4, 0, 6], [0, 0, 3]), "cross": ([5, 0, 6], [0, 0, 6])}
CASES = {"encoder": (TGT, TGT, False), "causal": (TGT, TGT, True), "cross": (TGT, SRC, False)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_block_mask_leaves_out_the_tiles_between_segments(case):
    q_segments, k_segments, causal = CASES[case]
    mask = ops.block_mask(q_segments, k_segments, causal)
    partial, full = mask.kv_num_blocks.sum(dim=(1, 2)), mask.full_kv_num_blocks.sum(dim=(1, 2))
    assert ((partial + full).tolist(), full.tolist()) == TILES[case]
    total = q_segments.shape[0] * -(-q_segments.shape[1] // 128) * -(-k_segments.shape[1] // 128)
    assert int((partial + full).sum()) < total
    # Position by position, its mask_mod is the NumPy reference's segment mask.
    dense = flex_module.create_mask(mask.mask_mod, q_segments.shape[0], 1, q_segments.shape[1],
                                    k_segments.shape[1], device="cpu")
    assert np.array_equal(dense.numpy(), ref.segment_mask(q_segments.numpy(), k_segments.numpy(), causal))


# -- One attention: FlexAttention, the dense mask and eq. 1 in float64 -----------------------------

# Small rows for the kernels: row 0 packs three target segments but two source ones, so its
# segment-3 queries have no key in cross-attention (as its padding positions have none anywhere);
# row 1 is a padding row, row 2 one segment.
SMALL = {"tgt": _segments([(1, 7), (2, 9), (3, 5), (0, 3)], [(0, 24)], [(1, 24)]),
         "src": _segments([(1, 6), (2, 10), (0, 4)], [(0, 20)], [(1, 20)])}
SMALL_CASES = {"encoder": ("tgt", "tgt", False), "causal": ("tgt", "tgt", True),
               "cross": ("tgt", "src", False)}


def _reference(q, k, v, mask) -> np.ndarray:
    """Eq. 1 in float64 with the NumPy reference's rule: masked scores set to the most negative
    finite value, so a query with no key gets uniform weights (SPEC §2). (B, Tq, h, dh)."""
    q, k, v = (x.double().numpy() for x in (q, k, v))
    scores = np.where(mask, q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1]), np.finfo(np.float64).min)
    return (ref.softmax(scores) @ v).transpose(0, 2, 1, 3)


# Compiled: cross-attention, its two segment arrays and its queries without a key (the compiled
# packed forward below runs all three kinds).
@pytest.mark.parametrize("case,flex", [("encoder", "flex"), ("causal", "flex"), ("cross", "flex"),
                                       ("cross", "flex_compiled")])
def test_flex_attention_equals_the_dense_mask_and_eq1(kernel, case, flex):
    q_name, k_name, causal = SMALL_CASES[case]
    q_segments, k_segments = SMALL[q_name], SMALL[k_name]
    generator = torch.Generator().manual_seed(0)
    B, h, dh = q_segments.shape[0], 2, 8
    q = torch.randn(B, h, q_segments.shape[1], dh, generator=generator)
    k, v = (torch.randn(B, h, k_segments.shape[1], dh, generator=generator) for _ in range(2))
    dense = torch.from_numpy(ref.segment_mask(q_segments.numpy(), k_segments.numpy(), causal))
    calls = kernel(flex)
    segment_mask = ops.packed_mask(dense, q_segments, k_segments, causal)
    assert isinstance(segment_mask, ops.SegmentMask) and segment_mask.compiled == (flex == "flex_compiled")
    with torch.no_grad():  # torch 2.13's CPU FlexAttention is forward-only (the training test below)
        got, _ = ops.attention(q, k, v, segment_mask, 0.0)
        plain, _ = ops.attention(q, k, v, dense, 0.0)
    assert calls == [flex == "flex_compiled"]  # FlexAttention ran once, the dense path did not
    want = _reference(q, k, v, dense.numpy())
    assert relative_error(got.double().numpy(), want) <= FLOAT32
    assert relative_error(plain.double().numpy(), want) <= FLOAT32
    assert relative_error(got.double().numpy(), plain.double().numpy()) <= FLOAT32
    # Queries without a key: exactly what the dense path gives, the mean of the values.
    no_key = ~dense.any(dim=-1)[:, 0]  # [B, Tq]
    # Row 0's 3 padding queries and row 1's 24; across, row 0's 5 queries of segment 3 too.
    assert int(no_key.sum()) == (32 if case == "cross" else 27)
    assert torch.equal(got[no_key], plain[no_key])
    assert torch.equal(got[no_key], v.mean(dim=2)[:, None].expand(-1, no_key.shape[1], -1, -1)[no_key])
    if flex == "flex_compiled":  # another batch's layout, same shapes: the same compiled kernel
        graphs = counters["stats"]["unique_graphs"]
        flipped = {name: segments.flip(0) for name, segments in SMALL.items()}  # one tensor when self
        q_segments, k_segments = flipped[q_name], flipped[k_name]
        dense = torch.from_numpy(ref.segment_mask(q_segments.numpy(), k_segments.numpy(), causal))
        with torch.no_grad():
            got, _ = ops.attention(q, k, v, ops.packed_mask(dense, q_segments, k_segments, causal), 0.0)
        assert counters["stats"]["unique_graphs"] == graphs and len(calls) == 2
        assert relative_error(got.double().numpy(), _reference(q, k, v, dense.numpy())) <= FLOAT32


def test_the_default_is_dense_on_the_cpu_and_flexattention_compiled_on_cuda():
    dense = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    segments = torch.ones(1, 4, dtype=torch.long)
    assert ops.packed_mask(dense, segments, segments, False) is dense
    assert ops.PACKED_ATTENTION == {"cuda": "flex_compiled"}


def test_an_unknown_kernel_is_refused_in_one_line(kernel):
    kernel("splash")
    segments = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="PACKED_ATTENTION\\['cpu'\\] is 'splash'"):
        ops.packed_mask(torch.ones(1, 1, 4, 4, dtype=torch.bool), segments, segments, False)


# -- The model: a packed forward and a training step -----------------------------------------------

def _batch(cfg):
    batch = _packed(cfg, _pairs(cfg))  # rows of 16: 3, 2 and 4 pairs, and two padding rows
    packing = Packing(*(torch.from_numpy(a) for a in batch.packing()))
    return batch, packing, torch.from_numpy(batch.src), torch.from_numpy(batch.tgt_in)


@pytest.mark.parametrize("flex,dtype", [("flex", torch.float32), ("flex_compiled", torch.float32),
                                        ("flex", torch.float64)])
def test_a_packed_forward_with_flexattention_matches_the_reference(kernel, flex, dtype):
    cfg = variant_config("pre_norm_gelu")
    batch, packing, src, tgt_in = _batch(cfg)
    params = _params(cfg, np.float64)
    want = ref.forward(params, cfg, batch.src, batch.tgt_in, packing=batch.packing())
    model = build_model(cfg, params, dtype)
    with torch.no_grad():
        plain = model(src, tgt_in, packing=packing).double().numpy()
        calls = kernel(flex)
        got = model(src, tgt_in, packing=packing).double().numpy()
    assert len(calls) == 6  # every attention: 2 encoder layers, 2 decoder layers with 2 each
    assert np.isfinite(got).all()  # padding rows and positions too (SPEC §2)
    bound = FLOAT32 if dtype == torch.float32 else FLOAT64
    assert relative_error(got, want) <= bound
    assert relative_error(got, plain) <= bound


def _loss_and_gradients(cfg, params, dtype):
    batch, packing, src, tgt_in = _batch(cfg)
    model = build_model(cfg, params, dtype).train()
    loss = forward_loss(model, src, tgt_in, torch.from_numpy(batch.labels), 0.1, packing=packing)
    loss.backward()
    return float(loss), torch.cat([p.grad.double().flatten() for p in model.parameters()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_packed_training_step_with_flexattention_has_the_dense_loss_and_gradients(kernel, monkeypatch,
                                                                                   dtype):
    """torch 2.13's flex_attention refuses CPU inputs that need gradients (_validate_device): CUDA's
    backward is a compiled kernel. Its eager backward (the flex_attention_backward operator's dense
    implementation, device-independent) is what this CPU twin runs, with that one check lifted.
    Bounds: the two paths differ only inside attention, by summation order; each forward is within
    the float32 parity bound of float64 (1e-5; 2.7e-7 measured on tiny: rosetta/parity.py), and the
    backward is the same kind of chain of sums of at most tokens x d_ff terms, with no Adam update
    to amplify a rounding difference, so the loss and the gradients (as one vector, norm-wise) agree
    within the same 1e-5 with the float64 dense step and the float32 one; float64 within its 1e-12.
    Measured here: 3e-7 for the gradients in float32 (a 30x margin), 6e-16 in float64."""
    cfg = variant_config("pre_norm_gelu").replace(dropout=0.0)  # no dropout: both paths draw nothing
    params = _params(cfg, np.float64)
    want_loss, want_grads = _loss_and_gradients(cfg, params, torch.float64)
    plain_loss, plain_grads = _loss_and_gradients(cfg, params, dtype)
    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)
    calls = kernel("flex")
    loss, grads = _loss_and_gradients(cfg, params, dtype)
    assert len(calls) == 6  # every attention of the step
    bound = FLOAT32 if dtype == torch.float32 else FLOAT64
    assert loss == pytest.approx(want_loss, rel=bound) and loss == pytest.approx(plain_loss, rel=bound)
    assert relative_error(grads.numpy(), want_grads.numpy()) <= bound
    assert relative_error(grads.numpy(), plain_grads.numpy()) <= bound


def test_flexattention_leaves_dropout_weights_and_narrow_cuda_heads_to_the_dense_mask(kernel):
    # CUDA with heads under 16 wide (torch 2.13's Triton kernel refuses them), attention dropout
    # and a recorded softmax (FlexAttention has neither) take the dense mask; a CPU any head size.
    assert ops.flex_runs("cuda", 64, 0.0, False) and ops.flex_runs("cuda", 16, 0.0, False)
    assert not ops.flex_runs("cuda", 8, 0.0, False)
    assert not ops.flex_runs("cuda", 64, 0.1, False) and not ops.flex_runs("cuda", 64, 0.0, True)
    assert ops.flex_runs("cpu", 8, 0.0, False)
    # Through `attention` on the CPU: dropout and weights run the explicit softmax on the dense mask.
    calls = kernel("flex")
    segments = SMALL["tgt"]
    dense = torch.from_numpy(ref.segment_mask(segments.numpy(), segments.numpy(), True))
    q = torch.randn(3, 2, 24, 8, generator=torch.Generator().manual_seed(0))
    mask = ops.packed_mask(dense, segments, segments, True)
    _, weights = ops.attention(q, q, q, mask, 0.0, weights=True)
    ops.attention(q, q, q, mask, 0.5)
    assert calls == [] and weights is not None
    assert np.allclose(weights.sum(-1).numpy(), 1.0)
