"""The peer every benchmark number is divided by: the same model built on `torch.nn.Transformer`
(the implementation most PyTorch users reach for), with the same weights — ported to the
canonical format with rosetta/interop/nn_transformer.py, so our backends load exactly these — the same loss,
optimizer and schedule (torch_impl/train.py; `rosetta train --backend peer` trains it through the harness:
peer_impl/train.py), and its usual decoding loop (greedy, the whole
prefix again at every step: nn.Transformer has no key/value cache)."""

from __future__ import annotations

import torch

from peer_impl.model import PeerTransformer  # the model itself lives in its own package
from rosetta.config import ModelConfig
from rosetta.interop.nn_transformer import port_nn_transformer
from rosetta.params import Params

__all__ = ["PeerTransformer", "make_peer"]


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
