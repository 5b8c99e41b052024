"""The float64 NumPy forward pass with the catalogue's code-level mistakes switchable.

With every switch off it computes exactly what numpy_ref.model computes, operation for operation
(parity_tests/test_diff_forward_diagnose.py checks the stages are bitwise equal); each switch
replaces one piece by the way a port gets it wrong (docs/diagnose.md, PITFALLS). The building
blocks the mistakes do not touch (dense, activation, softmax, masks, generator) are numpy_ref's own.

Shapes: B batch, S source length, T target length, d d_model, h heads, dh d_head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from numpy_ref import model as ref
from rosetta.config import ModelConfig
from rosetta.params import Params, embedding_names
from rosetta.positional import positional_encoding

Stages = dict[str, np.ndarray]

LAYER_NORMS = ("biased", "fast_variance", "unbiased_std")
FILLS = ("finite", "neg_inf", "zero")
HEAD_SPLITS = ("contiguous", "interleaved")


@dataclass(frozen=True)
class Switches:
    """The code-level mistakes. The defaults are the contract (SPEC, numpy_ref)."""

    position_offset: int = 0          # 1: positions counted from 1 (PITFALLS 1)
    positions_2i: bool = False        # tutorial loop: exponent 2i with i already even
    layer_norm: str = "biased"        # fast_variance: E[x²]-E[x]²; unbiased_std: eps outside
    mask_inverted: bool = False       # padding masks attend to the padding (PITFALLS 4)
    naive_start_mask: bool = False    # the start token masked when bos == pad (PITFALLS 12)
    fill: str = "finite"              # neg_inf: NaN rows; zero: zero rows (PITFALLS 4)
    causal: bool = True               # False: a decoder without its causal mask
    heads: str = "contiguous"         # interleaved: head j owns columns j, j+h, ... (PITFALLS 7)
    kv_query_length: bool = False     # cross-attention keys/values sized with T, not S
    log_softmax_logits: bool = False  # the "logits" are log-probabilities

    def __post_init__(self) -> None:
        for name, choices in (("layer_norm", LAYER_NORMS), ("fill", FILLS), ("heads", HEAD_SPLITS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"Switches.{name} must be one of {choices}, got {getattr(self, name)!r}")

    def changed(self) -> dict[str, object]:
        """The switches that differ from the contract."""
        default = Switches()
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}


# -- Pieces a mistake replaces -------------------------------------------------------------

def layer_norm(p: Params, x: np.ndarray, eps: float, kind: str) -> np.ndarray:
    """numpy_ref's LayerNorm, or one of the two ways ports compute it differently (PITFALLS 2)."""
    if kind == "biased":
        return ref.layer_norm(p, x, eps)
    mean = x.mean(axis=-1, keepdims=True)
    if kind == "fast_variance":
        # Flax's use_fast_variance: one pass, E[x²] - E[x]², clamped at 0 as Flax does. It loses
        # digits to cancellation when |mean| >> std.
        var = np.maximum((x * x).mean(axis=-1, keepdims=True) - mean**2, 0.0)
        return (x - mean) / np.sqrt(var + eps) * p["scale"] + p["bias"]
    # The Annotated Transformer: a_2 * (x - mean) / (std + eps) + b_2 with torch's unbiased std.
    std = x.std(axis=-1, ddof=1, keepdims=True)
    return p["scale"] * (x - mean) / (std + eps) + p["bias"]


def tutorial_positions(length: int, d_model: int, offset: int = 0) -> np.ndarray:
    """The tutorial loop `for i in range(0, d, 2): pe[p, i] = sin(p / 10000 ** (2 * i / d));
    pe[p, i + 1] = cos(<same>)`: i already steps by two, so `2i` doubles every exponent."""
    pos = np.arange(offset, offset + length, dtype=np.float64)[:, None]
    even = np.arange(0, d_model, 2, dtype=np.float64)[None, :]
    angles = pos / 10000.0 ** (2.0 * even / d_model)
    table = np.empty((length, d_model))
    table[:, 0::2], table[:, 1::2] = np.sin(angles), np.cos(angles)
    return table


def embed(table: np.ndarray, ids: np.ndarray, cfg: ModelConfig, sw: Switches) -> np.ndarray:
    """numpy_ref.model.embed, with the positional table the switches choose."""
    x = table[ids]
    if cfg.scale_embeddings:
        x = x * math.sqrt(cfg.d_model)
    if sw.positions_2i:
        pe = tutorial_positions(ids.shape[1], cfg.d_model, sw.position_offset)
    else:
        pe = positional_encoding(cfg.positional_encoding, ids.shape[1], cfg.d_model, sw.position_offset)
    return x + pe.astype(x.dtype)


def padding_mask(ids: np.ndarray, pad_id: int, sw: Switches) -> np.ndarray:
    """[B, L] True = a key that may be attended; inverted polarity attends to the padding only."""
    return ids == pad_id if sw.mask_inverted else ids != pad_id


