"""The peer: the same model built on `torch.nn.Transformer` (the implementation most PyTorch users
reach for), with one shared embedding table (tied output) and the paper's positions (§3.4, §3.5).

`PeerTransformer` is the module; `peer_from_params` builds it from canonical parameters, the
reverse of rosetta/interop/nn_transformer.py's `port_nn_transformer` (the same key table, read
the other way: q, k, v packed back into `in_proj_weight`, Linear weights transposed back to
[out, in], PITFALLS 7). `to_peer` / `from_peer` map any per-parameter tensors that way (weights,
Adam's moments). The benchmarks divide by it (benchmarks/peer.py); `rosetta train --backend peer`
trains it (peer_impl/train.py).

A package of its own, beside the backends rather than in torch_impl: it is built on the port
(rosetta/interop/nn_transformer.py), which is not part of our PyTorch backend, and trains through
torch_impl's trainer; registered in rosetta/backends.py as "peer".
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from rosetta.checkpoint import check_params
from rosetta.config import ModelConfig
from rosetta.errors import ConfigError
from rosetta.interop.nn_transformer import key_table
from rosetta.params import Params, embedding_names, param_shapes
from rosetta.positional import positional_encoding

PEER_ACTIVATIONS = ("relu", "gelu")  # nn.Transformer's string activations (its exact erf GELU)


class PeerTransformer(nn.Module):
    """nn.Transformer + one shared embedding table (tied output) + the paper's positions."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.src_vocab_size, cfg.d_model)
        self.transformer = nn.Transformer(
            cfg.d_model,
            cfg.num_heads,
            cfg.num_encoder_layers,
            cfg.num_decoder_layers,
            cfg.d_ff,
            cfg.dropout,
            activation=cfg.activation,
            batch_first=True,
            norm_first=cfg.norm_first,
            layer_norm_eps=cfg.layer_norm_eps,
        )
        self.generator = nn.Linear(cfg.d_model, cfg.tgt_vocab_size, bias=False)
        self.generator.weight = self.embed.weight  # share_embeddings = "all"
        self.dropout = nn.Dropout(cfg.dropout)
        table = positional_encoding(cfg.positional_encoding, cfg.max_len, cfg.d_model, cfg.position_offset)
        # float64, cast with the module's .to(dtype) or at use: a float64 peer gets the exact table.
        self.register_buffer("positions", torch.from_numpy(table), persistent=False)

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) * math.sqrt(self.cfg.d_model)
        return self.dropout(x + self.positions[: ids.shape[1]].to(x.dtype))

    def masks(self, src: torch.Tensor, tgt: torch.Tensor) -> dict[str, torch.Tensor]:
        # nn.Transformer's boolean masks mean True = masked (PITFALLS 4).
        tgt_pad = tgt == self.cfg.pad_id
        tgt_pad[:, 0] = False  # the start token is never padding
        causal = torch.ones(tgt.shape[1], tgt.shape[1], dtype=torch.bool, device=tgt.device).triu(1)
        return dict(
            src_key_padding_mask=src == self.cfg.pad_id,
            memory_key_padding_mask=src == self.cfg.pad_id,
            tgt_key_padding_mask=tgt_pad,
            tgt_mask=causal,
        )

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        # nn.TransformerEncoderLayer's inference fast path (eval mode) asks whether CUDA's autocast is
        # on, not the CPU's: under CPU bfloat16 autocast it mixes dtypes and fails ("expected scalar
        # type Float but found BFloat16"). Off for that case only; elsewhere the peer runs as users
        # run it (and training, which never takes that path, may be compiled: no toggling there).
        if self.training or not torch.is_autocast_enabled("cpu"):
            return self.generator(self.transformer(self.embed_ids(src), self.embed_ids(tgt),
                                                   **self.masks(src, tgt)))
        fast = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            out = self.transformer(self.embed_ids(src), self.embed_ids(tgt), **self.masks(src, tgt))
        finally:
            torch.backends.mha.set_fastpath_enabled(fast)
        return self.generator(out)

    @torch.inference_mode()
    def greedy(self, src: torch.Tensor, length: int) -> torch.Tensor:
        """The usual nn.Transformer decoding loop: encode once, re-decode the prefix each step."""
        pad = src == self.cfg.pad_id
        memory = self.transformer.encoder(self.embed_ids(src), src_key_padding_mask=pad)
        tokens = torch.full((src.shape[0], 1), self.cfg.bos_id, device=src.device)
        for _ in range(length):
            causal = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool, device=src.device).triu(1)
            out = self.transformer.decoder(
                self.embed_ids(tokens), memory, tgt_mask=causal, memory_key_padding_mask=pad
            )
            next_token = self.generator(out[:, -1]).argmax(-1)
            tokens = torch.cat([tokens, next_token[:, None]], dim=1)
        return tokens[:, 1:]


