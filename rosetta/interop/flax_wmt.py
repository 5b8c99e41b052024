"""Flax's `examples/wmt` Transformer (google/flax, examples/wmt/models.py) <-> the canonical checkpoint.

The file is a params tree written by `flax.serialization.msgpack_serialize` (or `to_bytes`), with or
without a top-level `{"params": ...}` wrapper (a legacy msgpack TrainState checkpoint, whose `step` and
`opt_state` are ignored, reads too). NumPy and msgpack do the work: neither jax nor flax is imported,
and the msgpack codec (flax_msgpack.py) is byte-compatible with flax.serialization's both ways.

Conventions of examples/wmt/models.py (and train.py, decode.py, configs/default.py), all checked there:

- pre-norm blocks, `x + Sublayer(LN(x))`, and a final LayerNorm on both stacks (`encoder_norm`,
  `encoderdecoder_norm`): our `norm_first = final_norm = true` (PITFALLS 3);
- `nn.LayerNorm()` defaults: epsilon 1e-6 (PITFALLS 2), population variance (computed as
  E[x^2] - E[x]^2, `use_fast_variance`: the same number up to float rounding);
- `nn.MultiHeadDotProductAttention(use_bias=False, qkv_features=qkv_dim)`: head-shaped kernels
  `query/key/value` [d, heads, d_head] and `out` [heads, d_head, d], no biases (PITFALLS 7); the
  example's `qkv_dim` must equal `emb_dim` here (our q/k/v projections are d -> d);
- `MlpBlock`: `Dense_0` (kernel + bias), relu, `Dense_1` (kernel + bias);
- fixed sinusoidal positions (`sinusoidal_init`: sines then cosines, frequencies
  `exp(-i ln(10000) / (d/2 - 1))` = tensor2tensor's), not stored: our `sinusoidal_concat_t2t`
  (PITFALLS 1); a learned table (`posemb_init`, a `pos_embedding` param) is refused;
- token embeddings are NOT scaled by sqrt(d); `logits_via_embedding` gives
  `logits = y E^T / sqrt(d)` (`logits / jnp.sqrt(y.shape[-1])`): our `logit_scale = 1/sqrt(d)`;
  otherwise a `logitdense` with kernel and bias (PITFALLS 8);
- masks are `ids > 0` and `shift_right` feeds token 0 as the decoder start: our `pad_id = bos_id = 0`
  (PITFALLS 12); decode.py stops at `EOS_ID = 2` (SentencePiece's default), our default `eos_id`.
  The example builds its decoder self-attention mask from the targets (labels), ours from the
  decoder input (start token, then the shifted labels): the two agree at every position whose label
  is real (`targets > 0`, the positions its loss weighs); padded positions are in neither contract;
- (`share_embeddings`, `logits_via_embedding`) give our `share_embeddings`: (true, true) `all`,
  (true, false) `src_tgt`, (false, true) `decoder`, (false, false) `none`; one `num_layers` for
  both stacks; `max_len` = train.py's max(max_target_length, max_eval_target_length)
  = 256 with configs/default.py.

The tree-path ↔ canonical-name table, and how the √d of embeddings and logits moves between the
two conventions (bit for bit where it can, one rounding in float64 where a factor is applied), are
in docs/real-models.md ("Flax `examples/wmt`"); `table` below is that table in code.

Writing refuses what the example cannot hold, before anything is written, naming the field:
post-norm (`norm_first`), no final norm (`final_norm`), `layer_norm_eps` != 1e-6, a positional
table other than `sinusoidal_concat_t2t`, an activation other than relu, unequal stack depths,
`pad_id` != 0, `bos_id` != 0 (the example's start token is 0), d_model = 2 (the example's table
divides by d/2 - 1), nonzero attention biases or a nonzero tied output bias. Dropout rates, `max_len`
and `eos_id` are not stored in the tree (train.py and decode.py set them).

    cfg, params = read_flax_wmt("params.msgpack")            # the example's conventions
    write_flax_wmt("params.msgpack", cfg, params)            # {"params": tree}: model.apply(tree, ...)
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from rosetta.checkpoint import check_params
from rosetta.config import ModelConfig
from rosetta.errors import CheckpointError, ConfigError
from rosetta.files import atomic_write_bytes
from rosetta.interop.flax_msgpack import DTYPES, FLOAT_DTYPES, Lazy, Opaque, encode_tree, read_structure
from rosetta.params import Params, embedding_names, param_shapes

LAYER_NORM_EPS = 1e-6  # flax.linen.LayerNorm's default epsilon
POSITIONAL = "sinusoidal_concat_t2t"  # models.sinusoidal_init: [sin | cos], tensor2tensor frequencies
DEFAULT_MAX_LEN = 256  # train.py: max(max_target_length, max_eval_target_length) with configs/default.py
EOS_ID = 2  # decode.EOS_ID, SentencePiece's default
# The top level of a file may be the params tree, variables {"params": ...}, or train.py's TrainState
# as flax.serialization writes it (its pytree fields).
TRAIN_STATE = ("step", "params", "opt_state", "dynamic_scale")
# (share_embeddings, logits_via_embedding) of TransformerConfig <-> our share_embeddings
SHARING = {(True, True): "all", (True, False): "src_tgt", (False, True): "decoder", (False, False): "none"}

# Read overrides: fields the tree does not say (free), and fields the example's code fixes (only
# their fixed value is accepted). Everything else is read from the tree's shapes.
FREE_FIELDS = ("max_len", "dropout", "activation_dropout", "attention_dropout", "eos_id",
               "scale_embeddings", "attention_bias", "ffn_bias", "output_bias")
FIXED_FIELDS: dict[str, tuple[Any, str]] = {
    "norm_first": (True, "the example's blocks are pre-norm"),
    "final_norm": (True, "the example has encoder_norm and encoderdecoder_norm"),
    "layer_norm_eps": (LAYER_NORM_EPS, "the example uses nn.LayerNorm's default epsilon 1e-6"),
    "positional_encoding": (POSITIONAL, "the example adds models.sinusoidal_init's table"),
    "position_offset": (0, "the example's first token reads row 0 of its table"),
    "activation": ("relu", "the example's MlpBlock applies nn.relu"),
    "pad_id": (0, "the example's masks are `ids > 0`"),
    "bos_id": (0, "the example's shift_right and beam search start the decoder with token 0"),
}


# -- the mapping table ---------------------------------------------------------------------------

class Row(NamedTuple):
    path: str  # flax tree path under `params`, "/"-separated
    name: str  # canonical name (may be absent from param_shapes(cfg): an absent bias, read as zeros)
    flax_shape: tuple[int, ...]
    shape: tuple[int, ...]  # canonical shape; the transform is the C-order reshape between the two


def _attention_rows(cfg: ModelConfig, path: str, name: str) -> list[Row]:
    d, h, dh = cfg.d_model, cfg.num_heads, cfg.d_head
    rows = [Row(f"{path}/{proj}/kernel", f"{name}.{ours}.kernel", (d, h, dh), (d, d))
            for proj, ours in (("query", "q"), ("key", "k"), ("value", "v"))]
    return rows + [Row(f"{path}/out/kernel", f"{name}.o.kernel", (h, dh, d), (d, d))]


def _norm_rows(cfg: ModelConfig, path: str, name: str) -> list[Row]:
    return [Row(f"{path}/{p}", f"{name}.{p}", (cfg.d_model,), (cfg.d_model,)) for p in ("scale", "bias")]


def _mlp_rows(cfg: ModelConfig, path: str, name: str) -> list[Row]:
    d, f = cfg.d_model, cfg.d_ff
    return [Row(f"{path}/Dense_0/kernel", f"{name}.linear1.kernel", (d, f), (d, f)),
            Row(f"{path}/Dense_0/bias", f"{name}.linear1.bias", (f,), (f,)),
            Row(f"{path}/Dense_1/kernel", f"{name}.linear2.kernel", (f, d), (f, d)),
            Row(f"{path}/Dense_1/bias", f"{name}.linear2.bias", (d,), (d,))]


def table(cfg: ModelConfig) -> list[Row]:
    """Every tensor of the example's tree for `cfg`, in tree order, with its canonical name."""
    d, names = cfg.d_model, embedding_names(cfg)
    rows: list[Row] = []
    if cfg.share_embeddings in ("src_tgt", "all"):
        rows.append(Row("shared_embedding/embedding", names.src, (cfg.src_vocab_size, d),
                        (cfg.src_vocab_size, d)))
    else:
        for side, name, vocab in (("encoder", names.src, cfg.src_vocab_size),
                                  ("decoder", names.tgt, cfg.tgt_vocab_size)):
            rows.append(Row(f"{side}/Embed_0/embedding", name, (vocab, d), (vocab, d)))
    for i in range(cfg.num_encoder_layers):
        p, n = f"encoder/encoderblock_{i}", f"encoder.layers.{i}"
        rows += _norm_rows(cfg, f"{p}/LayerNorm_0", f"{n}.self_attn_norm")
        rows += _attention_rows(cfg, f"{p}/MultiHeadDotProductAttention_0", f"{n}.self_attn")
        rows += _norm_rows(cfg, f"{p}/LayerNorm_1", f"{n}.ffn_norm")
        rows += _mlp_rows(cfg, f"{p}/MlpBlock_0", f"{n}.ffn")
    rows += _norm_rows(cfg, "encoder/encoder_norm", "encoder.final_norm")
    for i in range(cfg.num_decoder_layers):
        p, n = f"decoder/encoderdecoderblock_{i}", f"decoder.layers.{i}"
        rows += _norm_rows(cfg, f"{p}/LayerNorm_0", f"{n}.self_attn_norm")
        rows += _attention_rows(cfg, f"{p}/MultiHeadDotProductAttention_0", f"{n}.self_attn")
        rows += _norm_rows(cfg, f"{p}/LayerNorm_1", f"{n}.cross_attn_norm")
        rows += _attention_rows(cfg, f"{p}/MultiHeadDotProductAttention_1", f"{n}.cross_attn")
        rows += _norm_rows(cfg, f"{p}/LayerNorm_2", f"{n}.ffn_norm")
        rows += _mlp_rows(cfg, f"{p}/MlpBlock_0", f"{n}.ffn")
    rows += _norm_rows(cfg, "decoder/encoderdecoder_norm", "decoder.final_norm")
    if names.output is not None:  # no logits_via_embedding: logitdense, always with a bias
        v = cfg.tgt_vocab_size
        rows += [Row("decoder/logitdense/kernel", "generator.kernel", (d, v), (d, v)),
                 Row("decoder/logitdense/bias", "generator.bias", (v,), (v,))]
    return rows


