"""Porting in from torch.nn.Transformer (rosetta/interop/nn_transformer.py): a peer model written here from
nn.Transformer, the paper's sinusoidal table and nn.Embedding/nn.Linear must give the same
logits as its ported checkpoint in the NumPy reference (float64) and the torch backend."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rosetta
from rosetta.errors import CheckpointError, ConfigError
from rosetta.interop.nn_transformer import port_nn_transformer, save_ported
from rosetta.parity import random_batch, relative_error, target_positions

# nn.Transformer's warnings about its nested-tensor fast path are harmless here.
pytestmark = [pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning"),
              pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")]

D, HEADS, D_FF, PAD, MAX_LEN = 32, 4, 64, 0, 64


def sinusoidal_table(max_len: int, d: int) -> torch.Tensor:
    """The paper's table: PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(p / 10000^(2i/d))."""
    pe = torch.zeros(max_len, d, dtype=torch.float64)
    pos = torch.arange(max_len, dtype=torch.float64)[:, None]
    div = 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    pe[:, 0::2], pe[:, 1::2] = torch.sin(pos / div), torch.cos(pos / div)
    return pe.float()


def make_transformer(norm_first: bool = False, activation: str | Callable = "relu", bias: bool = True,
                     final_norm: bool = True) -> nn.Transformer:
    kw = dict(dim_feedforward=D_FF, dropout=0.0, activation=activation, batch_first=True,
              norm_first=norm_first, bias=bias)
    if final_norm:
        return nn.Transformer(D, HEADS, 2, 2, **kw)
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(D, HEADS, **kw), 2, norm=None)
    decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(D, HEADS, **kw), 2, norm=None)
    return nn.Transformer(D, HEADS, custom_encoder=encoder, custom_decoder=decoder, batch_first=True)


