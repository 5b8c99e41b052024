"""Shared fixtures: the config matrix every backend is tested on, and the batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rosetta import ModelConfig, init_params, preset
from rosetta.parity import random_batch

# The parity matrix: adding a config variant is one line. Each is the `tiny` preset with
# the fields shown changed; together they cover every option of SPEC §1.
CONFIG_VARIANTS: dict[str, dict] = {
    "post_norm_relu": {},
    "pre_norm_gelu": dict(norm_first=True, activation="gelu"),
    "post_norm_final_norm_gelu_tanh": dict(final_norm=True, activation="gelu_tanh"),
    "pre_norm_no_final_silu": dict(norm_first=True, final_norm=False, activation="silu"),
    "concat_positions": dict(positional_encoding="sinusoidal_concat"),
    "concat_t2t_positions": dict(positional_encoding="sinusoidal_concat_t2t"),
    "share_none_unequal_vocab_output_bias": dict(
        share_embeddings="none", src_vocab_size=50, tgt_vocab_size=70, output_bias=True),
    "share_decoder": dict(share_embeddings="decoder", src_vocab_size=80, tgt_vocab_size=40),
    "share_src_tgt": dict(share_embeddings="src_tgt"),
    "no_biases_no_scale": dict(attention_bias=False, ffn_bias=False, scale_embeddings=False),
    "start_token_is_pad_eps_1e-6": dict(bos_id=0, layer_norm_eps=1e-6),
    "unequal_layers_heads_8": dict(num_encoder_layers=3, num_decoder_layers=1, num_heads=8),
    "logit_scale_flax_output_bias": dict(scale_embeddings=False, logit_scale=32 ** -0.5, output_bias=True),
}

# (batch, src_len, tgt_len, padded): padding in both sides, batch of 1, unequal lengths.
BATCH_SHAPES: dict[str, tuple[int, int, int, bool]] = {
    "padded": (4, 11, 9, True),
    "batch_of_one": (1, 7, 7, False),
    "tgt_longer_than_src": (3, 5, 13, True),
}


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """The suite's models are tiny: PyTorch's OpenMP threads only add synchronisation, up to
    100x slower on a busy 2-core machine. Speed is measured in benchmarks/, not here."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def variant_config(name: str) -> ModelConfig:
    return preset("tiny", **CONFIG_VARIANTS[name])


@pytest.fixture(params=sorted(CONFIG_VARIANTS))
def cfg(request) -> ModelConfig:
    return variant_config(request.param)


@pytest.fixture
def params(cfg: ModelConfig) -> dict[str, np.ndarray]:
    # The canonical initializer leaves biases at zero and LayerNorm at identity; perturb every
    # tensor so that a backend that drops a bias or a scale cannot pass by luck.
    rng = np.random.default_rng(1)
    return {k: (v + 0.05 * rng.standard_normal(v.shape)).astype(np.float32)
            for k, v in init_params(cfg, seed=0).items()}


@pytest.fixture(params=sorted(BATCH_SHAPES))
def batch(request, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    b, s, t, pad = BATCH_SHAPES[request.param]
    return random_batch(cfg, b, s, t, seed=2, pad=pad)
