"""Porting in from `torch.nn.Transformer`: its weights, your embeddings and output layer ->
the canonical `(ModelConfig, params)` of SPEC §3.

nn.Transformer has no embeddings, positional encoding or output projection, so bring your own
`nn.Embedding` tables and `nn.Linear`, and state what it cannot know (positional encoding
kind, embedding scaling, special ids, max_len). The ported model masks padding from `pad_id`
and is causal in the decoder: nn.Transformer run with `src_key_padding_mask`,
`memory_key_padding_mask`, `tgt_key_padding_mask` and a causal `tgt_mask`.

    cfg, params = port_nn_transformer(transformer, src_embed, tgt_embed, generator, pad_id=0)
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rosetta.checkpoint import check_params, save_checkpoint
from rosetta.config import ModelConfig
from rosetta.errors import CheckpointError, ConfigError
from rosetta.params import Params, embedding_names, param_shapes

# (nn.Transformer state_dict key, canonical name, q/k/v block of a packed in_proj or None, transpose?)
Row = tuple[str, str, int | None, bool]


def _linear(key: str, name: str) -> list[Row]:  # nn.Linear.weight is [out, in]; kernel [in, out] (PITFALLS 7)
    return [(f"{key}.weight", f"{name}.kernel", None, True), (f"{key}.bias", f"{name}.bias", None, False)]


def _norm(key: str, name: str) -> list[Row]:  # nn.LayerNorm's `weight` is our `scale`
    return [(f"{key}.weight", f"{name}.scale", None, False), (f"{key}.bias", f"{name}.bias", None, False)]


def _attention(key: str, name: str) -> list[Row]:
    rows: list[Row] = []
    for block, proj in enumerate("qkv"):  # in_proj_weight [3d, d] packs q, k, v row-wise (PITFALLS 7)
        rows += [(f"{key}.in_proj_weight", f"{name}.{proj}.kernel", block, True),
                 (f"{key}.in_proj_bias", f"{name}.{proj}.bias", block, False)]
    return rows + _linear(f"{key}.out_proj", f"{name}.o")


def key_table(num_encoder_layers: int, num_decoder_layers: int, final_norm: bool) -> list[Row]:
    """The whole mapping from nn.Transformer's state_dict to canonical names, in one place."""
    rows: list[Row] = []
    for i in range(num_encoder_layers):
        p = f"encoder.layers.{i}"  # norm1 guards self-attention, norm2 the feed-forward block
        rows += _attention(f"{p}.self_attn", f"{p}.self_attn") + _norm(f"{p}.norm1", f"{p}.self_attn_norm")
        rows += _linear(f"{p}.linear1", f"{p}.ffn.linear1") + _linear(f"{p}.linear2", f"{p}.ffn.linear2")
        rows += _norm(f"{p}.norm2", f"{p}.ffn_norm")
    for i in range(num_decoder_layers):
        p = f"decoder.layers.{i}"  # multihead_attn is cross-attention; norm1, norm2, norm3 in order
        rows += _attention(f"{p}.self_attn", f"{p}.self_attn") + _norm(f"{p}.norm1", f"{p}.self_attn_norm")
        rows += _attention(f"{p}.multihead_attn", f"{p}.cross_attn")
        rows += _norm(f"{p}.norm2", f"{p}.cross_attn_norm")
        rows += _linear(f"{p}.linear1", f"{p}.ffn.linear1") + _linear(f"{p}.linear2", f"{p}.ffn.linear2")
        rows += _norm(f"{p}.norm3", f"{p}.ffn_norm")
    if final_norm:  # nn.Transformer adds encoder.norm and decoder.norm even in post-norm mode (PITFALLS 3)
        rows += _norm("encoder.norm", "encoder.final_norm") + _norm("decoder.norm", "decoder.final_norm")
    return rows


def _activation(fn: Any) -> str:
    """Our name for a layer's activation (nn.Transformer turns "relu"/"gelu" into F.relu/F.gelu).
    Caution: the encoder's eval fast path runs nn.GELU(approximate="tanh") as exact GELU."""
    if fn is F.relu or fn is torch.relu or isinstance(fn, nn.ReLU):
        return "relu"
    if fn is F.gelu or (isinstance(fn, nn.GELU) and fn.approximate == "none"):
        return "gelu"  # exact erf form, PyTorch's default (PITFALLS 6)
    if isinstance(fn, nn.GELU) and fn.approximate == "tanh":
        return "gelu_tanh"
    if fn is F.silu or isinstance(fn, nn.SiLU):
        return "silu"
    raise ConfigError(f"unsupported activation {fn!r} in an nn.Transformer layer; the format has relu, "
                      "gelu (F.gelu, nn.GELU()), gelu_tanh (nn.GELU(approximate='tanh')) and silu")


