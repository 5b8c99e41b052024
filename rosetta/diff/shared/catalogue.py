"""The catalogue of conventions and porting mistakes that `rosetta diff --diagnose` tries.

Each entry names one way two implementations of the same weights part (PITFALLS 1-12, and the
tutorial mistakes users bring us), the fix it implies, and how to build it from the correct
model: a config flip (run with the float64 reference), a weight transform (what the user's code
loaded instead of the checkpoint), or code-level switches of rosetta.diff.shared.variant. A convention
entry may name the *correct* side's convention: when the other side uses tensor2tensor's table
where we use the paper's, the explanation is `positional_encoding = sinusoidal_concat_t2t`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rosetta.config import ACTIVATIONS, POSITIONAL_ENCODINGS, ModelConfig
from rosetta.diff.shared.variant import Stages, Switches, forward_stages
from rosetta.errors import ConfigError
from rosetta.params import Params

ConfigFlip = Callable[[ModelConfig], dict[str, Any]]
WeightTransform = Callable[[ModelConfig, Params], Params]
Requirement = Callable[[ModelConfig, np.ndarray, np.ndarray], bool]


@dataclass(frozen=True)
class Entry:
    """One convention or mistake. `config` returns the fields to change (applicable only when
    that changes the config); `requires(cfg, src, tgt)` says whether the batch can show it."""

    name: str
    pitfall: int | None  # the PITFALLS number; None: a tutorial mistake outside PITFALLS
    wrong: str           # what goes wrong
    fix: str             # the fix it implies, as printed
    how: str             # "config", "weights" or "code"
    detect: str          # what the batch must hold for it to show (docs/diagnose.md)
    config: ConfigFlip | None = None
    weights: WeightTransform | None = None
    switches: Mapping[str, Any] = field(default_factory=dict)
    encoder: bool = True  # may change the encoder's stages (False: the encoder is reused)
    requires: Requirement | None = None

    def applies(self, cfg: ModelConfig, src: np.ndarray, tgt: np.ndarray) -> bool:
        if self.config is not None:
            try:
                if cfg.replace(**self.config(cfg)) == cfg:
                    return False
            except ConfigError:
                return False
        return self.requires is None or self.requires(cfg, src, tgt)


# -- Config flips and weight transforms ----------------------------------------------------

def _set(**changes: Any) -> ConfigFlip:
    return lambda cfg: dict(changes)


def _norm_placement(norm_first: bool) -> ConfigFlip:
    # Keep the final norms as they are: flipping placement alone (final_norm None follows it).
    return lambda cfg: ({} if cfg.norm_first == norm_first
                        else dict(norm_first=norm_first, final_norm=cfg.has_final_norm))


def _final_norm(present: bool) -> ConfigFlip:
    # Compared with the resolved value: final_norm None already means "as norm_first".
    return lambda cfg: {} if cfg.has_final_norm == present else dict(final_norm=present)


def _final_norms(cfg: ModelConfig, params: Params) -> Params:
    """Final norms the other side adds (torch.nn.Transformer always has them, PITFALLS 3): the
    checkpoint holds none, so they keep their initial identity weights."""
    out = dict(params)
    for stack in ("encoder", "decoder"):
        out.setdefault(f"{stack}.final_norm.scale", np.ones(cfg.d_model))
        out.setdefault(f"{stack}.final_norm.bias", np.zeros(cfg.d_model))
    return out


_TIED = {"none": "decoder", "src_tgt": "all"}  # the same embedding tables, output = E^T


def _attention_kernels(params: Params) -> Iterable[str]:
    return (name for name in params if ".self_attn." in name or ".cross_attn." in name)


def _transpose_kernels(cfg: ModelConfig, params: Params) -> Params:
    """[out, in] loaded where [in, out] was meant (PyTorch's Linear.weight read as a Flax kernel,
    PITFALLS 7). Only the square attention kernels load silently; FFN kernels fail on shape."""
    out = dict(params)
    for name in _attention_kernels(params):
        if name.endswith(".kernel"):
            out[name] = params[name].T
    return out


def _kqv_order(cfg: ModelConfig, params: Params) -> Params:
    """A packed in_proj [q; k; v] (nn.MultiheadAttention, PITFALLS 7) unpacked as [k; q; v]."""
    out = dict(params)
    for name in _attention_kernels(params):
        if ".q." in name:
            twin = name.replace(".q.", ".k.")
            out[name], out[twin] = params[twin], params[name]
    return out


def _scalar_norms(cfg: ModelConfig, params: Params) -> Params:
    """A LayerNorm with one scalar scale and bias (`nn.Parameter(torch.ones(1))`), loaded by
    averaging the checkpoint's per-feature vectors."""
    out = dict(params)
    for name, value in params.items():
        if name.endswith("norm.scale") or name.endswith("norm.bias"):
            out[name] = np.full_like(value, value.mean())
    return out


