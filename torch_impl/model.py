"""The Transformer (Vaswani et al. 2017) as PyTorch modules.

Mirrors numpy_ref/model.py box for box and name for name, and jax_impl/model.py line for line; diff them to
see only framework differences (PyTorch-only speed paths live in torch_impl/ops.py and onednn.py). Module
attribute names are the canonical checkpoint names, so torch_impl/convert.py only renames leaves and
transposes kernels.

Shapes: B batch, S source length, T target length, d d_model, h heads, dh d_head, V vocab.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rosetta.config import ModelConfig
from rosetta.inputs import Packing, check_packing
from rosetta.params import embedding_names
from rosetta.positional import model_table
from torch_impl.onednn import Linear, linear
from torch_impl.ops import Dropout, LayerCache, SegmentMask, attention, grow_positions, packed_mask

Stages = dict[str, Tensor]


# -- Building blocks -----------------------------------------------------------------------

def activation(name: str, x: Tensor) -> Tensor:
    if name == "relu":
        return F.relu(x)
    if name == "gelu":  # exact erf form, PyTorch's default (jax.nn.gelu's is tanh: PITFALLS 6)
        return F.gelu(x, approximate="none")
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "silu":
        return F.silu(x)
    raise ValueError(f"unknown activation {name!r}")


# -- Masks (True = may attend) -------------------------------------------------------------

def source_mask(src: Tensor, pad_id: int) -> Tensor:
    """[B, 1, 1, S]: every query may attend to every non-pad source key."""
    return (src != pad_id)[:, None, None, :]


def target_mask(tgt: Tensor, pad_id: int) -> Tensor:
    """[B, 1, T, T]: causal, and never a pad key; position 0 (the start token) is never
    padding, even when the start token equals pad_id (PITFALLS 12)."""
    valid = tgt != pad_id
    valid[:, 0] = True
    causal = torch.ones(tgt.shape[1], tgt.shape[1], dtype=torch.bool, device=tgt.device).tril()
    return causal[None, None, :, :] & valid[:, None, None, :]


def segment_mask(q_segments: Tensor, k_segments: Tensor, causal: bool = False) -> Tensor | SegmentMask:
    """[B, 1, Tq, Tk] for packed rows (docs/packing.md; Flax WMT's segmentation masks): a query
    attends only to keys of its own segment, never to padding (segment 0); causal too for decoder
    self-attention. A padding query has no key left: uniform weights (SPEC §2). With a BlockMask of the
    same rule where torch_impl/ops.py's packed_mask chooses FlexAttention (a SegmentMask)."""
    mask = (q_segments[:, :, None] == k_segments[:, None, :]) & (k_segments[:, None, :] != 0)
    if causal:
        mask = mask & torch.ones(mask.shape[1:], dtype=torch.bool, device=mask.device).tril()
    return packed_mask(mask[:, None], q_segments, k_segments, causal)


# -- Sublayers -----------------------------------------------------------------------------

class MultiHeadAttention(nn.Module):
    """Multi-head scaled dot-product attention, §3.2.1-3.2.2, eq. 1."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, bias = cfg.d_model, cfg.attention_bias
        self.q, self.k, self.v, self.o = (Linear(d, d, bias=bias) for _ in range(4))
        self.num_heads, self.attention_dropout = cfg.num_heads, cfg.attention_dropout

    def split_heads(self, x: Tensor) -> Tensor:  # (B, T, d) -> (B, h, T, dh)
        B, T, d = x.shape
        return x.view(B, T, self.num_heads, d // self.num_heads).transpose(1, 2)

    def project_kv(self, x_kv: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values (B, h, Tk, dh): what a decoding cache stores."""
        return self.split_heads(self.k(x_kv)), self.split_heads(self.v(x_kv))

    def attend(self, x_q: Tensor, k: Tensor, v: Tensor, mask: Tensor,
               record: Stages | None = None, name: str = "") -> Tensor:
        """Eq. 1 for x_q (B, Tq, d) over k, v (B, h, Tk, dh), by torch_impl/ops.py. With `record`, the
        fine stages `name` (the o projection's output) and `name.weights` (the softmax) go into it."""
        B, Tq, d = x_q.shape
        q = self.split_heads(self.q(x_q))
        dropout = self.attention_dropout if self.training else 0.0  # a rate: SDPA drops inside
        y, weights = attention(q, k, v, mask, dropout, record is not None)
        out = self.o(y.reshape(B, Tq, d))  # (B, Tq, h, dh) -> (B, Tq, d): heads side by side
        if record is not None:
            record[name], record[name + ".weights"] = out, weights
        return out

    def forward(self, x_q: Tensor, x_kv: Tensor, mask: Tensor,
                record: Stages | None = None, name: str = "") -> Tensor:
        return self.attend(x_q, *self.project_kv(x_kv), mask, record, name)


class FeedForward(nn.Module):
    """Position-wise feed-forward network, §3.3, eq. 2 (with a choice of activation)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.linear1 = Linear(cfg.d_model, cfg.d_ff, bias=cfg.ffn_bias)
        self.linear2 = Linear(cfg.d_ff, cfg.d_model, bias=cfg.ffn_bias)
        self.activation, self.dropout = cfg.activation, Dropout(cfg.activation_dropout_rate)

    def forward(self, x: Tensor, record: Stages | None = None, name: str = "") -> Tensor:
        out = self.linear2(self.dropout(activation(self.activation, self.linear1(x))))
        if record is not None:
            record[name] = out
        return out


def residual(norm: nn.LayerNorm, x: Tensor, sublayer, cfg: ModelConfig, dropout: nn.Dropout) -> Tensor:
    """Post-norm LN(x + Dropout(Sublayer(x))) (§3.1, §5.4), or pre-norm x + Dropout(Sublayer(LN(x)))."""
    if cfg.norm_first:
        return x + dropout(sublayer(norm(x)))
    return norm(x + dropout(sublayer(x)))


def norm_layer(cfg: ModelConfig) -> nn.LayerNorm:
    # Biased variance, eps inside the sqrt, as SPEC §2; its `weight` is our `scale`.
    return nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)


# -- Layers and stacks ---------------------------------------------------------------------

class EncoderLayer(nn.Module):
    """One encoder layer, §3.1: self-attention, then feed-forward."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.self_attn, self.self_attn_norm = MultiHeadAttention(cfg), norm_layer(cfg)
        self.ffn, self.ffn_norm = FeedForward(cfg), norm_layer(cfg)
        self.dropout = Dropout(cfg.dropout)

    def forward(self, x: Tensor, mask: Tensor, record: Stages | None = None, name: str = "") -> Tensor:
        """With `record`, the fine stages `name.self_attn(.weights)` and `name.ffn`."""
        x = residual(self.self_attn_norm, x,
                     lambda h: self.self_attn(h, h, mask, record, f"{name}.self_attn"), self.cfg,
                     self.dropout)
        return residual(self.ffn_norm, x, lambda h: self.ffn(h, record, f"{name}.ffn"), self.cfg,
                        self.dropout)


class DecoderLayer(nn.Module):
    """One decoder layer, §3.1: masked self-attention, cross-attention, feed-forward."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.self_attn, self.self_attn_norm = MultiHeadAttention(cfg), norm_layer(cfg)
        self.cross_attn, self.cross_attn_norm = MultiHeadAttention(cfg), norm_layer(cfg)
        self.ffn, self.ffn_norm = FeedForward(cfg), norm_layer(cfg)
        self.dropout = Dropout(cfg.dropout)

    def forward(self, x: Tensor, memory: Tensor, self_mask: Tensor,
                cross_mask: Tensor, record: Stages | None = None, name: str = "") -> Tensor:
        """With `record`, the fine stages `name.self_attn(.weights)`, `name.cross_attn(.weights)`
        and `name.ffn`."""
        x = residual(self.self_attn_norm, x,
                     lambda h: self.self_attn(h, h, self_mask, record, f"{name}.self_attn"), self.cfg,
                     self.dropout)
        x = residual(self.cross_attn_norm, x,
                     lambda h: self.cross_attn(h, memory, cross_mask, record, f"{name}.cross_attn"),
                     self.cfg, self.dropout)
        return residual(self.ffn_norm, x, lambda h: self.ffn(h, record, f"{name}.ffn"), self.cfg,
                        self.dropout)

    def step(self, x: Tensor, cache: LayerCache, t: int | Tensor, self_mask: Tensor,
             cross_mask: Tensor) -> Tensor:
        """forward() for one new token at position t [N, 1, d]: its key and value are written
        into the preallocated cache, cross-attention reuses the cached encoder keys/values; in place,
        an int t (eager) attending over positions <= t only (torch_impl/ops.py's LayerCache)."""
        x = residual(self.self_attn_norm, x, lambda h: cache.self_attend(self.self_attn, h, t, self_mask),
                     self.cfg, self.dropout)
        x = residual(self.cross_attn_norm, x, lambda h: cache.cross_attend(self.cross_attn, h, cross_mask),
                     self.cfg, self.dropout)
        return residual(self.ffn_norm, x, self.ffn, self.cfg, self.dropout)


class Stack(nn.Module):
    """`layers` then, if `final_norm`, one more LayerNorm: the encoder or the decoder."""

    def __init__(self, cfg: ModelConfig, layer: type[nn.Module], num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(layer(cfg) for _ in range(num_layers))
        self.final_norm = norm_layer(cfg) if cfg.has_final_norm else None


class Generator(nn.Module):
    """Logits = logit_scale * (hidden W_out) (+ b_out); tied tables use W_out = E^T (§3.4).
    `weight` is stored as nn.Linear's [V, d] (the transpose of the canonical kernel)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        tied = embedding_names(cfg).output is None
        V, d = cfg.tgt_vocab_size, cfg.d_model
        self.weight = None if tied else nn.Parameter(torch.empty(V, d))
        self.bias = nn.Parameter(torch.empty(V)) if cfg.output_bias else None
        self.logit_scale = cfg.logit_scale

    def forward(self, hidden: Tensor, tgt_table: nn.Embedding) -> Tensor:
        weight = tgt_table.weight if self.weight is None else self.weight
        logits = linear(hidden, weight)
        logits = logits if self.logit_scale == 1.0 else logits * self.logit_scale  # SPEC §2 (Flax: 1/sqrt(d))
        return logits if self.bias is None else logits + self.bias


class Transformer(nn.Module):
    """The encoder-decoder model of Figure 1."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        names = embedding_names(cfg)
        for name in dict.fromkeys((names.src, names.tgt)):  # one table when shared
            vocab = cfg.tgt_vocab_size if name.startswith("tgt") else cfg.src_vocab_size
            # The table given (zeros: build_model loads every value), so nothing initialises it: nn.init's
            # normal_ on the meta device imports torch's compiler (~1 s of a decoding process's start).
            self.add_module(name.split(".")[0], nn.Embedding(vocab, cfg.d_model,
                                                             _weight=torch.zeros(vocab, cfg.d_model)))
        self.encoder = Stack(cfg, EncoderLayer, cfg.num_encoder_layers)
        self.decoder = Stack(cfg, DecoderLayer, cfg.num_decoder_layers)
        self.generator = Generator(cfg)
        self.dropout = Dropout(cfg.dropout)
        # float64, cast with the parameters; a real tensor even on the meta device (from_numpy ignores
        # the default device); not persistent: it is not part of the checkpoint.
        self.register_buffer("positions", torch.from_numpy(model_table(cfg)), persistent=False)

    def position_table(self, rows: int) -> Tensor:
        """The sinusoidal table, at least `rows` positions long: grown if shorter (rosetta/positional.py)."""
        if rows > self.positions.shape[0]:
            grow_positions(self, rows)
        return self.positions

    @property
    def src_table(self) -> nn.Embedding:
        return getattr(self, embedding_names(self.cfg).src.split(".")[0])

    @property
    def tgt_table(self) -> nn.Embedding:
        return getattr(self, embedding_names(self.cfg).tgt.split(".")[0])

    def embed(self, table: nn.Embedding, ids: Tensor, offset: int | Tensor = 0,
              rows: int | None = None, positions: Tensor | None = None) -> Tensor:
        """Dropout(E[x] * sqrt(d_model) + PE[pos]), §3.4-3.5 and §5.4. `rows`: how many positions
        the caller will use in all (decode_step: the cache length; a tensor offset needs it), offset
        + length if None. `positions` [B, T]: given per token (packed rows restart them at 0 per segment)."""
        x = table(ids)
        if self.cfg.scale_embeddings:
            x = x * math.sqrt(self.cfg.d_model)
        pe = self.position_table(offset + ids.shape[1] if rows is None else rows)
        if positions is None and isinstance(offset, Tensor):  # a compiled step's t: gathered, no host read
            positions = offset + torch.arange(ids.shape[1], device=ids.device)
        pe = pe[offset: offset + ids.shape[1]] if positions is None else pe[positions]
        return self.dropout(x + pe.to(x.dtype))

    def encode(self, src: Tensor, stages: Stages | None = None, fine: bool = False,
               packing: Packing | None = None) -> Tensor:
        """The encoder stack: src [B, S] -> memory [B, S, d]; `fine` adds the sublayer stages.
        Packed rows give `packing`: its `src_segments` and `src_positions` [B, S] (docs/packing.md)."""
        stages = {} if stages is None else stages
        record = stages if fine else None
        positions = None if packing is None else packing.src_positions
        x = stages["src_embed"] = self.embed(self.src_table, src, positions=positions)
        mask = (source_mask(src, self.cfg.pad_id) if packing is None
                else segment_mask(packing.src_segments, packing.src_segments))
        for i, layer in enumerate(self.encoder.layers):
            x = stages[f"encoder.layers.{i}"] = layer(x, mask, record, f"encoder.layers.{i}")
        x = x if self.encoder.final_norm is None else self.encoder.final_norm(x)
        stages["encoder"] = x
        return x

    def decode(self, tgt: Tensor, memory: Tensor, src: Tensor, stages: Stages | None = None,
               fine: bool = False, packing: Packing | None = None) -> Tensor:
        """The decoder stack: tgt [B, T] (starting with the start token) -> hidden [B, T, d];
        `fine` adds the sublayer stages. Packed rows give `packing`: its `tgt_segments`,
        `tgt_positions` [B, T] and the `src_segments` [B, S] of the memory (docs/packing.md)."""
        stages = {} if stages is None else stages
        record = stages if fine else None
        positions = None if packing is None else packing.tgt_positions
        x = stages["tgt_embed"] = self.embed(self.tgt_table, tgt, positions=positions)
        if packing is None:
            self_mask, cross_mask = target_mask(tgt, self.cfg.pad_id), source_mask(src, self.cfg.pad_id)
        else:  # segments decide padding: the start token of every segment is real, even if == pad_id
            self_mask = segment_mask(packing.tgt_segments, packing.tgt_segments, causal=True)
            cross_mask = segment_mask(packing.tgt_segments, packing.src_segments)
        for i, layer in enumerate(self.decoder.layers):
            x = stages[f"decoder.layers.{i}"] = layer(x, memory, self_mask, cross_mask, record,
                                                      f"decoder.layers.{i}")
        x = x if self.decoder.final_norm is None else self.decoder.final_norm(x)
        stages["decoder"] = x
        return x

    def init_cache(self, memory: Tensor, length: int, beams: int = 1) -> list[LayerCache]:
        """Empty self-attention caches for `length` output positions and `beams` rows a sentence, every
        layer's in one tensor (LayerCache.stack); cross-attention keys and values of `memory` [B, S, d],
        computed once (LayerCache.cross_attend)."""
        # Contiguous once (split_heads gives views): every step's matmuls over them copied them first.
        cross = [[x.contiguous() for x in layer.cross_attn.project_kv(memory)]
                 for layer in self.decoder.layers]
        B, h, _, dh = cross[0][0].shape
        stack = cross[0][0].new_zeros(len(cross), 2, B * beams, h, length, dh)  # self: beams a sentence
        return [LayerCache(stack, i, k, v) for i, (k, v) in enumerate(cross)]

    def decode_step(self, tokens: Tensor, t: int | Tensor, cache: list[LayerCache],
                    cross_mask: Tensor) -> Tensor:
        """Logits [N, V] for the tokens [N] fed at position t (an int, or a 0-d tensor in a compiled
        step), given the cache of positions < t. Every cached position is a real token (decoding
        never emits pad_id)."""
        length = cache[0].self_k.shape[2]
        x = self.embed(self.tgt_table, tokens[:, None], offset=t, rows=length)
        self_mask = (torch.arange(length, device=x.device) <= t)[None, None, None, :]
        for layer, layer_cache in zip(self.decoder.layers, cache, strict=True):
            x = layer.step(x, layer_cache, t, self_mask, cross_mask)
        x = x if self.decoder.final_norm is None else self.decoder.final_norm(x)
        return self.generator(x, self.tgt_table)[:, 0]

    def forward(self, src: Tensor, tgt: Tensor, stages: Stages | None = None,
                fine: bool = False, packing: Packing | None = None, hidden: bool = False) -> Tensor:
        """Logits [B, T, V] for source ids [B, S] and decoder input ids [B, T]; `stages` receives
        the coarse stages, and with `fine` the sublayer outputs and attention weights too. Packed
        rows (several pairs per row) give `packing`, all four segment/position arrays (docs/packing.md).
        `hidden`: the decoder's output [B, T, d] instead, for the chunked loss (torch_impl/loss.py)."""
        stages = {} if stages is None else stages
        packing = packing if check_packing(src, tgt, packing) else None
        memory = self.encode(src, stages, fine, packing)
        out = self.decode(tgt, memory, src, stages, fine, packing)
        if hidden:
            return out
        logits = stages["logits"] = self.generator(out, self.tgt_table)
        return logits