def _all_finite(value: np.ndarray) -> bool:
    with np.errstate(all="ignore"):  # a signalling NaN would warn on a cast; isfinite does not cast
        return bool(np.all(np.isfinite(value)))


def _any_nonzero(value: np.ndarray) -> bool:
    with np.errstate(all="ignore"):
        return bool(np.any(value != 0))


def flax_logit_scale(d_model: int) -> float:
    """Our logit_scale for the example's `logits_via_embedding`: models.py computes
    `logits / jnp.sqrt(y.shape[-1])` (float32); we multiply by 1/sqrt(d) (float64, rounded once to
    the compute dtype): the same logits to within one float32 rounding (footnote 3)."""
    return 1.0 / math.sqrt(d_model)


def _factor(cfg: ModelConfig, name: str) -> float:
    """The example's tensor `name` is ours times this (footnotes 1 and 3); 1.0: moved bit for bit."""
    d = cfg.d_model
    if name.endswith(".embedding"):
        return math.sqrt(d) if cfg.scale_embeddings else 1.0
    if not name.startswith("decoder.final_norm."):
        return 1.0
    # The decoder's final norm feeds only the logits: LN(h; g, b) W scaled by c is LN(h; c g, c b) W.
    tied, s = embedding_names(cfg).output is None, cfg.logit_scale
    if tied and not cfg.scale_embeddings:  # ours s y E^T, the example's y E^T / sqrt(d)
        return 1.0 if s == flax_logit_scale(d) else s * math.sqrt(d)
    return s  # scaled tables already carry the 1/sqrt(d); logitdense is y K + b, ours s (y K) + b


