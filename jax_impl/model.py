"""The Transformer (Vaswani et al. 2017) as Flax NNX modules.

Mirrors numpy_ref/model.py box for box and name for name, and torch_impl/model.py line for line;
diff them to see only framework differences (JAX-only speed paths live in jax_impl/ops.py). Module
attribute names are the canonical checkpoint names and Flax kernels are already [in, out], so
jax_impl/convert.py only joins paths. Dropout takes its randomness from an explicit `rngs` argument.

Shapes: B batch, S source length, T target length, d d_model, h heads, dh d_head, V vocab.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax import Array

from jax_impl.ops import Dropout, LayerCache, Positions, attention, project
from rosetta.config import ModelConfig
from rosetta.inputs import Packing, check_packing
from rosetta.params import embedding_names
from rosetta.positional import model_table

Stages = dict[str, Array]


# -- Building blocks -----------------------------------------------------------------------

def activation(name: str, x: Array) -> Array:
    if name == "relu":
        return jax.nn.relu(x)
    if name == "gelu":  # exact erf form: jax.nn.gelu defaults to the tanh form (PITFALLS 6)
        return jax.nn.gelu(x, approximate=False)
    if name == "gelu_tanh":
        return jax.nn.gelu(x, approximate=True)
    if name == "silu":
        return jax.nn.silu(x)
    raise ValueError(f"unknown activation {name!r}")


# -- Masks (True = may attend, as in Flax) -------------------------------------------------

def source_mask(src: Array, pad_id: int) -> Array:
    """[B, 1, 1, S]: every query may attend to every non-pad source key."""
    return (src != pad_id)[:, None, None, :]


def target_mask(tgt: Array, pad_id: int) -> Array:
    """[B, 1, T, T]: causal, and never a pad key; position 0 (the start token) is never
    padding, even when the start token equals pad_id (PITFALLS 12)."""
    valid = (jnp.asarray(tgt) != pad_id).at[:, 0].set(True)
    causal = jnp.tril(jnp.ones((tgt.shape[1], tgt.shape[1]), dtype=bool))
    return causal[None, None, :, :] & valid[:, None, None, :]


def segment_mask(q_segments: Array, k_segments: Array, causal: bool = False) -> Array:
    """[B, 1, Tq, Tk] for packed rows (docs/packing.md; Flax WMT's segmentation masks): a query
    attends only to keys of its own segment, never to padding (segment 0); causal too for decoder
    self-attention. A padding query has no key left: uniform weights (SPEC §2)."""
    mask = (q_segments[:, :, None] == k_segments[:, None, :]) & (k_segments[:, None, :] != 0)
    if causal:
        mask = mask & jnp.tril(jnp.ones(mask.shape[1:], dtype=bool))
    return mask[:, None]


# -- Sublayers -----------------------------------------------------------------------------

class MultiHeadAttention(nnx.Module):
    """Multi-head scaled dot-product attention, §3.2.1-3.2.2, eq. 1."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        d, bias = cfg.d_model, cfg.attention_bias
        self.q, self.k, self.v, self.o = (nnx.Linear(d, d, use_bias=bias, dtype=dtype, rngs=rngs)
                                          for _ in range(4))
        self.num_heads, self.attention_dropout = cfg.num_heads, Dropout(cfg.attention_dropout)

    def split_heads(self, x: Array) -> Array:  # (B, T, d) -> (B, h, T, dh)
        B, T, d = x.shape
        return x.reshape(B, T, self.num_heads, d // self.num_heads).transpose(0, 2, 1, 3)

    def project_kv(self, x_kv: Array) -> tuple[Array, Array]:
        """Keys and values (B, h, Tk, dh): what a decoding cache stores."""
        return self.split_heads(self.k(x_kv)), self.split_heads(self.v(x_kv))

    def attend(self, x_q: Array, k: Array, v: Array, mask: Array,
               rngs: nnx.Rngs | None = None, record: Stages | None = None, name: str = "") -> Array:
        """Eq. 1 for x_q (B, Tq, d) over k, v (B, h, Tk, dh), by jax_impl/ops.py. With `record`, the
        fine stages `name` (the o projection's output) and `name.weights` (the softmax) go into it."""
        B, Tq, d = x_q.shape
        q = self.split_heads(self.q(x_q))
        y, weights = attention(q, k, v, mask, self.attention_dropout, rngs, record is not None)
        out = self.o(y.reshape(B, Tq, d))  # (B, Tq, h, dh) -> (B, Tq, d): heads side by side
        if record is not None:
            record[name], record[name + ".weights"] = out, weights
        return out

    def __call__(self, x_q: Array, x_kv: Array, mask: Array,
                 rngs: nnx.Rngs | None = None, record: Stages | None = None, name: str = "") -> Array:
        return self.attend(x_q, *self.project_kv(x_kv), mask, rngs, record, name)


class FeedForward(nnx.Module):
    """Position-wise feed-forward network, §3.3, eq. 2 (with a choice of activation)."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(cfg.d_model, cfg.d_ff, use_bias=cfg.ffn_bias, dtype=dtype, rngs=rngs)
        self.linear2 = nnx.Linear(cfg.d_ff, cfg.d_model, use_bias=cfg.ffn_bias, dtype=dtype, rngs=rngs)
        self.activation, self.dropout = cfg.activation, Dropout(cfg.activation_dropout_rate)

    def __call__(self, x: Array, rngs: nnx.Rngs | None = None, record: Stages | None = None,
                 name: str = "") -> Array:
        out = self.linear2(self.dropout(activation(self.activation, self.linear1(x)), rngs=rngs))
        if record is not None:
            record[name] = out
        return out


def residual(norm: nnx.LayerNorm, x: Array, sublayer, cfg: ModelConfig,
             dropout: nnx.Dropout, rngs: nnx.Rngs | None) -> Array:
    """Post-norm LN(x + Dropout(Sublayer(x))) (§3.1, §5.4), or pre-norm x + Dropout(Sublayer(LN(x)))."""
    if cfg.norm_first:
        return x + dropout(sublayer(norm(x)), rngs=rngs)
    return norm(x + dropout(sublayer(x), rngs=rngs))


def norm_layer(cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.LayerNorm:
    # Flax defaults to epsilon 1e-6 and a fast E[x^2] - E[x]^2 variance (PITFALLS 2): take the
    # configured epsilon and the two-pass variance of SPEC §2.
    return nnx.LayerNorm(cfg.d_model, epsilon=cfg.layer_norm_eps, use_fast_variance=False,
                         dtype=dtype, rngs=rngs)


# -- Layers and stacks ---------------------------------------------------------------------

class EncoderLayer(nnx.Module):
    """One encoder layer, §3.1: self-attention, then feed-forward."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.self_attn, self.self_attn_norm = (MultiHeadAttention(cfg, dtype, rngs),
                                               norm_layer(cfg, dtype, rngs))
        self.ffn, self.ffn_norm = FeedForward(cfg, dtype, rngs), norm_layer(cfg, dtype, rngs)
        self.dropout = Dropout(cfg.dropout)

    def __call__(self, x: Array, mask: Array, rngs: nnx.Rngs | None = None,
                 record: Stages | None = None, name: str = "") -> Array:
        """With `record`, the fine stages `name.self_attn(.weights)` and `name.ffn`."""
        x = residual(self.self_attn_norm, x,
                     lambda h: self.self_attn(h, h, mask, rngs, record, f"{name}.self_attn"), self.cfg,
                     self.dropout, rngs)
        return residual(self.ffn_norm, x, lambda h: self.ffn(h, rngs, record, f"{name}.ffn"), self.cfg,
                        self.dropout, rngs)


class DecoderLayer(nnx.Module):
    """One decoder layer, §3.1: masked self-attention, cross-attention, feed-forward."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.self_attn, self.self_attn_norm = (MultiHeadAttention(cfg, dtype, rngs),
                                               norm_layer(cfg, dtype, rngs))
        self.cross_attn, self.cross_attn_norm = (MultiHeadAttention(cfg, dtype, rngs),
                                                 norm_layer(cfg, dtype, rngs))
        self.ffn, self.ffn_norm = FeedForward(cfg, dtype, rngs), norm_layer(cfg, dtype, rngs)
        self.dropout = Dropout(cfg.dropout)

    def __call__(self, x: Array, memory: Array, self_mask: Array, cross_mask: Array,
                 rngs: nnx.Rngs | None = None, record: Stages | None = None, name: str = "") -> Array:
        """With `record`, the fine stages `name.self_attn(.weights)`, `name.cross_attn(.weights)`
        and `name.ffn`."""
        x = residual(self.self_attn_norm, x,
                     lambda h: self.self_attn(h, h, self_mask, rngs, record, f"{name}.self_attn"),
                     self.cfg, self.dropout, rngs)
        x = residual(self.cross_attn_norm, x,
                     lambda h: self.cross_attn(h, memory, cross_mask, rngs, record, f"{name}.cross_attn"),
                     self.cfg, self.dropout, rngs)
        return residual(self.ffn_norm, x, lambda h: self.ffn(h, rngs, record, f"{name}.ffn"), self.cfg,
                        self.dropout, rngs)

    def step(self, x: Array, cache: LayerCache, t: Array, self_mask: Array,
             cross_mask: Array) -> tuple[Array, LayerCache]:
        """__call__() for one new token at position t [N, 1, d]: its key and value are written into the
        fixed-size cache, cross-attention reuses the cached encoder keys/values. Returns the new cache
        too: JAX arrays are immutable."""
        written = {}

        def self_attn(h: Array) -> Array:
            y, written["cache"] = cache.self_attend(self.self_attn, h, t, self_mask)  # a new cache
            return y

        x = residual(self.self_attn_norm, x, self_attn, self.cfg, self.dropout, None)
        x = residual(self.cross_attn_norm, x,
                     lambda h: cache.cross_attend(self.cross_attn.attend, h, cross_mask),
                     self.cfg, self.dropout, None)
        x = residual(self.ffn_norm, x, self.ffn, self.cfg, self.dropout, None)
        return x, written["cache"]


class Stack(nnx.Module):
    """`layers` then, if `final_norm`, one more LayerNorm: the encoder or the decoder."""

    def __init__(self, cfg: ModelConfig, layer: type[nnx.Module], num_layers: int,
                 dtype: jnp.dtype, rngs: nnx.Rngs):
        self.layers = nnx.List([layer(cfg, dtype, rngs) for _ in range(num_layers)])
        self.final_norm = norm_layer(cfg, dtype, rngs) if cfg.has_final_norm else None


class Generator(nnx.Module):
    """Logits = logit_scale * (hidden W_out) (+ b_out); tied tables use W_out = E^T (§3.4).
    `kernel` is the canonical [d, V]."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype):
        tied = embedding_names(cfg).output is None
        V, d = cfg.tgt_vocab_size, cfg.d_model
        self.kernel = None if tied else nnx.Param(jnp.zeros((d, V)))
        self.bias = nnx.Param(jnp.zeros((V,))) if cfg.output_bias else None
        self.dtype, self.logit_scale = dtype, cfg.logit_scale

    def __call__(self, hidden: Array, tgt_table: nnx.Embed) -> Array:
        kernel = tgt_table.embedding[...].T if self.kernel is None else self.kernel[...]
        logits = project(hidden, kernel.astype(self.dtype))
        logits = logits if self.logit_scale == 1.0 else logits * self.logit_scale  # SPEC §2 (Flax: 1/sqrt(d))
        return logits if self.bias is None else logits + self.bias[...].astype(self.dtype)


class Transformer(nnx.Module):
    """The encoder-decoder model of Figure 1."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype = jnp.float32, *, rngs: nnx.Rngs):
        self.cfg = cfg
        names = embedding_names(cfg)
        for name in dict.fromkeys((names.src, names.tgt)):  # one table when shared
            vocab = cfg.tgt_vocab_size if name.startswith("tgt") else cfg.src_vocab_size
            setattr(self, name.split(".")[0], nnx.Embed(vocab, cfg.d_model, dtype=dtype, rngs=rngs))
        self.encoder = Stack(cfg, EncoderLayer, cfg.num_encoder_layers, dtype, rngs)
        self.decoder = Stack(cfg, DecoderLayer, cfg.num_decoder_layers, dtype, rngs)
        self.generator = Generator(cfg, dtype)
        self.dropout = Dropout(cfg.dropout)
        self.positions = Positions(jnp.asarray(model_table(cfg), dtype=jnp.promote_types(dtype, jnp.float32)))

    def position_table(self, rows: int) -> Array:
        """The sinusoidal table, at least `rows` positions long: a longer one is built at trace time
        (`rows` is static) as a constant of that compiled shape (rosetta/positional.py)."""
        if rows > self.positions.shape[0]:
            return jnp.asarray(model_table(self.cfg, rows), dtype=self.positions.dtype)
        return self.positions[...]

    @property
    def src_table(self) -> nnx.Embed:
        return getattr(self, embedding_names(self.cfg).src.split(".")[0])

    @property
    def tgt_table(self) -> nnx.Embed:
        return getattr(self, embedding_names(self.cfg).tgt.split(".")[0])

    def embed(self, table: nnx.Embed, ids: Array, offset: int | Array = 0, rngs: nnx.Rngs | None = None,
              rows: int | None = None, positions: Array | None = None) -> Array:
        """Dropout(E[x] * sqrt(d_model) + PE[pos]), §3.4-3.5 and §5.4. `rows`: how many positions the
        caller will use in all (decode_step: the cache length; a traced offset needs it), offset +
        length if None. `positions` [B, T]: given per token (packed rows restart them at 0 per segment)."""
        x = table(ids)
        if self.cfg.scale_embeddings:
            x = x * math.sqrt(self.cfg.d_model)
        pe = self.position_table(offset + ids.shape[1] if rows is None else rows)
        pe = jax.lax.dynamic_slice_in_dim(pe, offset, ids.shape[1]) if positions is None else pe[positions]
        return self.dropout(x + pe.astype(x.dtype), rngs=rngs)

    def encode(self, src: Array, stages: Stages | None = None, rngs: nnx.Rngs | None = None,
               fine: bool = False, packing: Packing | None = None) -> Array:
        """The encoder stack: src [B, S] -> memory [B, S, d]; `fine` adds the sublayer stages.
        Packed rows give `packing`: its `src_segments` and `src_positions` [B, S] (docs/packing.md)."""
        stages = {} if stages is None else stages
        record = stages if fine else None
        positions = None if packing is None else packing.src_positions
        x = stages["src_embed"] = self.embed(self.src_table, src, rngs=rngs, positions=positions)
        mask = (source_mask(src, self.cfg.pad_id) if packing is None
                else segment_mask(packing.src_segments, packing.src_segments))
        for i, layer in enumerate(self.encoder.layers):
            x = stages[f"encoder.layers.{i}"] = layer(x, mask, rngs, record, f"encoder.layers.{i}")
        x = x if self.encoder.final_norm is None else self.encoder.final_norm(x)
        stages["encoder"] = x
        return x

    def decode(self, tgt: Array, memory: Array, src: Array, stages: Stages | None = None,
               rngs: nnx.Rngs | None = None, fine: bool = False, packing: Packing | None = None) -> Array:
        """The decoder stack: tgt [B, T] (starting with the start token) -> hidden [B, T, d];
        `fine` adds the sublayer stages. Packed rows give `packing`: its `tgt_segments`,
        `tgt_positions` [B, T] and the `src_segments` [B, S] of the memory (docs/packing.md)."""
        stages = {} if stages is None else stages
        record = stages if fine else None
        positions = None if packing is None else packing.tgt_positions
        x = stages["tgt_embed"] = self.embed(self.tgt_table, tgt, rngs=rngs, positions=positions)
        if packing is None:
            self_mask, cross_mask = target_mask(tgt, self.cfg.pad_id), source_mask(src, self.cfg.pad_id)
        else:  # segments decide padding: the start token of every segment is real, even if == pad_id
            self_mask = segment_mask(packing.tgt_segments, packing.tgt_segments, causal=True)
            cross_mask = segment_mask(packing.tgt_segments, packing.src_segments)
        for i, layer in enumerate(self.decoder.layers):
            x = stages[f"decoder.layers.{i}"] = layer(x, memory, self_mask, cross_mask, rngs, record,
                                                      f"decoder.layers.{i}")
        x = x if self.decoder.final_norm is None else self.decoder.final_norm(x)
        stages["decoder"] = x
        return x

    def init_cache(self, memory: Array, length: int, beams: int = 1) -> list[LayerCache]:
        """Empty self-attention caches for `length` output positions and `beams` rows a sentence;
        cross-attention keys and values of `memory` [B, S, d], computed once (LayerCache.cross_attend)."""
        caches = []
        for layer in self.decoder.layers:
            cross_k, cross_v = layer.cross_attn.project_kv(memory)
            B, h, _, dh = cross_k.shape
            keys, values = (jnp.zeros(shape, cross_k.dtype) for shape in  # ops.LayerCache's layouts
                            ((B, h, dh, length * beams), (B, h, length * beams, dh)))
            caches.append(LayerCache(keys, values, jnp.zeros((B * beams, length), jnp.int32),
                                     cross_k.swapaxes(2, 3), cross_v))
        return caches

    def decode_step(self, tokens: Array, t: Array, cache: list[LayerCache],
                    cross_mask: Array) -> tuple[Array, list[LayerCache]]:
        """Logits [N, V] for the tokens [N] fed at position t, given the cache of positions < t, and
        the updated cache. Every cached position is a real token (decoding never emits pad_id)."""
        length = cache[0].slots.shape[1]
        x = self.embed(self.tgt_table, tokens[:, None], offset=t, rows=length)
        self_mask = (jnp.arange(length) <= t)[None, None, None, :]
        new_cache = []
        for layer, layer_cache in zip(self.decoder.layers, cache, strict=True):
            x, layer_cache = layer.step(x, layer_cache, t, self_mask, cross_mask)
            new_cache.append(layer_cache)
        x = x if self.decoder.final_norm is None else self.decoder.final_norm(x)
        return self.generator(x, self.tgt_table)[:, 0], new_cache

    def __call__(self, src: Array, tgt: Array, stages: Stages | None = None, rngs: nnx.Rngs | None = None,
                 fine: bool = False, packing: Packing | None = None, hidden: bool = False) -> Array:
        """Logits [B, T, V] for source ids [B, S] and decoder input ids [B, T]; `stages` receives
        the coarse stages, and with `fine` the sublayer outputs and attention weights too. Packed
        rows (several pairs per row) give `packing`, all four segment/position arrays (docs/packing.md).
        `hidden`: the decoder's output [B, T, d] instead, for the chunked loss (jax_impl/loss.py)."""
        stages = {} if stages is None else stages
        packing = packing if check_packing(src, tgt, packing) else None
        memory = self.encode(src, stages, rngs, fine, packing)
        out = self.decode(tgt, memory, src, stages, rngs, fine, packing)
        if hidden:
            return out
        logits = stages["logits"] = self.generator(out, self.tgt_table)
        return logits