def source_mask(src: np.ndarray, pad_id: int, sw: Switches) -> np.ndarray:
    return padding_mask(src, pad_id, sw)[:, None, None, :]  # [B, 1, 1, S], as numpy_ref's


def target_mask(tgt: np.ndarray, pad_id: int, sw: Switches) -> np.ndarray:
    """[B, 1, T, T] as numpy_ref's; a naive mask leaves a start token equal to pad masked."""
    valid = padding_mask(tgt, pad_id, sw)
    if not sw.naive_start_mask:
        valid[:, 0] = True
    T = tgt.shape[1]
    allowed = np.tril(np.ones((T, T), dtype=bool)) if sw.causal else np.ones((T, T), dtype=bool)
    return allowed[None, None, :, :] & valid[:, None, None, :]


def _query_length_keys(x_kv: np.ndarray, mask: np.ndarray, Tq: int) -> tuple[np.ndarray, np.ndarray]:
    """Keys/values in a buffer sized with the query length T instead of S: the keys past T are
    dropped, or the buffer's unused rows stay zero (and masked). NumPy and PyTorch refuse the
    literal `view(B, T, h, dh)` when S != T; code that slices or preallocates with T does not."""
    B, S, d = x_kv.shape
    if S >= Tq:
        return x_kv[:, :Tq], mask[..., :Tq]
    padded = np.zeros((B, Tq, d), dtype=x_kv.dtype)
    padded[:, :S] = x_kv
    wide = np.zeros(mask.shape[:-1] + (Tq,), dtype=bool)
    wide[..., :S] = mask
    return padded, wide


def attention(
    p: Params, x_q: np.ndarray, x_kv: np.ndarray, mask: np.ndarray, num_heads: int, sw: Switches,
    record: Stages | None, name: str, cross: bool = False,
) -> np.ndarray:
    """numpy_ref.model.multi_head_attention (eq. 1) with the head split, fill and key-length
    switches; records `name` and `name.weights` like numpy_ref's fine stages."""
    S = x_kv.shape[1]
    if cross and sw.kv_query_length:
        x_kv, mask = _query_length_keys(x_kv, mask, x_q.shape[1])
    B, Tq, d = x_q.shape
    Tk, dh = x_kv.shape[1], d // num_heads

    def split_heads(x: np.ndarray, T: int) -> np.ndarray:  # (B, T, d) -> (B, h, T, dh)
        if sw.heads == "interleaved":  # head j owns columns j, j + h, j + 2h, ...
            return x.reshape(B, T, dh, num_heads).transpose(0, 3, 1, 2)
        return x.reshape(B, T, num_heads, dh).transpose(0, 2, 1, 3)

    q = split_heads(ref.dense(ref.sub(p, "q"), x_q), Tq)
    k = split_heads(ref.dense(ref.sub(p, "k"), x_kv), Tk)
    v = split_heads(ref.dense(ref.sub(p, "v"), x_kv), Tk)
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(dh)  # (B, h, Tq, Tk)
    if sw.fill == "neg_inf":  # a query with every key masked: exp(-inf - -inf) = NaN
        with np.errstate(invalid="ignore"):
            weights = ref.softmax(np.where(mask, scores, -np.inf))
    else:
        weights = ref.softmax(np.where(mask, scores, np.finfo(scores.dtype).min))
        if sw.fill == "zero":  # what a NaN-to-zero fast path returns for such a query
            weights = np.where(mask.any(axis=-1, keepdims=True), weights, 0.0)
    y = weights @ v  # (B, h, Tq, dh)
    if sw.heads == "interleaved":
        merged = y.transpose(0, 2, 3, 1).reshape(B, Tq, d)
    else:
        merged = y.transpose(0, 2, 1, 3).reshape(B, Tq, d)
    out = ref.dense(ref.sub(p, "o"), merged)
    if record is not None:
        if weights.shape[-1] != S:  # recorded over the S source keys: 0 for a key never seen
            seen = np.zeros(weights.shape[:-1] + (S,), dtype=weights.dtype)
            keep = min(S, weights.shape[-1])
            seen[..., :keep] = weights[..., :keep]
            weights = seen
        record[name], record[name + ".weights"] = out, weights
    return out


def feed_forward(p: Params, x: np.ndarray, act: str, record: Stages | None, name: str) -> np.ndarray:
    out = ref.dense(ref.sub(p, "linear2"), ref.activation(act, ref.dense(ref.sub(p, "linear1"), x)))
    if record is not None:
        record[name] = out
    return out


def residual(p_norm: Params, x: np.ndarray, sublayer, cfg: ModelConfig, sw: Switches) -> np.ndarray:
    """Post-norm LN(x + Sublayer(x)) (§3.1) or pre-norm x + Sublayer(LN(x))."""
    if cfg.norm_first:
        return x + sublayer(layer_norm(p_norm, x, cfg.layer_norm_eps, sw.layer_norm))
    return layer_norm(p_norm, x + sublayer(x), cfg.layer_norm_eps, sw.layer_norm)