def _rescale(value: np.ndarray, factor: float, up: bool, dtype: np.dtype | None = None) -> np.ndarray:
    """value * factor (up) or value / factor, in float64, rounded once to `dtype` (value's)."""
    wide = value.astype(np.float64)
    return (wide * factor if up else wide / factor).astype(dtype or value.dtype)


def _ours_only(cfg: ModelConfig) -> list[str]:
    """Canonical tensors the example has no place for: they are written only when exactly zero."""
    names = [n for n in param_shapes(cfg) if re.fullmatch(r".*_attn\.[qkvo]\.bias", n)]
    if embedding_names(cfg).output is None and cfg.output_bias:
        names.append("generator.bias")
    return names


# -- writing ---------------------------------------------------------------------------------

def check_representable(cfg: ModelConfig) -> None:
    """ConfigError naming every field the example's Transformer cannot express."""
    problems = []
    for name, (value, why) in FIXED_FIELDS.items():
        have = cfg.has_final_norm if name == "final_norm" else getattr(cfg, name)
        if have != value:
            problems.append(f"{name}={have!r} (must be {value!r}: {why})")
    if cfg.num_encoder_layers != cfg.num_decoder_layers:
        problems.append(f"num_encoder_layers={cfg.num_encoder_layers} != num_decoder_layers="
                        f"{cfg.num_decoder_layers} (the example has one num_layers)")
    if cfg.d_model < 4:
        problems.append(f"d_model={cfg.d_model} (the example's sinusoidal_init divides by d/2 - 1 = 0)")
    if problems:
        raise ConfigError("cannot write as Flax WMT: " + "; ".join(problems))