# -- Requirements: what the batch must hold ------------------------------------------------

def _lengths_differ(cfg: ModelConfig, src: np.ndarray, tgt: np.ndarray) -> bool:
    return src.shape[1] != tgt.shape[1]


def _start_is_pad(cfg: ModelConfig, src: np.ndarray, tgt: np.ndarray) -> bool:
    return bool((tgt[:, 0] == cfg.pad_id).any())


def _some_query_fully_masked(cfg: ModelConfig, src: np.ndarray, tgt: np.ndarray) -> bool:
    # Only a source row of nothing but padding leaves a query with no key in the contract model.
    return bool((src == cfg.pad_id).all(axis=1).any())


def _several_heads(cfg: ModelConfig, src: np.ndarray, tgt: np.ndarray) -> bool:
    return cfg.num_heads > 1 and cfg.d_head > 1


def _untied(cfg: ModelConfig, src: np.ndarray, tgt: np.ndarray) -> bool:
    return cfg.share_embeddings in _TIED


# -- The catalogue -------------------------------------------------------------------------

_POSITIONS = {
    "sinusoidal_interleaved": "interleaved sin/cos, the paper's frequencies (the paper)",
    "sinusoidal_concat": "all sines then all cosines, the paper's frequencies (HF Marian)",
    "sinusoidal_concat_t2t": "all sines then all cosines, tensor2tensor's frequencies "
                             "(Flax example, fairseq)",
}
_EPS = {"1e-5": 1e-5, "1e-6": 1e-6, "1e-12": 1e-12}
_ACTIVATIONS = {"relu": "ReLU", "gelu": "exact (erf) GELU", "gelu_tanh": "tanh-approximated GELU",
                "silu": "SiLU"}
assert set(_POSITIONS) == set(POSITIONAL_ENCODINGS) and set(_ACTIVATIONS) == set(ACTIVATIONS)

