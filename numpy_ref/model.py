"""The reference Transformer (Vaswani et al. 2017) in plain NumPy: forward pass only, float64.

This file is the executable specification: where the PyTorch or JAX model disagrees with it,
they are wrong. It is written to be read next to the paper, one function per box of Figure 1.
Parameters are the flat canonical dict (rosetta.params); `sub(p, "x")` selects the tensors
under prefix "x.". No dropout: the reference is inference only.

Shapes: B batch, S source length, T target length, d d_model, h heads, dh d_head, V vocab.
"""

from __future__ import annotations

import math

import numpy as np

from rosetta.config import ModelConfig
from rosetta.inputs import Packing, check_packing
from rosetta.params import Params, embedding_names
from rosetta.positional import positional_encoding

Stages = dict[str, np.ndarray]


def sub(params: Params, prefix: str) -> Params:
    """The tensors under `prefix.`, with the prefix stripped."""
    start = prefix + "."
    return {name[len(start):]: value for name, value in params.items() if name.startswith(start)}


# -- Building blocks -----------------------------------------------------------------------

def dense(p: Params, x: np.ndarray) -> np.ndarray:
    """y = x @ kernel + bias, kernel in math layout [in, out]."""
    y = x @ p["kernel"]
    return y + p["bias"] if "bias" in p else y


def layer_norm(p: Params, x: np.ndarray, eps: float) -> np.ndarray:
    """Ba et al. 2016, with the biased (population) variance and eps inside the sqrt."""
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * p["scale"] + p["bias"]


_erf = np.frompyfunc(math.erf, 1, 1)  # NumPy has no erf; math.erf is exact to double precision


def activation(name: str, x: np.ndarray) -> np.ndarray:
    if name == "relu":
        return np.maximum(x, 0.0)
    if name == "gelu":  # exact form, PyTorch's default (jax.nn.gelu defaults to tanh: PITFALLS 6)
        return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)).astype(x.dtype))
    if name == "gelu_tanh":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    if name == "silu":
        return x / (1.0 + np.exp(-x))
    raise ValueError(f"unknown activation {name!r}")


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


# -- Masks (True = may attend) -------------------------------------------------------------

def source_mask(src: np.ndarray, pad_id: int) -> np.ndarray:
    """[B, 1, 1, S]: every query may attend to every non-pad source key."""
    return (src != pad_id)[:, None, None, :]


def target_mask(tgt: np.ndarray, pad_id: int) -> np.ndarray:
    """[B, 1, T, T]: causal, and never a pad key. Position 0 holds the decoder start token and
    is never padding, even when the start token equals pad_id (Marian, Flax: PITFALLS 12)."""
    valid = tgt != pad_id
    valid[:, 0] = True
    causal = np.tril(np.ones((tgt.shape[1], tgt.shape[1]), dtype=bool))
    return causal[None, None, :, :] & valid[:, None, None, :]


def segment_mask(q_segments: np.ndarray, k_segments: np.ndarray, causal: bool = False) -> np.ndarray:
    """[B, 1, Tq, Tk] for packed rows (docs/packing.md; Flax WMT's segmentation masks): a query
    attends only to keys of its own segment, never to padding (segment 0); causal too for decoder
    self-attention. A padding query has no key left: uniform weights (SPEC §2)."""
    mask = (q_segments[:, :, None] == k_segments[:, None, :]) & (k_segments[:, None, :] != 0)
    if causal:
        mask &= np.tril(np.ones(mask.shape[1:], dtype=bool))
    return mask[:, None]


# -- Sublayers -----------------------------------------------------------------------------

def multi_head_attention(
    p: Params, x_q: np.ndarray, x_kv: np.ndarray, mask: np.ndarray, num_heads: int,
    record: Stages | None = None, name: str = "",
) -> np.ndarray:
    """Multi-head scaled dot-product attention, §3.2.1-3.2.2, eq. 1. With `record`, the fine
    stages `name` (the o projection's output) and `name.weights` (the softmax) go into it."""
    B, Tq, d = x_q.shape
    Tk, dh = x_kv.shape[1], d // num_heads

    def split_heads(x: np.ndarray, T: int) -> np.ndarray:  # (B, T, d) -> (B, h, T, dh)
        return x.reshape(B, T, num_heads, dh).transpose(0, 2, 1, 3)

    q = split_heads(dense(sub(p, "q"), x_q), Tq)
    k = split_heads(dense(sub(p, "k"), x_kv), Tk)
    v = split_heads(dense(sub(p, "v"), x_kv), Tk)
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(dh)  # (B, h, Tq, Tk)
    # Masked scores are *replaced* by the most negative finite value, so a row whose keys are
    # all masked gets uniform weights rather than the NaN a -inf fill gives (PITFALLS 4).
    scores = np.where(mask, scores, np.finfo(scores.dtype).min)
    weights = softmax(scores)
    out = dense(sub(p, "o"), (weights @ v).transpose(0, 2, 1, 3).reshape(B, Tq, d))
    if record is not None:
        record[name], record[name + ".weights"] = out, weights
    return out