def params_to_flax_wmt(cfg: ModelConfig, params: Mapping[str, np.ndarray], dtype: str | None = None
                       ) -> dict[str, Any]:
    """The example's params tree (nested dicts of NumPy arrays, no "params" wrapper) for `cfg`.
    Refuses (ConfigError / CheckpointError) before building anything it cannot represent exactly."""
    check_representable(cfg)
    check_params(cfg, params)
    arrays = {name: np.asarray(params[name]) for name in param_shapes(cfg)}
    if dtype is None:
        found = {a.dtype for a in arrays.values()}
        if len(found) != 1:
            raise CheckpointError(f"params mix dtypes ({', '.join(sorted(t.name for t in found))}); "
                                  f"pass dtype= to choose the file's")
        dtype = found.pop().name
    if dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"dtype must be one of {', '.join(FLOAT_DTYPES)}, got {dtype!r}")
    for name, value in arrays.items():
        if value.dtype.name not in FLOAT_DTYPES:
            raise CheckpointError(f"tensor {name} has dtype {value.dtype}, not a floating type")
        if not _all_finite(value):
            raise CheckpointError(f"refusing to write: tensor {name} holds NaN or infinity")
    nonzero = [name for name in _ours_only(cfg) if _any_nonzero(arrays[name])]
    if nonzero:
        field = "output_bias" if nonzero == ["generator.bias"] else "attention_bias"
        raise ConfigError(
            f"cannot write as Flax WMT: {field}=True with nonzero values in {', '.join(nonzero[:4])}"
            f"{' ...' if len(nonzero) > 4 else ''}: the example's attention has no biases (use_bias=False) "
            f"and its logits_via_embedding no output bias; only exactly-zero biases can be dropped")
    target = DTYPES[dtype]
    tree: dict[str, Any] = {}
    for row in table(cfg):
        if row.name in arrays:
            value = arrays[row.name]
            factor = _factor(cfg, row.name)  # footnotes 1 and 3: one rounding, to the file's dtype
            with np.errstate(over="ignore"):  # an overflow is refused just below, by name
                value = _rescale(value, factor, True, target) if factor != 1.0 else value.astype(target)
            if not _all_finite(value):
                times = f" x {factor:.6g}" if factor != 1.0 else ""
                raise CheckpointError(f"refusing to write: {row.name}{times} overflows {dtype}")
            value = np.ascontiguousarray(value.reshape(row.flax_shape))
        else:  # ffn_bias / output_bias false: the example's bias, exactly zero (footnote 2)
            value = np.zeros(row.flax_shape, target)
        node = tree
        *parents, leaf = row.path.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return tree


