"""Hugging Face M2M100 and NLLB-200 (`M2M100ForConditionalGeneration`, `model_type: m2m_100`) <->
the canonical checkpoint.

A directory holds `config.json` and `model.safetensors` (or shards, or a weights-only
`pytorch_model.bin`: rosetta/interop/marian.py reads all three). NumPy and safetensors do the
conversion. Conventions of `transformers/models/m2m_100/modeling_m2m_100.py` (read at 5.24):

- pre-norm (`x + sublayer(LN(x))`) and a final LayerNorm on each stack (`model.*.layer_norm`),
  `nn.LayerNorm`'s epsilon 1e-5, which has no config field (PITFALLS 2, 3);
- positions: fairseq's sinusoidal table, `[sin | cos]` with tensor2tensor's frequencies (our
  `sinusoidal_concat_t2t`, PITFALLS 1), never stored (a non-persistent buffer, grown on demand).
  Position ids come from the input ids (`create_position_ids_from_input_ids`: a cumulative sum of
  the non-pad tokens): the j-th non-pad token reads row `pad + 1 + j`, a pad reads the zero row
  `pad`. For right-padded input that is our `position_offset = pad_id + 1` (SPEC §1-2). With left
  padding, or a pad id inside a sentence, the real tokens after a pad read rows shifted back by the
  pads before them there, and by nothing here: pad on the right, as rosetta's batches do;
- `scale_embedding`: token embeddings times sqrt(d_model) (false is honoured: no factor);
- one table `model.shared` serves source, target and (`tie_word_embeddings`, the default) the output
  projection `lm_head` (no bias): `share_embeddings = all`. With `tie_word_embeddings` false the
  encoder's and decoder's `embed_tokens` and `lm_head` are separate tensors (`model.shared` is then
  read by nothing the model computes): the sharing their values show is read;
- `decoder_start_token_id` (fairseq: `</s>`, 2) is our `bos_id`; the target language code comes
  next, forced by generate (`forced_bos_token_id`, a generation setting, not a model field).
- q/k/v/out projections are separate `nn.Linear`s with biases, `weight` [out, in] (PITFALLS 7), with
  Marian's layer names (marian.module_map).

| M2M100 name (layer i) | canonical name | transform |
| --- | --- | --- |
| `model.{en,de}coder.layers.i.self_attn.{q,k,v,out}_proj` | `….self_attn.{q,k,v,o}` | weight.T |
| `model.{en,de}coder.layers.i.self_attn_layer_norm` | `….self_attn_norm` | weight -> scale |
| `model.decoder.layers.i.encoder_attn.{q,k,v,out}_proj` | `….cross_attn.{q,k,v,o}` | weight.T |
| `model.decoder.layers.i.encoder_attn_layer_norm` | `decoder.layers.i.cross_attn_norm` | weight -> scale |
| `model.{en,de}coder.layers.i.fc1`, `fc2` | `….ffn.linear1`, `….ffn.linear2` | weight.T |
| `model.{en,de}coder.layers.i.final_layer_norm` | `….ffn_norm` | weight -> scale |
| `model.{en,de}coder.layer_norm` | `{en,de}coder.final_norm` | weight -> scale |
| `model.shared.weight` (tied) | `shared_embed.embedding` | as is |
| `model.{en,de}coder.embed_tokens.weight` (untied) | `src_embed`/`tgt_embed` | as is |
| `lm_head.weight` [V, d] (untied) | `generator.kernel` [d, V] | transposed |
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from rosetta.checkpoint import DTYPES, check_params
from rosetta.config import ModelConfig
from rosetta.errors import CheckpointError, ConfigError
from rosetta.files import atomic_write_bytes
from rosetta.interop import marian
from rosetta.interop.marian_fields import FLOAT_DTYPES, SILENT
from rosetta.json_input import Field, check_schema, field
from rosetta.params import Params, embedding_names

CONFIG_FILE, WEIGHTS_FILE = marian.CONFIG_FILE, marian.WEIGHTS_FILE
MODEL_TYPE = "m2m_100"
LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default; M2M100 has no field for it
POSITIONS = "sinusoidal_concat_t2t"  # M2M100SinusoidalPositionalEmbedding.get_embedding
WHAT = "M2M100 weights"

# M2M100Config's defaults (configuration_m2m_100.py), for fields a config.json leaves out.
DEFAULTS: dict[str, Any] = {
    "vocab_size": 128112, "max_position_embeddings": 1024, "encoder_layers": 12, "encoder_ffn_dim": 4096,
    "encoder_attention_heads": 16, "decoder_layers": 12, "decoder_ffn_dim": 4096,
    "decoder_attention_heads": 16, "activation_function": "relu", "d_model": 1024, "dropout": 0.1,
    "attention_dropout": 0.1, "activation_dropout": 0.0, "decoder_start_token_id": 2,
    "scale_embedding": True, "pad_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True,
}
# M2M100Config.attribute_map: a config.json may give these names instead of the fields.
ALIASES = {"hidden_size": "d_model", "num_attention_heads": "encoder_attention_heads",
           "num_hidden_layers": "encoder_layers"}
# Fields M2M100ForConditionalGeneration never reads at inference, and the value that says what it
# computes anyway; another value is ignored there, so here, with one note.
IGNORED: dict[str, tuple[Any, str]] = {
    "encoder_layerdrop": (0.0, "LayerDrop acts in training only; rosetta trains every layer"),
    "decoder_layerdrop": (0.0, "LayerDrop acts in training only; rosetta trains every layer"),
    "normalize_before": (True, "it computes pre-norm layers, x + sublayer(LN(x))"),
    "add_final_layer_norm": (True, "it applies a final LayerNorm on each stack"),
    "normalize_embedding": (False, "it applies no norm to the embeddings"),
    "static_position_embeddings": (True, "its positions are the fixed sinusoidal table"),
    "is_decoder": (False, "M2M100ForConditionalGeneration is an encoder-decoder"),
    "is_encoder_decoder": (True, "M2M100ForConditionalGeneration is an encoder-decoder"),
}
# Read without changing the logits: Marian's list (initialization, cache, generation, metadata).
QUIET = SILENT | {"num_beams", "max_length", "length_penalty", "early_stopping"}
ARCHITECTURES = ("M2M100ForConditionalGeneration", "M2M100Model")
CONFIG_SCHEMA: dict[str, Field] = {
    "model_type": field("string"), "activation_function": field("string"),
    **{name: field("integer") for name in (
        "vocab_size", "max_position_embeddings", "encoder_layers", "encoder_ffn_dim",
        "encoder_attention_heads", "decoder_layers", "decoder_ffn_dim", "decoder_attention_heads",
        "d_model")},
    **{name: field("number") for name in ("dropout", "attention_dropout", "activation_dropout")},
    **{name: field("boolean") for name in ("scale_embedding", "tie_word_embeddings")},
}
_noted: set[tuple[str, str]] = set()


# -- M2M100 -> ours --------------------------------------------------------------------------

def _note(source: str, key: str, line: str) -> None:
    """One stderr line per file and field per process."""
    if (source, key) not in _noted:
        _noted.add((source, key))
        print(f"rosetta: note: {source}: {line}", file=sys.stderr)


def _resolve_fields(hf: Mapping[str, Any], source: str) -> dict[str, Any]:
    """`hf` with its aliases read as their fields; each other field refused, noted once on stderr
    (read by nothing M2M100ForConditionalGeneration computes at inference) or passed."""
    out = dict(hf)
    for alias, name in ALIASES.items():
        if alias in out:
            value = out.pop(alias)
            if name in out and out[name] != value:
                raise ConfigError(f"{source}: {alias} {value!r} contradicts {name} {out[name]!r} "
                                  f"(M2M100Config reads {alias} as {name}); give one value")
            out[name] = value
    key = "dtype" if "dtype" in hf else "torch_dtype"
    if hf.get(key) is not None and hf[key] not in FLOAT_DTYPES:
        raise ConfigError(f"{source}: {key} {hf[key]!r} is not a floating-point type (from_pretrained "
                          f"refuses it too); give one of {', '.join(FLOAT_DTYPES)}")
    for k, v in hf.items():
        if k in IGNORED and v != IGNORED[k][0]:
            _note(source, k, f"{k} {json.dumps(v)} is ignored, as M2M100ForConditionalGeneration ignores "
                             f"it at inference ({IGNORED[k][1]})")
    architectures = hf.get("architectures")
    if isinstance(architectures, list) and any(a not in ARCHITECTURES for a in architectures):
        _note(source, "architectures", f"architectures {json.dumps(architectures)} is ignored (model_type "
                                       f"{MODEL_TYPE} decides)")
    unknown = sorted(k for k in hf if k not in DEFAULTS and k not in ALIASES and k not in IGNORED
                     and k not in QUIET and k not in ("architectures", "dtype", "torch_dtype"))
    if unknown:
        _note(source, " ".join(unknown), f"{', '.join(unknown)}: not fields of M2M100Config; ignored, as "
                                         f"M2M100ForConditionalGeneration ignores them")
    return out


def _token_id(c: Mapping[str, Any], name: str, source: str) -> int:
    """A single non-negative integer id, or a ConfigError naming the field."""
    value = c[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        what = "a list: rosetta's search ends on one end token" if isinstance(value, list) else "not an id"
        raise ConfigError(f"{source}: {name} {value!r} is {what}; give one non-negative integer id")
    return value


def config_from_m2m100(hf: Mapping[str, Any], *, source: str = CONFIG_FILE, **overrides: Any) -> ModelConfig:
    """Our config for an M2M100 / NLLB `config.json` (M2M100Config's defaults for absent fields),
    its fields' types checked first; `source` names the file in the messages. With
    tie_word_embeddings false the sharing is `none` here: read_m2m100 reads the tables' own."""
    hf = _resolve_fields(hf, source)
    check_schema(hf, CONFIG_SCHEMA, source)
    if hf.get("model_type", MODEL_TYPE) != MODEL_TYPE:
        raise ConfigError(f"{source}: model_type {hf.get('model_type')!r} is not {MODEL_TYPE!r}")
    if hf.get("activation_function", "relu") not in marian.ACTIVATIONS_IN:
        raise ConfigError(f"{source}: activation_function {hf['activation_function']!r}: rosetta's model "
                          f"cannot compute it (it computes {', '.join(marian.ACTIVATIONS_IN)})")
    c = {**DEFAULTS, **{k: v for k, v in hf.items() if k in DEFAULTS}}
    for mine, theirs in (("encoder_attention_heads", "decoder_attention_heads"),
                         ("encoder_ffn_dim", "decoder_ffn_dim")):
        if c[mine] != c[theirs]:
            raise ConfigError(f"{source}: {mine}={c[mine]} differs from {theirs}={c[theirs]}; one "
                              f"value serves both stacks here (num_heads, d_ff)")
    pad, start, eos = (_token_id(c, name, source)
                       for name in ("pad_token_id", "decoder_start_token_id", "eos_token_id"))
    if start == pad:
        raise ConfigError(f"{source}: decoder_start_token_id {start} equals pad_token_id: M2M100 then gives "
                          f"the start token the zero position row, which rosetta's model never does "
                          f"(position 0 is never padding)")
    fields = dict(
        src_vocab_size=c["vocab_size"], tgt_vocab_size=c["vocab_size"], d_model=c["d_model"],
        num_heads=c["encoder_attention_heads"], num_encoder_layers=c["encoder_layers"],
        num_decoder_layers=c["decoder_layers"], d_ff=c["encoder_ffn_dim"], dropout=c["dropout"],
        activation_dropout=c["activation_dropout"], attention_dropout=c["attention_dropout"],
        activation=marian.ACTIVATIONS_IN[c["activation_function"]], norm_first=True, final_norm=True,
        layer_norm_eps=LAYER_NORM_EPS, attention_bias=True, ffn_bias=True,
        scale_embeddings=c["scale_embedding"], positional_encoding=POSITIONS,
        position_offset=pad + 1,  # create_position_ids_from_input_ids: the first token reads row pad + 1
        share_embeddings="all" if c["tie_word_embeddings"] else "none", output_bias=False,
        max_len=c["max_position_embeddings"], pad_id=pad, bos_id=start, eos_id=eos,
    )
    return ModelConfig.from_dict({**fields, **overrides})


def _tensor_names(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name an M2M100 file of `cfg` may hold, with its shape."""
    d, v = cfg.d_model, cfg.tgt_vocab_size
    shapes: dict[str, tuple[int, ...]] = {name: (v, d) for name in (
        "model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight",
        "lm_head.weight")}
    for side in ("encoder", "decoder"):
        shapes[f"model.{side}.layer_norm.weight"] = shapes[f"model.{side}.layer_norm.bias"] = (d,)
    for theirs, (_, kind) in marian.module_map(cfg).items():
        weight = {"fc1": (cfg.d_ff, d), "fc2": (d, cfg.d_ff)}.get(theirs.rsplit(".", 1)[-1],
                                                                   (d, d) if kind == "linear" else (d,))
        shapes[f"{theirs}.weight"], shapes[f"{theirs}.bias"] = weight, (weight[0],)
    return shapes


def params_from_m2m100(cfg: ModelConfig, tensors: Mapping[str, np.ndarray], tied: bool = True) -> Params:
    """Canonical parameters from an M2M100 state dict (checked name by name, shape by shape).
    `tied`: config.json's tie_word_embeddings (`model.shared` is the model's table only then)."""
    expected = _tensor_names(cfg)
    for name, value in tensors.items():
        if name not in expected:
            raise CheckpointError(f"{WHAT}: unexpected tensor {name} for this config")
        if tuple(value.shape) != expected[name]:
            raise CheckpointError(f"{WHAT}: {name} has shape {tuple(value.shape)}, the config "
                                  f"expects {expected[name]}")

    def first(candidates: list[str], what: str) -> np.ndarray:  # tied copies must be equal
        return marian._first_present(tensors, candidates, what, WHAT)

    params: Params = {}
    for theirs, (mine, kind) in marian.module_map(cfg).items():
        weight = first([f"{theirs}.weight"], f"{theirs}.weight")
        if kind == "linear":
            params[f"{mine}.kernel"] = weight.T
        else:
            params[f"{mine}.scale"] = weight
        params[f"{mine}.bias"] = first([f"{theirs}.bias"], f"{theirs}.bias")
    for side in ("encoder", "decoder"):  # pre-norm's final LayerNorm on each stack
        params[f"{side}.final_norm.scale"] = first([f"model.{side}.layer_norm.weight"], "a final norm")
        params[f"{side}.final_norm.bias"] = first([f"model.{side}.layer_norm.bias"], "a final norm")
    shared, enc, dec, out = ("model.shared.weight", "model.encoder.embed_tokens.weight",
                             "model.decoder.embed_tokens.weight", "lm_head.weight")
    names = embedding_names(cfg)
    if tied:  # encoder, decoder and lm_head all read model.shared (M2M100Model._tied_weights_keys)
        candidates = {"all": [shared, enc, dec, out], "src_tgt": [shared, enc, dec], "decoder": [dec, out],
                      "none": [dec]}[cfg.share_embeddings]
    else:  # model.shared is read by nothing the model computes
        candidates = {"all": [dec, enc, out], "src_tgt": [dec, enc], "decoder": [dec, out],
                      "none": [dec]}[cfg.share_embeddings]
    params[names.tgt] = first(candidates, "the target embedding")
    if cfg.share_embeddings in ("decoder", "none"):
        params[names.src] = first([enc], "the source embedding")
    if cfg.share_embeddings in ("src_tgt", "none"):
        params["generator.kernel"] = first([out], "lm_head.weight").T
    params = {name: np.ascontiguousarray(value) for name, value in params.items()}
    check_params(cfg, params, WHAT)
    return params


def read_m2m100(path: str | os.PathLike, **overrides: Any) -> tuple[ModelConfig, Params]:
    """(config, canonical params) of a Hugging Face M2M100 / NLLB directory."""
    directory = Path(path)
    if not (directory / CONFIG_FILE).is_file():
        raise CheckpointError(f"{directory}: not an M2M100 directory (no {CONFIG_FILE})")
    hf = marian.read_config(directory)
    cfg = config_from_m2m100(hf, source=str(directory / CONFIG_FILE), **overrides)
    tensors = marian._read_weights(directory, cfg, WHAT)
    tied = hf.get("tie_word_embeddings", DEFAULTS["tie_word_embeddings"])
    if not tied and "share_embeddings" not in overrides:
        cfg = cfg.replace(share_embeddings=marian.sharing_of(tensors, "model.encoder.embed_tokens.weight",
                                                             "model.decoder.embed_tokens.weight",
                                                             "lm_head.weight"))
    return cfg, params_from_m2m100(cfg, tensors, tied)


def is_m2m100(path: str | os.PathLike) -> bool:
    """A directory whose config.json says model_type "m2m_100" (never raises)."""
    return marian.has_model_type(path, MODEL_TYPE)


# -- ours -> M2M100 --------------------------------------------------------------------------

def check_representable(cfg: ModelConfig) -> None:
    """Refuse, naming the field, a config that M2M100's code cannot compute."""
    problems = []
    if not cfg.norm_first:
        problems.append("norm_first=false (M2M100 is pre-norm)")
    if not cfg.has_final_norm:
        problems.append("final_norm=false (M2M100 ends each stack with a LayerNorm)")
    if cfg.positional_encoding != POSITIONS:
        problems.append(f"positional_encoding={cfg.positional_encoding!r} (M2M100 computes {POSITIONS})")
    if cfg.position_offset != cfg.pad_id + 1:
        problems.append(f"position_offset={cfg.position_offset} (M2M100's first token reads row pad_id + 1 "
                        f"= {cfg.pad_id + 1})")
    if cfg.layer_norm_eps != LAYER_NORM_EPS:
        problems.append(f"layer_norm_eps={cfg.layer_norm_eps} (M2M100's LayerNorm uses {LAYER_NORM_EPS})")
    if cfg.src_vocab_size != cfg.tgt_vocab_size:
        problems.append(f"src_vocab_size={cfg.src_vocab_size} != tgt_vocab_size={cfg.tgt_vocab_size} (M2M100 "
                        f"has one vocab_size)")
    if cfg.output_bias:
        problems.append("output_bias=true (M2M100's lm_head has no bias)")
    if cfg.logit_scale != 1.0:
        problems.append(f"logit_scale={cfg.logit_scale!r} (M2M100's logits are lm_head(h))")
    if cfg.bos_id == cfg.pad_id:
        problems.append(f"bos_id={cfg.bos_id} equals pad_id (M2M100 gives a start token equal to pad the "
                        f"zero position row)")
    if problems:
        raise ConfigError("cannot write as M2M100: " + "; ".join(problems))


def config_to_m2m100(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """The `config.json` of `cfg` as an M2M100ForConditionalGeneration."""
    check_representable(cfg)
    return {
        "architectures": ["M2M100ForConditionalGeneration"], "model_type": MODEL_TYPE,
        "is_encoder_decoder": True,
        "vocab_size": cfg.tgt_vocab_size, "d_model": cfg.d_model, "encoder_layers": cfg.num_encoder_layers,
        "decoder_layers": cfg.num_decoder_layers, "encoder_attention_heads": cfg.num_heads,
        "decoder_attention_heads": cfg.num_heads, "encoder_ffn_dim": cfg.d_ff, "decoder_ffn_dim": cfg.d_ff,
        "activation_function": marian.ACTIVATIONS_OUT[cfg.activation], "dropout": cfg.dropout,
        "attention_dropout": cfg.attention_dropout, "activation_dropout": cfg.activation_dropout_rate,
        "scale_embedding": cfg.scale_embeddings, "max_position_embeddings": cfg.max_len,
        "pad_token_id": cfg.pad_id, "decoder_start_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id,
        "bos_token_id": None, "tie_word_embeddings": cfg.share_embeddings == "all",
        # rosetta trains every layer: no LayerDrop (M2M100Config's default is 0.05)
        "encoder_layerdrop": 0.0, "decoder_layerdrop": 0.0, "use_cache": True, "dtype": dtype,
    }


def params_to_m2m100(cfg: ModelConfig, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """M2M100's state dict (the tensors `save_pretrained` writes) from canonical params."""
    check_representable(cfg)
    check_params(cfg, params)
    dtype = np.asarray(next(iter(params.values()))).dtype
    out: dict[str, np.ndarray] = {}
    for theirs, (mine, kind) in marian.module_map(cfg).items():
        if kind == "linear":
            kernel = np.asarray(params[f"{mine}.kernel"])
            out[f"{theirs}.weight"] = kernel.T
            # an absent bias (attention_bias/ffn_bias false) is a zero bias: the same function, exactly
            out[f"{theirs}.bias"] = np.asarray(params.get(f"{mine}.bias", np.zeros(kernel.shape[1], dtype)))
        else:
            out[f"{theirs}.weight"] = np.asarray(params[f"{mine}.scale"])
            out[f"{theirs}.bias"] = np.asarray(params[f"{mine}.bias"])
    for side in ("encoder", "decoder"):
        out[f"model.{side}.layer_norm.weight"] = np.asarray(params[f"{side}.final_norm.scale"])
        out[f"model.{side}.layer_norm.bias"] = np.asarray(params[f"{side}.final_norm.bias"])
    names = embedding_names(cfg)
    out["model.shared.weight"] = np.asarray(params[names.src])
    if cfg.share_embeddings != "all":  # tie_word_embeddings false: each table its own tensor
        out["model.encoder.embed_tokens.weight"] = np.asarray(params[names.src])
        out["model.decoder.embed_tokens.weight"] = np.asarray(params[names.tgt])
        output = params.get("generator.kernel")
        out["lm_head.weight"] = np.asarray(params[names.tgt]) if output is None else np.asarray(output).T
    return {name: np.ascontiguousarray(value) for name, value in out.items()}


def write_m2m100(path: str | os.PathLike, cfg: ModelConfig, params: Mapping[str, np.ndarray]) -> Path:
    """Write a directory that `M2M100ForConditionalGeneration.from_pretrained` loads; nothing is
    written on refusal."""
    import safetensors.numpy

    tensors = params_to_m2m100(cfg, params)  # refuses before anything is written
    dtype = next(name for name, dt in {**DTYPES, "float64": np.dtype(np.float64)}.items()
                 if dt == next(iter(tensors.values())).dtype)
    if dtype == "float64":  # M2M100's weights are float32 (or half): float64 is our in-memory type
        tensors, dtype = {k: v.astype(np.float32) for k, v in tensors.items()}, "float32"
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"{directory}: exists and is not a directory")
    atomic_write_bytes(directory / WEIGHTS_FILE, safetensors.numpy.save(tensors, metadata={"format": "pt"}))
    atomic_write_bytes(directory / "generation_config.json",
                       (json.dumps(marian.generation_config(cfg), indent=2) + "\n").encode())
    # config.json last: a directory is only an M2M100 model once its weights are complete.
    config = json.dumps(config_to_m2m100(cfg, dtype), indent=2) + "\n"
    atomic_write_bytes(directory / CONFIG_FILE, config.encode())
    return directory
