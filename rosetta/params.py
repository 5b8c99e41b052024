"""Canonical parameters: their names and shapes (the checkpoint contract) and the one seeded
initializer every backend starts from.

Dense kernels are in math layout `[in, out]` (`y = x @ kernel + bias`); PyTorch's
`nn.Linear.weight` is the transpose, and the torch converter is the one place that flips it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from rosetta.config import ModelConfig
from rosetta.errors import ConfigError

Params = dict[str, np.ndarray]


class EmbeddingNames(NamedTuple):
    """Which stored tensor plays each embedding role; `output` None means tied (`E^T`)."""

    src: str
    tgt: str
    output: str | None


def embedding_names(cfg: ModelConfig) -> EmbeddingNames:
    shared = cfg.share_embeddings in ("src_tgt", "all")
    src = "shared_embed.embedding" if shared else "src_embed.embedding"
    tgt = "shared_embed.embedding" if shared else "tgt_embed.embedding"
    output = None if cfg.share_embeddings in ("decoder", "all") else "generator.kernel"
    return EmbeddingNames(src, tgt, output)


def _attention_shapes(cfg: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    d = cfg.d_model
    shapes: dict[str, tuple[int, ...]] = {}
    for proj in ("q", "k", "v", "o"):
        shapes[f"{prefix}.{proj}.kernel"] = (d, d)
        if cfg.attention_bias:
            shapes[f"{prefix}.{proj}.bias"] = (d,)
    return shapes


def _norm_shapes(cfg: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}.scale": (cfg.d_model,), f"{prefix}.bias": (cfg.d_model,)}


def _ffn_shapes(cfg: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    d, f = cfg.d_model, cfg.d_ff
    shapes: dict[str, tuple[int, ...]] = {f"{prefix}.linear1.kernel": (d, f)}
    if cfg.ffn_bias:
        shapes[f"{prefix}.linear1.bias"] = (f,)
    shapes[f"{prefix}.linear2.kernel"] = (f, d)
    if cfg.ffn_bias:
        shapes[f"{prefix}.linear2.bias"] = (d,)
    return shapes


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint (SPEC §3), in one fixed order, with its shape."""
    d = cfg.d_model
    shapes: dict[str, tuple[int, ...]] = {}
    if cfg.share_embeddings in ("src_tgt", "all"):
        shapes["shared_embed.embedding"] = (cfg.src_vocab_size, d)
    else:
        shapes["src_embed.embedding"] = (cfg.src_vocab_size, d)
        shapes["tgt_embed.embedding"] = (cfg.tgt_vocab_size, d)
    if embedding_names(cfg).output is not None:
        shapes["generator.kernel"] = (d, cfg.tgt_vocab_size)
    if cfg.output_bias:
        shapes["generator.bias"] = (cfg.tgt_vocab_size,)
    for i in range(cfg.num_encoder_layers):
        p = f"encoder.layers.{i}"
        shapes |= _attention_shapes(cfg, f"{p}.self_attn") | _norm_shapes(cfg, f"{p}.self_attn_norm")
        shapes |= _ffn_shapes(cfg, f"{p}.ffn") | _norm_shapes(cfg, f"{p}.ffn_norm")
    if cfg.has_final_norm:
        shapes |= _norm_shapes(cfg, "encoder.final_norm")
    for i in range(cfg.num_decoder_layers):
        p = f"decoder.layers.{i}"
        shapes |= _attention_shapes(cfg, f"{p}.self_attn") | _norm_shapes(cfg, f"{p}.self_attn_norm")
        shapes |= _attention_shapes(cfg, f"{p}.cross_attn") | _norm_shapes(cfg, f"{p}.cross_attn_norm")
        shapes |= _ffn_shapes(cfg, f"{p}.ffn") | _norm_shapes(cfg, f"{p}.ffn_norm")
    if cfg.has_final_norm:
        shapes |= _norm_shapes(cfg, "decoder.final_norm")
    return shapes


@dataclass(frozen=True)
class Size:
    """How many tensors, and how many numbers in them."""

    tensors: int
    params: int

    def __add__(self, other: Size) -> Size:
        return Size(self.tensors + other.tensors, self.params + other.params)

    def __mul__(self, times: int) -> Size:
        return Size(self.tensors * times, self.params * times)