def write_flax_wmt(path: str | os.PathLike, cfg: ModelConfig, params: Mapping[str, np.ndarray],
                   dtype: str | None = None) -> Path:
    """Write `{"params": tree}` as flax.serialization.msgpack_serialize does, atomically; the
    result is the `variables` of `models.Transformer(config).apply`. `dtype` None keeps the params'
    dtype. Nothing is written if the model cannot be represented exactly."""
    tree = params_to_flax_wmt(cfg, params, dtype)
    data = encode_tree({"params": tree})
    path = Path(path)
    atomic_write_bytes(path, data)
    return path


# -- reading ---------------------------------------------------------------------------------

def _flatten(tree: Any, prefix: str, out: dict[str, Any], source: str) -> None:
    for key, value in tree.items():
        if not isinstance(key, str):
            raise CheckpointError(f"{source}: key {key!r:.40} under '{prefix or '/'}' is not a string")
        path = f"{prefix}/{key}" if prefix else key
        if isinstance(value, dict):
            _flatten(value, path, out, source)
        else:
            out[path] = value


def _depth(flat: Mapping[str, Any], pattern: str) -> int:
    n = 0
    while any(p.startswith(pattern.format(n) + "/") for p in flat):
        n += 1
    return n


def _shape_of(flat: Mapping[str, Any], path: str, ndim: int, source: str) -> tuple[int, ...]:
    if path not in flat:
        raise CheckpointError(f"{source}: missing tensor {path} (not the example's Transformer tree?)")
    value = flat[path]
    if not isinstance(value, (np.ndarray, Lazy)) or value.ndim != ndim:
        what = f"shape {value.shape}" if isinstance(value, (np.ndarray, Lazy)) else type(value).__name__
        raise CheckpointError(f"{source}: tensor {path} is {what}, expected a {ndim}-D array")
    return value.shape


def _hint(path: str) -> str:
    if path.endswith("pos_embedding"):
        return (" (a learned positional table, TransformerConfig.posemb_init: our positional_encoding has "
                "only fixed sinusoidal tables)")
    if re.search(r"MultiHeadDotProductAttention_\d+/(query|key|value|out)/bias$", path):
        return " (attention biases: the example's attention has none, use_bias=False)"
    return ""


