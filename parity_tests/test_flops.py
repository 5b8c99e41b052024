"""The FLOPs formula against PyTorch's own FLOP counter on our model's forward pass."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from rosetta import init_params, preset
from rosetta.flops import forward_flops, mfu, peak_flops, training_flops
from torch_impl.backend import Model as TorchModel


@pytest.mark.parametrize("overrides,batch,src_len,tgt_len", [
    ({}, 2, 7, 5),
    (dict(share_embeddings="none", src_vocab_size=50, tgt_vocab_size=70, d_ff=48), 3, 4, 9),
    (dict(num_encoder_layers=3, num_decoder_layers=1, norm_first=True), 1, 6, 6),
])
def test_forward_flops_match_torchs_flop_counter(overrides, batch, src_len, tgt_len):
    cfg = preset("tiny", **overrides)
    module = TorchModel(cfg, init_params(cfg), "float32", device="cpu").module
    src = torch.randint(3, cfg.src_vocab_size, (batch, src_len))
    tgt = torch.randint(3, cfg.tgt_vocab_size, (batch, tgt_len))
    counter = FlopCounterMode(display=False)
    # The math SDPA kernel runs attention as plain matmuls, which the counter sees (it does
    # not count the fused CPU kernel).
    with counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        module(src, tgt)
    assert forward_flops(cfg, batch, src_len, tgt_len) == counter.get_total_flops()


def test_training_is_three_forwards_and_mfu_uses_the_peak():
    cfg = preset("base")
    assert training_flops(cfg, 8, 20, 20) == 3 * forward_flops(cfg, 8, 20, 20)
    assert peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == pytest.approx(989.4e12)
    assert peak_flops("NVIDIA H100 PCIe", "bfloat16") == pytest.approx(756e12)
    assert peak_flops("cpu", "float32") is None
    assert mfu(989.4e12, 2.0, 989.4e12) == pytest.approx(0.5)
    assert mfu(1.0, 1.0, None) is None