def checkpoint_size(cfg: ModelConfig) -> Size:
    """The size of `param_shapes(cfg)`, by arithmetic: constant time however large the config,
    so a file's header can be checked against it before any per-tensor work."""
    d, f, ab, fb = cfg.d_model, cfg.d_ff, int(cfg.attention_bias), int(cfg.ffn_bias)
    attention = Size(4 + 4 * ab, 4 * d * d + 4 * d * ab)
    norm = Size(2, 2 * d)
    ffn = Size(2 + 2 * fb, 2 * d * f + (f + d) * fb)
    encoder_layer = attention + norm + ffn + norm
    decoder_layer = attention * 2 + norm * 2 + ffn + norm
    total = encoder_layer * cfg.num_encoder_layers + decoder_layer * cfg.num_decoder_layers
    if cfg.has_final_norm:
        total = total + norm * 2
    names = embedding_names(cfg)
    for table in dict.fromkeys((names.src, names.tgt)):  # one table when shared
        vocab = cfg.tgt_vocab_size if table.startswith("tgt") else cfg.src_vocab_size
        total = total + Size(1, vocab * d)
    if names.output is not None:
        total = total + Size(1, d * cfg.tgt_vocab_size)
    if cfg.output_bias:
        total = total + Size(1, cfg.tgt_vocab_size)
    return total


def param_count(cfg: ModelConfig) -> int:
    return checkpoint_size(cfg).params


def canonical_dtype(compute_dtype: str) -> type:
    """The NumPy dtype of canonical params taken out of a framework that computes in
    `compute_dtype` (every converter's `dtype` argument: torch_impl/convert.py, jax_impl/convert.py,
    peer_impl/model.py, rosetta/interop/nn_transformer.py): float64 for float64 (the float64
    trainers of the equivalence tests, docs/testing.md), else float32, the checkpoint's dtype
    (bfloat16 and float16 computations keep float32 weights)."""
    return np.float64 if compute_dtype == "float64" else np.float32


def available_memory() -> int | None:
    """The bytes a new allocation can take here without swapping (Linux's MemAvailable), or None
    where /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_fits_in_memory(cfg: ModelConfig, dtype: type = np.float32) -> None:
    """Refuse (ConfigError) a model whose weights would not fit in the memory available, before any
    is allocated: each field has its bound (rosetta/config.py: LIMITS), but not their product, and an
    allocation past the memory is not a MemoryError under Linux's overcommit but the OOM killer."""
    count = param_count(cfg)
    need = count * np.dtype(dtype).itemsize
    available = available_memory()
    if available is not None and need > available:
        raise ConfigError(f"the model's {count:,} parameters need {need / 2**30:,.1f} GiB in "
                          f"{np.dtype(dtype).name}, more than the {available / 2**30:,.1f} GiB of memory "
                          "available here")


def init_params(cfg: ModelConfig, seed: int = 0, dtype: type = np.float32) -> Params:
    """The canonical initial weights (SPEC §4), drawn in `param_shapes` order from one seeded
    generator: dense kernels Xavier-uniform (Glorot & Bengio 2010), biases zero, LayerNorm
    scale one and bias zero, embeddings N(0, std = d_model^-0.5). A model larger than the memory
    available is refused first (check_fits_in_memory)."""
    check_fits_in_memory(cfg, dtype)
    rng = np.random.default_rng(seed)
    params: Params = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith(".embedding"):
            # std d_model^-0.5 keeps E[x]*sqrt(d_model) at unit scale (as fairseq does).
            value = rng.normal(0.0, cfg.d_model**-0.5, size=shape)
        elif name.endswith(".kernel"):
            fan_in, fan_out = shape
            limit = np.sqrt(6.0 / (fan_in + fan_out))
            value = rng.uniform(-limit, limit, size=shape)
        elif name.endswith(".scale"):
            value = np.ones(shape)
        else:  # every bias, LayerNorm or dense
            value = np.zeros(shape)
        params[name] = value.astype(dtype)
    return params