def config_from_tree(flat: Mapping[str, Any], source: str = "tree", **overrides: Any) -> ModelConfig:
    """Our config for a flattened params tree: sizes from its shapes, the rest from the example's
    conventions and `overrides` (FREE_FIELDS freely; FIXED_FIELDS only at their fixed value)."""
    shared = "shared_embedding/embedding" in flat
    tied = "decoder/logitdense/kernel" not in flat  # logits_via_embedding
    if shared:
        src_vocab, d = _shape_of(flat, "shared_embedding/embedding", 2, source)
        tgt_vocab = src_vocab
    else:
        src_vocab, d = _shape_of(flat, "encoder/Embed_0/embedding", 2, source)
        tgt_vocab = _shape_of(flat, "decoder/Embed_0/embedding", 2, source)[0]
    enc, dec = _depth(flat, "encoder/encoderblock_{}"), _depth(flat, "decoder/encoderdecoderblock_{}")
    if enc == 0 or dec == 0:
        raise CheckpointError(f"{source}: no encoder/encoderblock_0 or decoder/encoderdecoderblock_0: "
                              f"not the example's Transformer tree")
    _, heads, d_head = _shape_of(flat, "encoder/encoderblock_0/MultiHeadDotProductAttention_0/query/kernel",
                                 3, source)
    if heads * d_head != d:
        raise ConfigError(f"{source}: qkv_dim = num_heads x head_dim = {heads} x {d_head} = {heads * d_head} "
                          f"differs from emb_dim {d}; our attention projects d_model -> d_model, so qkv_dim "
                          f"must equal emb_dim")
    d_ff = _shape_of(flat, "encoder/encoderblock_0/MlpBlock_0/Dense_0/kernel", 2, source)[1]
    from_tree = dict(src_vocab_size=src_vocab, tgt_vocab_size=tgt_vocab, d_model=d, num_heads=heads,
                     num_encoder_layers=enc, num_decoder_layers=dec, d_ff=d_ff,
                     share_embeddings=SHARING[(shared, tied)])
    fields: dict[str, Any] = {
        **from_tree, **{k: v for k, (v, _) in FIXED_FIELDS.items()},
        "max_len": DEFAULT_MAX_LEN, "dropout": 0.1, "attention_dropout": 0.1, "eos_id": EOS_ID,
        "scale_embeddings": False, "attention_bias": False, "ffn_bias": True, "output_bias": not tied,
    }
    for key, value in overrides.items():
        if key in FREE_FIELDS:
            fields[key] = value
        elif key in FIXED_FIELDS and value != FIXED_FIELDS[key][0]:
            raise ConfigError(f"{key}={value!r} cannot be read from a Flax WMT tree: must be "
                              f"{FIXED_FIELDS[key][0]!r} ({FIXED_FIELDS[key][1]})")
        elif key in from_tree and value != from_tree[key]:
            raise ConfigError(f"{key}={value!r} contradicts the tree, which says {from_tree[key]!r}")
        elif key not in FIXED_FIELDS and key not in from_tree:
            raise ConfigError(f"unknown or unsupported override {key!r}; give any of "
                              f"{', '.join(FREE_FIELDS)}")
    if fields["d_model"] < 4:
        raise ConfigError(f"{source}: emb_dim {d}: the example's sinusoidal_init divides by d/2 - 1 = 0")
    if tied and not fields["scale_embeddings"]:  # footnote 3: the weights are copied, not rescaled
        fields["logit_scale"] = flax_logit_scale(d)
    return ModelConfig.from_dict(fields)


def params_from_tree(cfg: ModelConfig, flat: Mapping[str, Any], source: str = "tree") -> Params:
    """Canonical params (the tree's dtype, canonical order) from a flattened params tree."""
    rows = table(cfg)
    expected = {row.path: row for row in rows}
    missing = [row.path for row in rows if row.path not in flat]
    if missing:
        more = f" and {len(missing) - 6} more" if len(missing) > 6 else ""
        raise CheckpointError(f"{source}: missing tensor(s) {', '.join(missing[:6])}{more}")
    extra = [path for path in flat if path not in expected]
    if extra:
        more = f" and {len(extra) - 6} more" if len(extra) > 6 else ""
        raise CheckpointError(f"{source}: tensor(s) with no place in the example's Transformer: "
                              f"{', '.join(extra[:6])}{more}{_hint(extra[0])}")
    dtypes: dict[str, str] = {}
    for row in rows:
        value = flat[row.path]
        if not isinstance(value, (np.ndarray, Lazy)):
            what = value.what if isinstance(value, Opaque) else type(value).__name__
            raise CheckpointError(f"{source}: {row.path} is {what}, not an array")
        if value.dtype.name not in FLOAT_DTYPES:
            raise CheckpointError(f"{source}: tensor {row.path} has dtype {value.dtype.name}; parameters "
                                  f"must be one of {', '.join(FLOAT_DTYPES)}")
        if value.shape != row.flax_shape:
            raise CheckpointError(f"{source}: tensor {row.path} has shape {value.shape}, expected "
                                  f"{row.flax_shape} (for {row.name})")
        dtypes.setdefault(value.dtype.name, row.path)
    if len(dtypes) > 1:
        mixed = ", ".join(f"{p} is {t}" for t, p in dtypes.items())
        raise CheckpointError(f"{source}: tensors mix dtypes: {mixed}")
    ours = param_shapes(cfg)
    params: Params = {}
    for row in rows:  # every check above read headers only; now the data, one tensor at a time
        value = flat[row.path]
        value = value.load(source) if isinstance(value, Lazy) else value
        if not _all_finite(value):
            raise CheckpointError(f"{source}: tensor {row.path} holds NaN or infinity")
        if row.name not in ours:  # a bias our config leaves out: only an exactly-zero one (footnote 2)
            if _any_nonzero(value):
                field = "output_bias" if row.name == "generator.bias" else "ffn_bias"
                raise ConfigError(f"{field}=False, but {row.path} is not all zeros: dropping it would "
                                  f"change the model")
            continue
        value = value.reshape(row.shape)
        factor = _factor(cfg, row.name)  # 1.0 but for the tables read with scale_embeddings=True
        params[row.name] = _rescale(value, factor, up=False) if factor != 1.0 else value.copy()
    dtype = flat[rows[0].path].dtype
    for name in _ours_only(cfg):  # attention_bias / tied output_bias asked for: exact zeros
        params[name] = np.zeros(ours[name], dtype)
    check_params(cfg, params, source=source)
    return {name: params[name] for name in ours}