CATALOGUE: tuple[Entry, ...] = (
    *(Entry(f"positions_{kind.removeprefix('sinusoidal_')}", 1,
            f"the other side's positional table is {text}",
            f"positional_encoding = {kind}", "config",
            "any batch", config=_set(positional_encoding=kind))
      for kind, text in _POSITIONS.items()),
    Entry("positions_from_one", 1, "positions counted from 1, not 0 (an offset of one row)",
          "count positions from 0: the first token takes row 0 of the table", "code",
          "any batch", switches=dict(position_offset=1)),
    Entry("positions_2i_loop", None,
          "a positional loop stepping i by two that also writes 2i in the exponent: every "
          "frequency is squared away (10000^(4k/d) instead of 10000^(2k/d))",
          "use 10000 ** (i / d) for columns i and i+1 when i already steps by 2", "code",
          "any batch", switches=dict(positions_2i=True)),
    *(Entry(f"layer_norm_eps_{text}", 2, f"the other side's LayerNorm epsilon is {text}",
            f"layer_norm_eps = {text}", "config",
            "LayerNorm inputs with a variance near the epsilons (small activations)",
            config=_set(layer_norm_eps=eps))
      for text, eps in _EPS.items()),
    Entry("layer_norm_fast_variance", 2,
          "LayerNorm variance as E[x²] - E[x]² (Flax use_fast_variance): cancellation when the "
          "mean is large against the spread",
          "compute the variance as E[(x - E[x])²] (Flax: use_fast_variance=False)", "code",
          "LayerNorm inputs whose mean is ~1e5 times their spread (float64)",
          switches=dict(layer_norm="fast_variance")),
    Entry("layer_norm_unbiased_std", 2,
          "LayerNorm as (x - mean) / (std + eps) with the unbiased std (the Annotated "
          "Transformer)",
          "divide by sqrt(biased variance + eps)", "code", "any batch",
          switches=dict(layer_norm="unbiased_std")),
    Entry("layer_norm_scalar", None,
          "a LayerNorm with one scalar scale and bias, loaded as the mean of the checkpoint's "
          "vectors", "give LayerNorm a scale and a bias per feature ([d_model])", "weights",
          "LayerNorm weights that are not constant", weights=_scalar_norms),
    Entry("pre_norm", 3, "the other side normalises before each sublayer (pre-norm)",
          "norm_first = true", "config", "any batch", config=_norm_placement(True)),
    Entry("post_norm", 3, "the other side normalises after each residual add (post-norm)",
          "norm_first = false", "config", "any batch", config=_norm_placement(False)),
    Entry("final_norm_added", 3,
          "the other side adds a final LayerNorm to each stack (torch.nn.Transformer), left at "
          "its initial identity weights", "final_norm = true (or drop the extra final norms)",
          "config", "any batch", config=_final_norm(True), weights=_final_norms),
    Entry("final_norm_missing", 3, "the other side has no final LayerNorm (Marian)",
          "final_norm = false", "config", "any batch", config=_final_norm(False)),
    *(Entry(f"activation_{name}", 6, f"the other side's feed-forward activation is {text}",
            f"activation = {name}", "config", "any batch", config=_set(activation=name))
      for name, text in _ACTIVATIONS.items()),
    Entry("embeddings_scaled", 8, "the other side multiplies the embeddings by sqrt(d_model)",
          "scale_embeddings = true", "config", "any batch", config=_set(scale_embeddings=True)),
    Entry("embeddings_unscaled", 8, "the other side does not multiply the embeddings by "
          "sqrt(d_model)", "scale_embeddings = false", "config", "any batch",
          config=_set(scale_embeddings=False)),
    Entry("logits_over_sqrt_d", 8,
          "logits divided by sqrt(d_model) (Flax's logits_via_embedding)",
          "logit_scale = 1/sqrt(d_model) on our side (Flax's logits_via_embedding; divided once more "
          "if ours already has it)", "config", "any batch",
          config=lambda cfg: dict(logit_scale=cfg.logit_scale / math.sqrt(cfg.d_model)), encoder=False),
    Entry("output_tied", 8,
          "the output layer reuses the target embedding (E^T) instead of the checkpoint's "
          "separate generator.kernel", "load generator.kernel as the output layer (untie it)",
          "config", "an untied config", config=lambda cfg: dict(
              share_embeddings=_TIED.get(cfg.share_embeddings, cfg.share_embeddings)),
          weights=lambda cfg, p: {k: v for k, v in p.items() if k != "generator.kernel"},
          encoder=False, requires=_untied),
    Entry("mask_inverted", 4,
          "padding mask polarity inverted: queries attend exactly to the padding (True = "
          "masked read as True = attend)",
          "invert the padding mask (nn.MultiheadAttention: True = masked; SDPA and Flax: "
          "True = attend)", "code", "padded rows", switches=dict(mask_inverted=True)),
    Entry("start_token_masked", 12,
          "the start token equals pad and a padding mask built naively from the ids hides it",
          "never mask decoder position 0 (the start token) even when bos == pad", "code",
          "a start token equal to pad_id", switches=dict(naive_start_mask=True), encoder=False,
          requires=_start_is_pad),
    Entry("mask_fill_neg_inf", 4,
          "masked scores filled with -inf: a query whose keys are all masked gets NaN",
          "fill masked scores with the most negative finite value", "code",
          "a source row of nothing but padding", switches=dict(fill="neg_inf"),
          requires=_some_query_fully_masked),
    Entry("masked_rows_zero", 4,
          "a query whose keys are all masked gets zero weights (a NaN-to-zero fast path)",
          "give a query with every key masked uniform weights (finite fill)", "code",
          "a source row of nothing but padding", switches=dict(fill="zero"),
          requires=_some_query_fully_masked),
    Entry("no_causal_mask", 4, "the decoder's self-attention has no causal mask",
          "add the causal (lower-triangular) mask to decoder self-attention", "code",
          "any target longer than one token", switches=dict(causal=False), encoder=False),
    Entry("heads_interleaved", 7,
          "heads split from interleaved columns (head j: columns j, j+h, ...) instead of "
          "contiguous blocks", "split heads with reshape(B, T, h, d_head): head j owns columns "
          "j*d_head ... (j+1)*d_head - 1", "code", "more than one head of more than one column",
          switches=dict(heads="interleaved"), requires=_several_heads),
    Entry("kernels_transposed", 7,
          "attention kernels loaded as W where W^T was meant ([out, in] read as [in, out])",
          "transpose the attention kernels when converting (PyTorch [out, in], Flax [in, out])",
          "weights", "any batch", weights=_transpose_kernels),
    Entry("qkv_order_kqv", 7, "a packed q/k/v projection unpacked in the order k, q, v",
          "unpack in_proj as q, k, v (in that order)", "weights", "any batch",
          weights=_kqv_order),
    Entry("kv_query_length", None,
          "cross-attention keys and values sized with the query's length T instead of the "
          "source length S", "reshape keys and values with the source length", "code",
          "source and target lengths that differ", switches=dict(kv_query_length=True),
          encoder=False, requires=_lengths_differ),
    Entry("logits_log_softmax", None,
          "the dumped 'logits' are log-probabilities (a log_softmax before a loss that applies "
          "its own)", "return raw logits; apply log_softmax in one place only", "code",
          "any batch", switches=dict(log_softmax_logits=True), encoder=False),
)