def _one(field: str, values: Iterable[Any], hint: str = "") -> Any:
    found = set(values)
    if len(found) != 1:
        raise ConfigError(f"nn.Transformer layers disagree on {field} ({sorted(found, key=repr)}); "
                          f"the format has one value for the whole model{hint}")
    return found.pop()


# TransformerDecoderLayer.__setstate__ shadows a module activation with F.relu when the layer is
# deep-copied, which nn.Transformer and nn.TransformerDecoder do: the decoder really runs ReLU.
_DECODER_RELU = (" (nn.TransformerDecoderLayer replaces a module activation such as nn.GELU() with "
                 "F.relu when deep-copied; build with F.gelu or the string 'gelu')")


def _numpy(t: torch.Tensor, dtype: type) -> np.ndarray:
    return t.detach().to("cpu", torch.float64 if dtype == np.float64 else torch.float32).numpy()


def port_nn_transformer(
    transformer: nn.Transformer, src_embed: nn.Embedding, tgt_embed: nn.Embedding, generator: nn.Linear,
    *, positional_encoding: str = "sinusoidal_interleaved", scale_embeddings: bool = True,
    pad_id: int = 0, bos_id: int = 1, eos_id: int = 2, max_len: int = 1024, dtype: type = np.float32,
) -> tuple[ModelConfig, Params]:
    """Canonical config and params (math layout) of an nn.Transformer model, as `dtype` (float32;
    np.float64 for a float64 trainer: rosetta.params.canonical_dtype).
    Sharing is read from tensor identity: src_embed.weight is tgt_embed.weight -> "src_tgt",
    generator.weight is tgt_embed.weight -> "decoder", both -> "all"."""
    for arg, value, cls in (("transformer", transformer, nn.Transformer), ("generator", generator, nn.Linear),
                            ("src_embed", src_embed, nn.Embedding), ("tgt_embed", tgt_embed, nn.Embedding)):
        if not isinstance(value, cls):
            raise ConfigError(f"{arg} must be a torch.nn.{cls.__name__}, got {type(value).__name__}")
    if any(t.is_meta for m in (transformer, src_embed, tgt_embed, generator) for t in m.parameters()):
        raise ConfigError("the modules hold meta tensors (no data); load real weights before porting")
    enc, dec = transformer.encoder, transformer.decoder
    if not (isinstance(enc, nn.TransformerEncoder) and enc.layers and isinstance(dec, nn.TransformerDecoder)
            and dec.layers and all(isinstance(m, nn.TransformerEncoderLayer) for m in enc.layers)
            and all(isinstance(m, nn.TransformerDecoderLayer) for m in dec.layers)):
        raise ConfigError("the encoder and decoder must be non-empty nn.TransformerEncoder/Decoder stacks "
                          "of nn.TransformerEncoderLayer/DecoderLayer")
    layers = [*enc.layers, *dec.layers]
    attns = [a for m in layers for a in (m.self_attn, getattr(m, "multihead_attn", None)) if a is not None]
    for a in attns:
        if not a._qkv_same_embed_dim:
            raise ConfigError(f"nn.MultiheadAttention with kdim/vdim ({a.kdim}, {a.vdim}) != embed_dim "
                              f"{a.embed_dim} (separate q/k/v weights) is not supported")
        if a.bias_k is not None or a.add_zero_attn:
            raise ConfigError("nn.MultiheadAttention with add_bias_kv or add_zero_attn is not supported")
    if (enc.norm is None) != (dec.norm is None):
        raise ConfigError("encoder.norm and decoder.norm must both be set or both be None (final_norm)")
    norms = [n for m in layers for n in (m.norm1, m.norm2, getattr(m, "norm3", None)) if n is not None]
    norms += [n for n in (enc.norm, dec.norm) if n is not None]
    if any(type(n) is not nn.LayerNorm for n in norms):
        found = sorted({type(n).__name__ for n in norms})
        raise ConfigError(f"every norm must be an nn.LayerNorm, found {', '.join(found)}")
    if src_embed.max_norm is not None or tgt_embed.max_norm is not None:
        raise ConfigError("nn.Embedding(max_norm=...) rescales rows on lookup; the format has no such step")

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a is b or (a.shape == b.shape and a.data_ptr() == b.data_ptr())

    shared, tied = same(src_embed.weight, tgt_embed.weight), same(generator.weight, tgt_embed.weight)
    dropouts = [d for m in layers for d in (m.dropout1, m.dropout2, getattr(m, "dropout3", m.dropout2))]
    attention_biases = [b for a in attns for b in (a.in_proj_bias, a.out_proj.bias)]
    cfg = ModelConfig(
        src_vocab_size=src_embed.num_embeddings, tgt_vocab_size=tgt_embed.num_embeddings,
        d_model=_one("d_model", (a.embed_dim for a in attns)),
        num_heads=_one("num_heads", (a.num_heads for a in attns)),
        num_encoder_layers=len(enc.layers), num_decoder_layers=len(dec.layers),
        d_ff=_one("d_ff", (m.linear1.out_features for m in layers)),
        dropout=_one("dropout", (d.p for d in dropouts)),  # embedding dropout is outside nn.Transformer
        activation_dropout=_one("activation_dropout", (m.dropout.p for m in layers)),
        attention_dropout=_one("attention_dropout", (a.dropout for a in attns)),
        activation=_one("activation", (_activation(m.activation) for m in layers), _DECODER_RELU),
        norm_first=_one("norm_first", (m.norm_first for m in layers)),
        final_norm=enc.norm is not None,
        layer_norm_eps=_one("layer_norm_eps", (n.eps for n in norms)),
        attention_bias=_one("attention_bias", (b is not None for b in attention_biases)),
        ffn_bias=_one("ffn_bias", (lin.bias is not None for m in layers for lin in (m.linear1, m.linear2))),
        scale_embeddings=scale_embeddings, positional_encoding=positional_encoding,
        share_embeddings={(True, True): "all", (True, False): "src_tgt", (False, True): "decoder",
                          (False, False): "none"}[(shared, tied)],
        output_bias=generator.bias is not None, max_len=max_len, pad_id=pad_id, bos_id=bos_id, eos_id=eos_id,
    )
    expected, state, used = param_shapes(cfg), transformer.state_dict(), set()
    params: Params = {}
    table = key_table(cfg.num_encoder_layers, cfg.num_decoder_layers, cfg.has_final_norm)
    for key, name, block, transpose in table:
        if name not in expected:
            continue  # a bias the config has none of (bias=False)
        if key not in state and name.endswith(("norm.scale", "norm.bias")):
            # bias=False also drops LayerNorm's bias (elementwise_affine=False both tensors); our
            # format always stores LN scale and bias, so store the identity they stand for.
            params[name] = np.full(cfg.d_model, 1.0 if name.endswith("scale") else 0.0, np.float32)
            continue
        if key not in state:
            raise CheckpointError(f"nn.Transformer state_dict has no {key} (needed for {name})")
        used.add(key)
        value = _numpy(state[key], dtype)
        if block is not None:
            value = value[block * cfg.d_model:(block + 1) * cfg.d_model]
        params[name] = np.ascontiguousarray(value.T if transpose else value)
    extra = sorted(set(state) - used)
    if extra:
        raise CheckpointError(f"nn.Transformer tensor(s) with no place in the format: {', '.join(extra)}")
    names = embedding_names(cfg)
    params[names.src], params[names.tgt] = _numpy(src_embed.weight, dtype), _numpy(tgt_embed.weight, dtype)
    if names.output is not None:  # nn.Linear [V, d] -> kernel [d, V] (PITFALLS 7)
        params[names.output] = np.ascontiguousarray(_numpy(generator.weight, dtype).T)
    if generator.bias is not None:
        params["generator.bias"] = _numpy(generator.bias, dtype)
    check_params(cfg, params, source="ported nn.Transformer")
    return cfg, {name: params[name] for name in expected}


def save_ported(path: str | os.PathLike, transformer: nn.Transformer, src_embed: nn.Embedding,
                tgt_embed: nn.Embedding, generator: nn.Linear, *, dtype: str = "float32",
                **facts: Any) -> tuple[ModelConfig, Path]:
    """Port (keyword `facts` as in `port_nn_transformer`) and write the canonical checkpoint."""
    cfg, params = port_nn_transformer(transformer, src_embed, tgt_embed, generator, **facts)
    return cfg, save_checkpoint(path, cfg, params, dtype, metadata={"ported_from": "torch.nn.Transformer"})