def unwrap(tree: Any, source: str = "tree") -> dict[str, Any]:
    """The params tree inside `tree`: itself, `tree["params"]` (variables), or a TrainState's params.
    Any other top-level entry is refused by name (its data unread)."""
    if not isinstance(tree, dict):
        raise CheckpointError(f"{source}: the msgpack holds a {type(tree).__name__}, not a params tree")
    if "params" in tree and "encoder" not in tree:
        unknown = [key for key in tree if key not in TRAIN_STATE]
        if unknown:
            raise CheckpointError(f"{source}: top-level entr{'y' if len(unknown) == 1 else 'ies'} "
                                  f"{', '.join(repr(k)[:60] for k in unknown[:6])} beside 'params': neither "
                                  f"variables ({{'params': ...}}) nor the example's TrainState "
                                  f"({', '.join(TRAIN_STATE)})")
        tree = tree["params"]
        if not isinstance(tree, dict):
            raise CheckpointError(f"{source}: 'params' holds a {type(tree).__name__}, not a params tree")
    return tree


def read_flax_wmt(path: str | os.PathLike, **overrides: Any) -> tuple[ModelConfig, Params]:
    """Config and canonical params of a Flax WMT msgpack file. `overrides` give what the tree does
    not store (FREE_FIELDS: max_len, dropout rates, eos_id, scale_embeddings and the bias flags of
    the footnotes); defaults are the example's (max_len 256, dropout 0.1, attention_dropout 0.1,
    eos_id 2, unscaled embeddings)."""
    path = Path(path)
    source = str(path)
    if not path.is_file():
        raise CheckpointError(f"{source}: no such file")
    try:
        with open(path, "rb") as f:
            # Headers first: every leaf's path, shape and dtype, sizes checked against the file;
            # a leaf with no place in the model is refused before any array data is read.
            flat: dict[str, Any] = {}
            _flatten(unwrap(read_structure(f, source), source), "", flat, source)
            cfg = config_from_tree(flat, source, **overrides)
            return cfg, params_from_tree(cfg, flat, source)
    except OSError as e:
        raise CheckpointError(f"{source}: cannot read: {e}") from None


# -- detection -------------------------------------------------------------------------------

def is_flax_wmt(path: str | os.PathLike) -> bool:
    """Whether `path` looks like a Flax WMT params file: a msgpack map whose params level (itself,
    or under "params") has `encoder` and `decoder` (and at most `shared_embedding`), the encoder
    holding `encoderblock_0` and `encoder_norm`. Reads headers only (array records unopened, so a
    hostile leaf is left for read_flax_wmt to name); never raises."""
    try:
        with open(path, "rb") as f:
            first = f.read(1)
            if not first or not (0x80 <= first[0] <= 0x8f or first[0] in (0xde, 0xdf)):
                return False
            top = read_structure(f, str(path), records=False)  # truncated, or bytes after it: refused
        level = top["params"] if "params" in top and "encoder" not in top else top
        if not isinstance(level, dict) or not {"encoder", "decoder"} <= set(level) <= {
                "encoder", "decoder", "shared_embedding"}:
            return False
        encoder = level["encoder"]
        return isinstance(encoder, dict) and {"encoderblock_0", "encoder_norm"} <= set(encoder)
    except Exception:  # any bytes at all: detection answers, it never raises
        return False