BY_NAME: dict[str, Entry] = {entry.name: entry for entry in CATALOGUE}
assert len(BY_NAME) == len(CATALOGUE), "catalogue names must be unique"


# -- Building the mistaken model -----------------------------------------------------------

def entries(names: str | Iterable[str]) -> tuple[Entry, ...]:
    """The entries named; an unknown name is a ConfigError listing the known ones."""
    names = (names,) if isinstance(names, str) else tuple(names)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise ConfigError(f"unknown catalogue entr{'y' if len(unknown) == 1 else 'ies'} "
                          f"{', '.join(map(repr, unknown))}; known: {', '.join(BY_NAME)}")
    if not names:
        raise ConfigError("no catalogue entry named")
    return tuple(BY_NAME[n] for n in names)


def build(chosen: Iterable[Entry], cfg: ModelConfig, params: Params) -> tuple[ModelConfig, Params, Switches]:
    """The config, weights and switches of the correct model with every chosen entry applied
    (in order). Two entries that set the same switch differently are a ConfigError."""
    switches: dict[str, Any] = {}
    for entry in chosen:
        if entry.config is not None:
            cfg = cfg.replace(**entry.config(cfg))
        if entry.weights is not None:
            params = entry.weights(cfg, params)
        for key, value in entry.switches.items():
            if switches.get(key, value) != value:
                raise ConfigError(f"catalogue entry {entry.name!r} sets {key} differently from "
                                  f"an earlier entry")
            switches[key] = value
    return cfg, params, Switches(**switches)


def as_float64(params: Mapping[str, np.ndarray]) -> Params:
    return {k: np.asarray(v, dtype=np.float64) for k, v in params.items()}


def mistaken_stages(
    names: str | Iterable[str], cfg: ModelConfig, params: Mapping[str, np.ndarray],
    src: np.ndarray, tgt: np.ndarray, fine: bool = False,
) -> Stages:
    """The float64 stages of the correct model (cfg, params) with the named entries applied
    together: what a port that made those mistakes would dump."""
    cfg2, params2, switches = build(entries(names), cfg, as_float64(params))
    return forward_stages(params2, cfg2, np.asarray(src), np.asarray(tgt), switches, fine)