# -- Layers and stacks ---------------------------------------------------------------------

def encoder_layer(p: Params, x: np.ndarray, mask: np.ndarray, cfg: ModelConfig, sw: Switches,
                  record: Stages | None, name: str) -> np.ndarray:
    """One encoder layer, §3.1: self-attention, then feed-forward."""
    attn = ref.sub(p, "self_attn")
    x = residual(ref.sub(p, "self_attn_norm"), x, lambda h: attention(
        attn, h, h, mask, cfg.num_heads, sw, record, f"{name}.self_attn"), cfg, sw)
    return residual(ref.sub(p, "ffn_norm"), x, lambda h: feed_forward(
        ref.sub(p, "ffn"), h, cfg.activation, record, f"{name}.ffn"), cfg, sw)


def decoder_layer(p: Params, x: np.ndarray, memory: np.ndarray, self_mask: np.ndarray,
                  cross_mask: np.ndarray, cfg: ModelConfig, sw: Switches, record: Stages | None,
                  name: str) -> np.ndarray:
    """One decoder layer, §3.1: masked self-attention, cross-attention, feed-forward."""
    self_attn, cross_attn = ref.sub(p, "self_attn"), ref.sub(p, "cross_attn")
    x = residual(ref.sub(p, "self_attn_norm"), x, lambda h: attention(
        self_attn, h, h, self_mask, cfg.num_heads, sw, record, f"{name}.self_attn"), cfg, sw)
    x = residual(ref.sub(p, "cross_attn_norm"), x, lambda h: attention(
        cross_attn, h, memory, cross_mask, cfg.num_heads, sw, record, f"{name}.cross_attn",
        cross=True), cfg, sw)
    return residual(ref.sub(p, "ffn_norm"), x, lambda h: feed_forward(
        ref.sub(p, "ffn"), h, cfg.activation, record, f"{name}.ffn"), cfg, sw)


def encode(params: Params, cfg: ModelConfig, src: np.ndarray, sw: Switches, stages: Stages,
           fine: bool = False) -> np.ndarray:
    """The encoder: coarse stages (and with `fine` the sublayers) into `stages`; memory out."""
    record = stages if fine else None
    x = stages["src_embed"] = embed(params[embedding_names(cfg).src], src, cfg, sw)
    mask = source_mask(src, cfg.pad_id, sw)
    for i in range(cfg.num_encoder_layers):
        name = f"encoder.layers.{i}"
        x = stages[name] = encoder_layer(ref.sub(params, name), x, mask, cfg, sw, record, name)
    if cfg.has_final_norm:
        x = layer_norm(ref.sub(params, "encoder.final_norm"), x, cfg.layer_norm_eps, sw.layer_norm)
    stages["encoder"] = x
    return x


def decode(params: Params, cfg: ModelConfig, tgt: np.ndarray, memory: np.ndarray, src: np.ndarray,
           sw: Switches, stages: Stages, fine: bool = False) -> np.ndarray:
    """The decoder and the output layer: stages into `stages`; logits out."""
    record = stages if fine else None
    x = stages["tgt_embed"] = embed(params[embedding_names(cfg).tgt], tgt, cfg, sw)
    self_mask, cross_mask = target_mask(tgt, cfg.pad_id, sw), source_mask(src, cfg.pad_id, sw)
    for i in range(cfg.num_decoder_layers):
        name = f"decoder.layers.{i}"
        x = stages[name] = decoder_layer(ref.sub(params, name), x, memory, self_mask, cross_mask,
                                         cfg, sw, record, name)
    if cfg.has_final_norm:
        x = layer_norm(ref.sub(params, "decoder.final_norm"), x, cfg.layer_norm_eps, sw.layer_norm)
    stages["decoder"] = x
    logits = ref.generator(params, cfg, x)  # logit_scale included (Flax's / sqrt(d): a config flip)
    if sw.log_softmax_logits:  # a model ending in log_softmax, fed to a loss that applies its own
        top = logits.max(axis=-1, keepdims=True)
        logits = logits - (top + np.log(np.exp(logits - top).sum(axis=-1, keepdims=True)))
    stages["logits"] = logits
    return logits


def forward_stages(
    params: Params, cfg: ModelConfig, src: np.ndarray, tgt: np.ndarray,
    switches: Switches | None = None, fine: bool = False, encoder: Stages | None = None,
) -> Stages:
    """Every stage of the forward pass (in numpy_ref's order). `encoder`: the encoder stages of an
    earlier run to reuse (a mistake that leaves the encoder alone need not recompute it)."""
    sw = Switches() if switches is None else switches
    stages: Stages = {}
    if encoder is None:
        memory = encode(params, cfg, src, sw, stages, fine)
    else:
        stages.update(encoder)
        memory = encoder["encoder"]
    decode(params, cfg, tgt, memory, src, sw, stages, fine)
    return stages