def feed_forward(p: Params, x: np.ndarray, act: str, record: Stages | None = None,
                 name: str = "") -> np.ndarray:
    """Position-wise feed-forward network, §3.3, eq. 2 (with a choice of activation); the
    output goes into `record[name]` when given."""
    out = dense(sub(p, "linear2"), activation(act, dense(sub(p, "linear1"), x)))
    if record is not None:
        record[name] = out
    return out


def residual(p_norm: Params, x: np.ndarray, sublayer, cfg: ModelConfig) -> np.ndarray:
    """Post-norm LN(x + Sublayer(x)) as in §3.1, or pre-norm x + Sublayer(LN(x))."""
    if cfg.norm_first:
        return x + sublayer(layer_norm(p_norm, x, cfg.layer_norm_eps))
    return layer_norm(p_norm, x + sublayer(x), cfg.layer_norm_eps)


# -- Layers and stacks ---------------------------------------------------------------------

def encoder_layer(p: Params, x: np.ndarray, mask: np.ndarray, cfg: ModelConfig,
                  record: Stages | None = None, name: str = "") -> np.ndarray:
    """One encoder layer, §3.1: self-attention, then feed-forward. With `record`, the fine
    stages `name.self_attn(.weights)` and `name.ffn` (sublayer outputs, before the residual)."""
    attn = sub(p, "self_attn")
    x = residual(sub(p, "self_attn_norm"), x,
                 lambda h: multi_head_attention(attn, h, h, mask, cfg.num_heads, record,
                                                f"{name}.self_attn"), cfg)
    return residual(sub(p, "ffn_norm"), x,
                    lambda h: feed_forward(sub(p, "ffn"), h, cfg.activation, record, f"{name}.ffn"),
                    cfg)


def decoder_layer(
    p: Params, x: np.ndarray, memory: np.ndarray, self_mask: np.ndarray,
    cross_mask: np.ndarray, cfg: ModelConfig, record: Stages | None = None, name: str = "",
) -> np.ndarray:
    """One decoder layer, §3.1: masked self-attention, cross-attention, feed-forward. With
    `record`, the fine stages `name.self_attn(.weights)`, `name.cross_attn(.weights)`, `name.ffn`."""
    self_attn, cross_attn = sub(p, "self_attn"), sub(p, "cross_attn")
    x = residual(sub(p, "self_attn_norm"), x,
                 lambda h: multi_head_attention(self_attn, h, h, self_mask, cfg.num_heads, record,
                                                f"{name}.self_attn"), cfg)
    x = residual(sub(p, "cross_attn_norm"), x,
                 lambda h: multi_head_attention(cross_attn, h, memory, cross_mask, cfg.num_heads,
                                                record, f"{name}.cross_attn"), cfg)
    return residual(sub(p, "ffn_norm"), x,
                    lambda h: feed_forward(sub(p, "ffn"), h, cfg.activation, record, f"{name}.ffn"),
                    cfg)


def generator(params: Params, cfg: ModelConfig, hidden: np.ndarray) -> np.ndarray:
    """Logits [B, T, V] = logit_scale * (hidden W_out) (+ b_out); tied tables use W_out = E^T (§3.4)."""
    names = embedding_names(cfg)
    kernel = params[names.tgt].T if names.output is None else params[names.output]
    logits = hidden @ kernel
    logits = logits if cfg.logit_scale == 1.0 else logits * cfg.logit_scale  # SPEC §2 (Flax: 1/sqrt(d))
    return logits + params["generator.bias"] if cfg.output_bias else logits


