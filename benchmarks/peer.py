"""The peer every benchmark number is divided by: the same model built on `torch.nn.Transformer`
(the implementation most PyTorch users reach for), with the same weights — ported to the
canonical format with rosetta/interop/nn_transformer.py, so our backends load exactly these — the same loss,
optimizer and schedule (torch_impl/train.py), and its usual decoding loop (greedy, the whole
prefix again at every step: nn.Transformer has no key/value cache)."""

from __future__ import annotations

import math

import torch
from torch import nn

from rosetta.config import ModelConfig
from rosetta.interop.nn_transformer import port_nn_transformer
from rosetta.params import Params
from rosetta.positional import positional_encoding


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
        table = positional_encoding(cfg.positional_encoding, cfg.max_len, cfg.d_model)
        self.register_buffer("positions", torch.from_numpy(table).float(), persistent=False)

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
        out = self.transformer(self.embed_ids(src), self.embed_ids(tgt), **self.masks(src, tgt))
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


def make_peer(cfg: ModelConfig, seed: int = 0) -> tuple[PeerTransformer, ModelConfig, Params]:
    """The peer with its own initial weights, and those weights in the canonical format (with
    the config they imply: nn.Transformer always has final LayerNorms)."""
    torch.manual_seed(seed)
    peer = PeerTransformer(cfg)
    ported_cfg, params = port_nn_transformer(
        peer.transformer,
        peer.embed,
        peer.embed,
        peer.generator,
        positional_encoding=cfg.positional_encoding,
        scale_embeddings=True,
        pad_id=cfg.pad_id,
        bos_id=cfg.bos_id,
        eos_id=cfg.eos_id,
        max_len=cfg.max_len,
    )
    return peer, ported_cfg, params