class Peer(nn.Module):
    """A translation model as a PyTorch user writes it around nn.Transformer."""

    def __init__(self, transformer: nn.Transformer, share: str = "none", output_bias: bool = False,
                 scale: bool = True, src_vocab: int = 48, tgt_vocab: int = 40):
        super().__init__()
        if share in ("src_tgt", "all"):
            src_vocab = tgt_vocab
        self.transformer, self.scale = transformer, scale
        self.src_embed = nn.Embedding(src_vocab, D)
        self.tgt_embed = self.src_embed if share in ("src_tgt", "all") else nn.Embedding(tgt_vocab, D)
        self.generator = nn.Linear(D, tgt_vocab, bias=output_bias)
        if share in ("decoder", "all"):
            self.generator.weight = self.tgt_embed.weight
        self.register_buffer("pe", sinusoidal_table(MAX_LEN, D))
        with torch.no_grad():  # non-zero biases, non-trivial LayerNorms: a dropped tensor cannot pass
            for p in self.parameters():
                p.add_(0.1 * torch.randn_like(p))

    def embed(self, table: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        return table(ids) * (math.sqrt(D) if self.scale else 1.0) + self.pe[: ids.shape[1]]

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        src_pad = src == PAD  # True = masked, nn.MultiheadAttention's polarity (PITFALLS 4)
        tgt_pad = tgt == PAD
        tgt_pad[:, 0] = False  # position 0 holds the start token, never padding
        causal = torch.ones(tgt.shape[1], tgt.shape[1], dtype=torch.bool).triu(1)
        h = self.transformer(self.embed(self.src_embed, src), self.embed(self.tgt_embed, tgt),
                             tgt_mask=causal, src_key_padding_mask=src_pad,
                             tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad)
        return self.generator(h)

    def port(self) -> tuple[rosetta.ModelConfig, dict[str, np.ndarray]]:
        return port_nn_transformer(self.transformer, self.src_embed, self.tgt_embed, self.generator,
                                   scale_embeddings=self.scale, pad_id=PAD, max_len=MAX_LEN)


def assert_parity(peer: Peer, fast_path: bool = True) -> rosetta.ModelConfig:
    """Ported logits == the peer's at contract positions, on padded batches, in both backends.
    `fast_path`: run the peer under no_grad, where nn.TransformerEncoder may take its fused path."""
    cfg, params = peer.port()
    peer.eval()
    for batch, src_len, tgt_len, seed in ((4, 11, 9, 0), (3, 5, 13, 1)):
        src, tgt = random_batch(cfg, batch, src_len, tgt_len, seed)
        with torch.set_grad_enabled(not fast_path):
            expected = peer(torch.from_numpy(src), torch.from_numpy(tgt)).detach().numpy()
        where = target_positions(cfg, tgt)
        for backend, dtype in (("numpy", "float64"), ("torch", "float32")):
            got = rosetta.from_params(cfg, params, backend, dtype).logits(src, tgt)
            err = relative_error(got, expected, where)
            assert err <= 1e-5, f"{backend}/{dtype} {batch}x{src_len}x{tgt_len}: relative error {err:.2e}"
    return cfg


@pytest.mark.parametrize("output_bias", [False, True], ids=["no_out_bias", "out_bias"])
@pytest.mark.parametrize("share", ["none", "decoder", "src_tgt", "all"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
def test_port_matches_nn_transformer(norm_first: bool, activation: str, share: str,
                                     output_bias: bool) -> None:
    torch.manual_seed(0)
    cfg = assert_parity(Peer(make_transformer(norm_first, activation), share, output_bias))
    assert (cfg.norm_first, cfg.activation, cfg.share_embeddings, cfg.output_bias) == (
        norm_first, activation, share, output_bias)
    assert cfg.has_final_norm  # nn.Transformer's encoder.norm / decoder.norm (PITFALLS 3)
    assert (cfg.d_model, cfg.num_heads, cfg.d_ff, cfg.num_encoder_layers, cfg.num_decoder_layers) == (
        D, HEADS, D_FF, 2, 2)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
def test_port_without_biases(norm_first: bool) -> None:
    """bias=False drops every Linear, attention and LayerNorm bias; LN biases port as zeros."""
    torch.manual_seed(1)
    cfg = assert_parity(Peer(make_transformer(norm_first, bias=False), "all", scale=False))
    assert not cfg.attention_bias and not cfg.ffn_bias and not cfg.scale_embeddings


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
def test_port_custom_stacks_without_final_norm(norm_first: bool) -> None:
    torch.manual_seed(2)
    cfg = assert_parity(Peer(make_transformer(norm_first, "gelu", final_norm=False), "decoder", True))
    assert cfg.final_norm is False and "encoder.final_norm.scale" not in rosetta.param_shapes(cfg)


@pytest.mark.parametrize("fn, name", [(F.relu, "relu"), (nn.ReLU(), "relu"), (F.gelu, "gelu"),
                                      (nn.GELU(approximate="tanh"), "gelu_tanh"), (F.silu, "silu")],
                         ids=["F.relu", "nn.ReLU", "F.gelu", "nn.GELU_tanh", "F.silu"])
def test_port_callable_activations(fn: Callable, name: str) -> None:
    torch.manual_seed(3)
    transformer = make_transformer(activation=fn)
    for layer in transformer.decoder.layers:  # undo nn.TransformerDecoderLayer's ReLU (next test)
        layer.activation = fn
    # The slow path: the encoder's fused eval path runs any nn.GELU as exact GELU (tanh ignored).
    cfg = assert_parity(Peer(transformer, "src_tgt"), fast_path=False)
    assert cfg.activation == name


def test_module_activation_becomes_relu_in_decoder_and_is_refused() -> None:
    """nn.Transformer(activation=nn.GELU()) deep-copies its decoder layer, and
    TransformerDecoderLayer.__setstate__ then shadows the module with F.relu: the decoder
    really runs ReLU. The port sees two activations and refuses."""
    transformer = make_transformer(activation=nn.GELU())
    assert transformer.decoder.layers[0].activation is F.relu
    with pytest.raises(ConfigError, match=r"disagree on activation.*F\.relu when deep-copied"):
        Peer(transformer).port()


def test_port_reads_dropout_and_eps() -> None:
    transformer = nn.Transformer(D, HEADS, 3, 1, D_FF, dropout=0.2, layer_norm_eps=1e-6, batch_first=True)
    cfg, _ = port_nn_transformer(transformer, nn.Embedding(50, D), nn.Embedding(40, D), nn.Linear(D, 40))
    assert (cfg.dropout, cfg.activation_dropout_rate, cfg.attention_dropout) == (0.2, 0.2, 0.2)
    assert (cfg.layer_norm_eps, cfg.num_encoder_layers, cfg.num_decoder_layers) == (1e-6, 3, 1)
    assert (cfg.src_vocab_size, cfg.tgt_vocab_size, cfg.share_embeddings) == (50, 40, "none")


def test_save_ported_round_trip(tmp_path) -> None:
    torch.manual_seed(4)
    peer = Peer(make_transformer(True, "gelu"), "none", output_bias=True)
    cfg, params = peer.port()
    saved_cfg, path = save_ported(tmp_path / "ported.safetensors", peer.transformer, peer.src_embed,
                                  peer.tgt_embed, peer.generator, scale_embeddings=True, pad_id=PAD,
                                  max_len=MAX_LEN)
    ckpt = rosetta.load_checkpoint(path)
    assert ckpt.config == saved_cfg == cfg and ckpt.metadata["ported_from"] == "torch.nn.Transformer"
    assert list(ckpt.params) == list(params)
    for name, value in params.items():
        np.testing.assert_array_equal(ckpt.params[name], value, err_msg=name)


def _set_cross_attn(peer: Peer, attn: nn.MultiheadAttention) -> None:
    peer.transformer.decoder.layers[0].multihead_attn = attn


REFUSALS: dict[str, tuple[Callable[[Peer], object], type[Exception], str]] = {
    "activation": (lambda p: setattr(p.transformer.encoder.layers[0], "activation", F.elu), ConfigError,
                   "unsupported activation"),
    "kdim": (lambda p: _set_cross_attn(p, nn.MultiheadAttention(D, HEADS, kdim=16, vdim=16)), ConfigError,
             "kdim"),
    "add_bias_kv": (lambda p: _set_cross_attn(p, nn.MultiheadAttention(D, HEADS, add_bias_kv=True)),
                    ConfigError, "add_bias_kv"),
    "mixed_norm_first": (lambda p: setattr(p.transformer.decoder.layers[1], "norm_first", True), ConfigError,
                         "disagree on norm_first"),
    "rms_norm": (lambda p: setattr(p.transformer.encoder, "norm", nn.RMSNorm(D)), ConfigError, "LayerNorm"),
    "one_final_norm": (lambda p: setattr(p.transformer.decoder, "norm", None), ConfigError, "final_norm"),
    "embedding_width": (lambda p: setattr(p, "src_embed", nn.Embedding(48, 16)), CheckpointError,
                        "src_embed.embedding"),
    "generator_vocab": (lambda p: setattr(p, "generator", nn.Linear(D, 41)), CheckpointError,
                        "generator.kernel"),
    "empty_vocab": (lambda p: setattr(p.src_embed, "num_embeddings", 0), ConfigError, "src_vocab_size"),
    "not_embedding": (lambda p: setattr(p, "tgt_embed", nn.Linear(D, D)), ConfigError, "tgt_embed"),
    "meta_weights": (lambda p: setattr(p, "generator", nn.Linear(D, 40, device="meta")), ConfigError, "meta"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_port_refuses_unsupported(case: str) -> None:
    mutate, error, message = REFUSALS[case]
    peer = Peer(make_transformer())
    mutate(peer)
    with pytest.raises(error, match=message):
        peer.port()