def embed(table: np.ndarray, ids: np.ndarray, cfg: ModelConfig, offset: int = 0,
          positions: np.ndarray | None = None) -> np.ndarray:
    """E[x] * sqrt(d_model) + PE[pos], §3.4-3.5; positions count from `offset`, or are given
    per token [B, T] (packed rows: they restart at 0 in every segment)."""
    x = table[ids]
    if cfg.scale_embeddings:
        x = x * math.sqrt(cfg.d_model)
    shift = cfg.position_offset  # SPEC §2: position p reads PE[p + position_offset] (fairseq: pad + 1)
    if positions is None:
        table = positional_encoding(cfg.positional_encoding, ids.shape[1], cfg.d_model, offset + shift)
    else:
        table = positional_encoding(cfg.positional_encoding, ids.shape[1], cfg.d_model, shift)[positions]
    return x + table.astype(x.dtype)  # or float32 models would silently compute in float64


def encode(params: Params, cfg: ModelConfig, src: np.ndarray, stages: Stages | None = None,
           fine: bool = False, packing: Packing | None = None):
    """The encoder stack: src [B, S] -> memory [B, S, d]; `fine` adds the sublayer stages.
    Packed rows give `packing`: its `src_segments` and `src_positions` [B, S] (docs/packing.md)."""
    stages = {} if stages is None else stages
    record = stages if fine else None
    positions = None if packing is None else packing.src_positions
    x = stages["src_embed"] = embed(params[embedding_names(cfg).src], src, cfg, positions=positions)
    mask = (source_mask(src, cfg.pad_id) if packing is None
            else segment_mask(packing.src_segments, packing.src_segments))
    for i in range(cfg.num_encoder_layers):
        name = f"encoder.layers.{i}"
        x = stages[name] = encoder_layer(sub(params, name), x, mask, cfg, record, name)
    if cfg.has_final_norm:
        x = layer_norm(sub(params, "encoder.final_norm"), x, cfg.layer_norm_eps)
    stages["encoder"] = x
    return x


def decode(
    params: Params, cfg: ModelConfig, tgt: np.ndarray, memory: np.ndarray, src: np.ndarray,
    stages: Stages | None = None, fine: bool = False, packing: Packing | None = None,
) -> np.ndarray:
    """The decoder stack: tgt [B, T] (starting with the start token) -> hidden [B, T, d];
    `fine` adds the sublayer stages. Packed rows give `packing`: its `tgt_segments`,
    `tgt_positions` [B, T] and the `src_segments` [B, S] of the memory (docs/packing.md)."""
    stages = {} if stages is None else stages
    record = stages if fine else None
    positions = None if packing is None else packing.tgt_positions
    x = stages["tgt_embed"] = embed(params[embedding_names(cfg).tgt], tgt, cfg, positions=positions)
    if packing is None:
        self_mask, cross_mask = target_mask(tgt, cfg.pad_id), source_mask(src, cfg.pad_id)
    else:  # segments decide padding: the start token of every segment is real, even if == pad_id
        self_mask = segment_mask(packing.tgt_segments, packing.tgt_segments, causal=True)
        cross_mask = segment_mask(packing.tgt_segments, packing.src_segments)
    for i in range(cfg.num_decoder_layers):
        name = f"decoder.layers.{i}"
        x = stages[name] = decoder_layer(sub(params, name), x, memory, self_mask, cross_mask, cfg,
                                         record, name)
    if cfg.has_final_norm:
        x = layer_norm(sub(params, "decoder.final_norm"), x, cfg.layer_norm_eps)
    stages["decoder"] = x
    return x


def forward(
    params: Params, cfg: ModelConfig, src: np.ndarray, tgt: np.ndarray,
    stages: Stages | None = None, fine: bool = False, packing: Packing | None = None,
) -> np.ndarray:
    """Logits [B, T, V] for source ids [B, S] and decoder input ids [B, T]; `stages` receives
    the coarse stages, and with `fine` the sublayer outputs and attention weights too. Packed
    rows (several pairs per row) give `packing`, all four segment/position arrays (docs/packing.md)."""
    stages = {} if stages is None else stages
    packing = packing if check_packing(src, tgt, packing, check_range=True) else None
    memory = encode(params, cfg, src, stages, fine, packing)
    hidden = decode(params, cfg, tgt, memory, src, stages, fine, packing)
    logits = stages["logits"] = generator(params, cfg, hidden)
    return logits