def check_peer_config(cfg: ModelConfig) -> None:
    """Refuse, naming the field, a config that `PeerTransformer` cannot express exactly."""
    problems = []
    if cfg.share_embeddings != "all":
        problems.append(f"share_embeddings={cfg.share_embeddings!r} (the peer has one table, tied: 'all')")
    if cfg.output_bias:
        problems.append("output_bias=True (the peer's tied output layer has no bias)")
    if not (cfg.attention_bias and cfg.ffn_bias):
        # nn.Transformer(bias=False) drops every bias at once, LayerNorm's too, which our format trains.
        problems.append(f"attention_bias={cfg.attention_bias}, ffn_bias={cfg.ffn_bias} (nn.Transformer has "
                        "biases everywhere or nowhere, LayerNorm's included)")
    if cfg.activation not in PEER_ACTIVATIONS:
        problems.append(f"activation={cfg.activation!r} (nn.Transformer's strings: "
                        f"{', '.join(PEER_ACTIVATIONS)})")
    if not cfg.scale_embeddings:
        problems.append("scale_embeddings=False (the peer scales by sqrt(d_model), §3.4)")
    if cfg.logit_scale != 1.0:
        problems.append(f"logit_scale={cfg.logit_scale!r} (the peer's logits are h E^T, unscaled)")
    if problems:
        raise ConfigError("the torch.nn.Transformer peer cannot express " + "; ".join(problems))


# -- Canonical <-> the peer's named parameters ---------------------------------------------------

def peer_rows(cfg: ModelConfig) -> list[tuple[str, str, int | None, bool]]:
    """(peer parameter name, canonical name, q/k/v block or None, transposed?) for every tensor:
    port_nn_transformer's key table under `transformer.`, and the one shared table `embed.weight`."""
    table = key_table(cfg.num_encoder_layers, cfg.num_decoder_layers, cfg.has_final_norm)
    rows = [(f"transformer.{key}", name, block, transpose) for key, name, block, transpose in table]
    return rows + [("embed.weight", embedding_names(cfg).src, None, False)]


def to_peer(cfg: ModelConfig, params: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Canonical per-parameter arrays (weights, or anything shaped like them) -> float32 tensors
    (float64 arrays stay float64) keyed and laid out as `PeerTransformer.named_parameters()`."""
    check_params(cfg, params)
    blocks: dict[str, list[np.ndarray | None]] = {}
    for key, name, block, transpose in peer_rows(cfg):
        value = np.asarray(params[name])
        value = value.astype(np.float64 if value.dtype == np.float64 else np.float32)
        value = value.T if transpose else value
        if block is None:
            blocks[key] = [value]
        else:  # in_proj_weight / in_proj_bias: q, k, v stacked row-wise (PITFALLS 7)
            blocks.setdefault(key, [None, None, None])[block] = value
    # torch.tensor copies: the module never shares memory with the caller's arrays.
    return {key: torch.tensor(np.concatenate(parts) if len(parts) == 3 else parts[0])
            for key, parts in blocks.items()}


def from_peer(cfg: ModelConfig, tensors: Mapping[str, torch.Tensor], dtype: type = np.float32) -> Params:
    """The reverse of `to_peer`: NumPy arrays of `dtype` (float32; np.float64 for a float64 trainer:
    rosetta.params.canonical_dtype), canonical names, math layout."""
    params: Params = {}
    for key, name, block, transpose in peer_rows(cfg):
        wide = torch.float64 if dtype == np.float64 else torch.float32
        value = tensors[key].detach().to("cpu", wide).numpy()
        if block is not None:
            value = value[block * cfg.d_model:(block + 1) * cfg.d_model]
        params[name] = np.array(value.T if transpose else value)  # a copy, not a view
    check_params(cfg, params, source="the nn.Transformer peer")
    return {name: params[name] for name in param_shapes(cfg)}


def peer_from_params(cfg: ModelConfig, params: Mapping[str, np.ndarray]) -> PeerTransformer:
    """A `PeerTransformer` holding exactly these canonical weights and every setting of `cfg`.
    nn.Transformer takes one dropout rate: the attention and activation rates are set on its
    modules afterwards, and it always builds final LayerNorms: removed when `cfg` has none
    (nn.TransformerEncoder/Decoder skip a `norm` of None)."""
    check_peer_config(cfg)
    peer = PeerTransformer(cfg)
    layers = [*peer.transformer.encoder.layers, *peer.transformer.decoder.layers]
    for layer in layers:
        layer.dropout.p = cfg.activation_dropout_rate  # inside the feed-forward block
        for attention in (layer.self_attn, getattr(layer, "multihead_attn", None)):
            if attention is not None:
                attention.dropout = cfg.attention_dropout  # on the attention weights
    if not cfg.has_final_norm:
        peer.transformer.encoder.norm = peer.transformer.decoder.norm = None
    state = to_peer(cfg, params)
    own = dict(peer.named_parameters())
    if sorted(own) != sorted(state):
        raise ConfigError(f"the peer's parameters {sorted(set(own) ^ set(state))} do not match the config")
    with torch.no_grad():
        for key, value in state.items():
            own[key].copy_(value)
    return peer
