"""Hugging Face FSMT (`FSMTForConditionalGeneration`, fairseq's WMT19 Transformer) <-> the canonical
checkpoint.

An FSMT directory holds `config.json` (`model_type: fsmt`) and `model.safetensors` (or shards, or a
weights-only `pytorch_model.bin`: rosetta/interop/marian.py reads all three), and its tokenizer's
`vocab-src.json`, `vocab-tgt.json`, `merges.txt` (tokenization_fsmt.py's VOCAB_FILES_NAMES; not
`src_vocab.json`/`tgt_vocab.json`). NumPy and safetensors do the conversion. Conventions of
`transformers/models/fsmt/modeling_fsmt.py` (checked against 5.24):

- post-norm (`x = LN(x + sublayer(x))`), no final norm, `nn.LayerNorm`'s epsilon 1e-5 (PITFALLS 2, 3);
- positions: fairseq's SinusoidalPositionalEmbedding, `[sin | cos]` with tensor2tensor's frequencies
  (our `sinusoidal_concat_t2t`, PITFALLS 1), a table of max_position_embeddings + pad + 1 rows whose
  row `pad` is zero. Position ids come from the input ids (`make_positions`): the j-th non-pad token
  reads row pad + 1 + j, a pad reads the zero row. For right-padded input that is our
  `position_offset = pad_id + 1` (SPEC §1-2); left padding or a pad inside a sentence would shift
  FSMT's positions, not ours. The table is saved (`model.*.embed_positions.weight`, computed in
  float32): checked against ours and dropped on reading, recomputed on writing;
- `scale_embedding`: token embeddings times sqrt(d_model) (PITFALLS 8);
- `decoder_start_token_id` (fairseq: `</s>`, 2) is our `bos_id`. Equal to pad it is refused: FSMT
  would mask the start token and give it the zero position row (SPEC §2 never masks position 0);
- separate source and target tables (`src_vocab_size`, `tgt_vocab_size`) and an output projection
  `model.decoder.output_projection` without bias (`output_bias = false`). `tie_word_embeddings` true
  ties all three to the decoder's table (`all`; with unequal vocabularies FSMT would build the encoder's
  table with the target's size: refused). False keeps three tensors: the sharing they show is read
  (an output projection equal to the target table, as fairseq's WMT19 models store it, is `decoder`),
  the same function either way;
- q/k/v/out projections are separate `nn.Linear`s with biases, `weight` [out, in] (PITFALLS 7). The
  layer names are Marian's (marian.module_map).
- `FSMTModel.forward` builds its causal and decoder-padding masks only when `use_cache` is false, and
  config.json's `use_cache` (true) is the default: a teacher-forced call must pass `use_cache=False`
  to compute what generate (one token a step) computes.

| FSMT name (layer i) | canonical name | transform |
| --- | --- | --- |
| `model.{en,de}coder.layers.i.self_attn.{q,k,v}_proj` | `….self_attn.{q,k,v}` | weight.T |
| `model.{en,de}coder.layers.i.self_attn.out_proj` | `….self_attn.o` | weight.T |
| `model.{en,de}coder.layers.i.self_attn_layer_norm` | `….self_attn_norm` | weight -> scale |
| `model.decoder.layers.i.encoder_attn.{q,k,v,out}_proj` | `….cross_attn.{q,k,v,o}` | weight.T |
| `model.decoder.layers.i.encoder_attn_layer_norm` | `decoder.layers.i.cross_attn_norm` | weight -> scale |
| `model.{en,de}coder.layers.i.fc1`, `fc2` | `….ffn.linear1`, `….ffn.linear2` | weight.T |
| `model.{en,de}coder.layers.i.final_layer_norm` | `….ffn_norm` | weight -> scale |
| `model.encoder.embed_tokens.weight` | `src_embed.embedding` (`shared_embed`) | as is |
| `model.decoder.embed_tokens.weight` | `tgt_embed.embedding` (`shared_embed`) | as is |
| `model.decoder.output_projection.weight` [V, d] | `generator.kernel` [d, V] (untied) | transposed |
| `model.{en,de}coder.embed_positions.weight` | (none: the positional table) | checked, dropped |
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rosetta.checkpoint import DTYPES, check_params
from rosetta.config import ModelConfig
from rosetta.errors import CheckpointError, ConfigError
from rosetta.files import atomic_write_bytes
from rosetta.interop import marian
from rosetta.interop.marian_fields import FLOAT_DTYPES, SILENT
from rosetta.json_input import Field, check_schema, field, read_json
from rosetta.params import Params, embedding_names
from rosetta.positional import positional_encoding

CONFIG_FILE, WEIGHTS_FILE = marian.CONFIG_FILE, marian.WEIGHTS_FILE
LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default; FSMT has no field for it
POSITIONS = "sinusoidal_concat_t2t"  # fairseq's SinusoidalPositionalEmbedding (get_embedding)
WHAT = "FSMT weights"

# FSMTConfig's defaults (configuration_fsmt.py), for fields a config.json leaves out.
DEFAULTS: dict[str, Any] = {
    "src_vocab_size": 42024, "tgt_vocab_size": 42024, "activation_function": "relu", "d_model": 1024,
    "max_position_embeddings": 1024, "encoder_ffn_dim": 4096, "encoder_layers": 12,
    "encoder_attention_heads": 16, "decoder_ffn_dim": 4096, "decoder_layers": 12,
    "decoder_attention_heads": 16, "attention_dropout": 0.0, "dropout": 0.1, "activation_dropout": 0.0,
    "decoder_start_token_id": 2, "scale_embedding": True, "tie_word_embeddings": False,
    "pad_token_id": 1, "eos_token_id": 2,
}
# FSMTConfig.attribute_map: a config.json may give these names instead of the fields.
ALIASES = {"hidden_size": "d_model", "num_attention_heads": "encoder_attention_heads",
           "vocab_size": "tgt_vocab_size", "num_hidden_layers": "encoder_layers"}
# Fields FSMTForConditionalGeneration never reads (or reads in training only), and the value that
# says what it computes anyway; another value is ignored there, so here, with one note.
IGNORED: dict[str, tuple[Any, str]] = {
    "normalize_before": (False, "it computes post-norm layers, LN(x + sublayer(x))"),
    "normalize_embedding": (False, "it applies no norm to the embeddings"),
    "add_final_layer_norm": (False, "it applies no final norm"),
    "static_position_embeddings": (True, "its positions are the fixed sinusoidal table"),
    "is_decoder": (False, "FSMTForConditionalGeneration is an encoder-decoder"),
    "is_encoder_decoder": (True, "FSMTForConditionalGeneration is an encoder-decoder"),
    "encoder_layerdrop": (0.0, "LayerDrop acts in training only; rosetta trains every layer"),
    "decoder_layerdrop": (0.0, "LayerDrop acts in training only; rosetta trains every layer"),
}
# Read without changing the logits: Marian's list (initialization, cache, generation, metadata),
# FSMT's language pair (its tokenizer's) and the `decoder` object FSMTConfig drops.
QUIET = SILENT | {"langs", "decoder", "max_length", "num_beams", "length_penalty", "early_stopping"}
ARCHITECTURES = ("FSMTForConditionalGeneration", "FSMTModel")
CONFIG_SCHEMA: dict[str, Field] = {
    "model_type": field("string"), "activation_function": field("string"),
    **{name: field("integer") for name in (
        "src_vocab_size", "tgt_vocab_size", "max_position_embeddings", "encoder_layers", "encoder_ffn_dim",
        "encoder_attention_heads", "decoder_layers", "decoder_ffn_dim", "decoder_attention_heads", "d_model",
        "decoder_start_token_id", "pad_token_id", "eos_token_id")},
    **{name: field("number") for name in ("dropout", "attention_dropout", "activation_dropout")},
    **{name: field("boolean") for name in ("scale_embedding", "tie_word_embeddings")},
}
_noted: set[tuple[str, str]] = set()


# -- FSMT -> ours ----------------------------------------------------------------------------

def _resolve_fields(hf: Mapping[str, Any], source: str) -> dict[str, Any]:
    """`hf` with its aliases read as their fields; each other field refused, noted once on stderr
    (read by nothing that FSMTForConditionalGeneration computes) or passed."""
    out = dict(hf)
    for alias, name in ALIASES.items():
        if alias in out:
            value = out.pop(alias)
            if name in out and out[name] != value:
                raise ConfigError(f"{source}: {alias} {value!r} contradicts {name} {out[name]!r} "
                                  f"(FSMTConfig reads {alias} as {name}); give one value")
            out[name] = value
    if isinstance(hf.get("eos_token_id"), list):  # FSMTConfig allows a list; our search ends on one id
        raise ConfigError(f"{source}: eos_token_id {hf['eos_token_id']!r}: rosetta's search ends on one "
                          f"end token; give one id")
    key = "dtype" if "dtype" in hf else "torch_dtype"
    if hf.get(key) is not None and hf[key] not in FLOAT_DTYPES:
        raise ConfigError(f"{source}: {key} {hf[key]!r} is not a floating-point type (from_pretrained "
                          f"refuses it too); give one of {', '.join(FLOAT_DTYPES)}")
    notes = [(k, f"{k} {json.dumps(v)} is ignored, as FSMTForConditionalGeneration ignores it "
                 f"({IGNORED[k][1]})") for k, v in hf.items() if k in IGNORED and v != IGNORED[k][0]]
    architectures = hf.get("architectures")
    if isinstance(architectures, list) and any(a not in ARCHITECTURES for a in architectures):
        notes.append(("architectures", f"architectures {json.dumps(architectures)} is ignored (model_type "
                                       f"fsmt decides)"))
    unknown = sorted(k for k in hf if k not in DEFAULTS and k not in ALIASES and k not in IGNORED
                     and k not in QUIET and k not in ("architectures", "dtype", "torch_dtype"))
    if unknown:
        notes.append((" ".join(unknown), f"{', '.join(unknown)}: not fields of FSMTConfig; ignored, as "
                                         f"FSMTForConditionalGeneration ignores them"))
    for name, line in notes:
        if (source, name) not in _noted:
            _noted.add((source, name))
            print(f"rosetta: note: {source}: {line}", file=sys.stderr)
    return out


def config_from_fsmt(hf: Mapping[str, Any], *, source: str = CONFIG_FILE, **overrides: Any) -> ModelConfig:
    """Our config for an FSMT `config.json` (FSMTConfig's defaults for absent fields), its fields'
    types checked first; `source` names the file in the messages. With tie_word_embeddings false
    the sharing is `none` here: read_fsmt reads the tables' own."""
    hf = _resolve_fields(hf, source)
    check_schema(hf, CONFIG_SCHEMA, source)
    if hf.get("model_type", "fsmt") != "fsmt":
        raise ConfigError(f"{source}: model_type {hf.get('model_type')!r} is not 'fsmt'")
    if hf.get("activation_function", "relu") not in marian.ACTIVATIONS_IN:
        raise ConfigError(f"{source}: activation_function {hf['activation_function']!r}: rosetta's model "
                          f"cannot compute it (it computes {', '.join(marian.ACTIVATIONS_IN)})")
    c = {**DEFAULTS, **{k: v for k, v in hf.items() if k in DEFAULTS}}
    for mine, theirs in (("encoder_attention_heads", "decoder_attention_heads"),
                         ("encoder_ffn_dim", "decoder_ffn_dim")):
        if c[mine] != c[theirs]:
            raise ConfigError(f"{source}: {mine}={c[mine]} differs from {theirs}={c[theirs]}; one "
                              f"value serves both stacks here (num_heads, d_ff)")
    if c["tie_word_embeddings"] and c["src_vocab_size"] != c["tgt_vocab_size"]:
        raise ConfigError(f"{source}: tie_word_embeddings true with src_vocab_size {c['src_vocab_size']} != "
                          f"tgt_vocab_size {c['tgt_vocab_size']}: FSMT then reads the source through the "
                          f"target's table; one table needs one vocabulary")
    if c["decoder_start_token_id"] == c["pad_token_id"]:
        raise ConfigError(f"{source}: decoder_start_token_id {c['decoder_start_token_id']} equals "
                          f"pad_token_id: FSMT then masks the start token and gives it the zero position "
                          f"row, which rosetta's model never does (position 0 is never padding)")
    pad = c["pad_token_id"]
    fields = dict(
        src_vocab_size=c["src_vocab_size"], tgt_vocab_size=c["tgt_vocab_size"], d_model=c["d_model"],
        num_heads=c["encoder_attention_heads"], num_encoder_layers=c["encoder_layers"],
        num_decoder_layers=c["decoder_layers"], d_ff=c["encoder_ffn_dim"], dropout=c["dropout"],
        activation_dropout=c["activation_dropout"], attention_dropout=c["attention_dropout"],
        activation=marian.ACTIVATIONS_IN[c["activation_function"]], norm_first=False, final_norm=False,
        layer_norm_eps=LAYER_NORM_EPS, attention_bias=True, ffn_bias=True,
        scale_embeddings=c["scale_embedding"], positional_encoding=POSITIONS,
        position_offset=pad + 1,  # fairseq's make_positions: the first token reads row pad + 1
        share_embeddings="all" if c["tie_word_embeddings"] else "none", output_bias=False,
        max_len=c["max_position_embeddings"], pad_id=pad, bos_id=c["decoder_start_token_id"],
        eos_id=c["eos_token_id"],
    )
    return ModelConfig.from_dict({**fields, **overrides})


def table_rows(hf: Mapping[str, Any]) -> int:
    """Rows of FSMT's stored positional tables: max_position_embeddings + pad + 1."""
    c = {**DEFAULTS, **{k: v for k, v in _aliased(hf).items() if k in DEFAULTS}}
    return c["max_position_embeddings"] + c["pad_token_id"] + 1


def _aliased(hf: Mapping[str, Any]) -> dict[str, Any]:
    return {ALIASES.get(k, k): v for k, v in hf.items()}


def table_tolerance(rows: int, dtype: np.dtype) -> float:
    """How far FSMT's stored table may be from the float64 one. fairseq computes it in float32:
    the frequency exp(-i c) (c = ln 1e4 / (d/2 - 1), i c <= ln 1e4) carries i c 2^-24 relative from
    the rounded exponent plus 2^-24 from exp, the angle p w another 2^-24: at most about
    (1/e + 2) 2^-24 p w <= 3 * 2^-24 p absolute in the angle, so in sin and cos, with p < rows;
    4 * 2^-24 rows covers it (measured: 1.2 * 2^-24 rows at d 1024, 1,026 rows), plus one
    epsilon of the stored dtype for its rounding of values in [-1, 1]."""
    return 4 * 2.0**-24 * rows + float(np.finfo(dtype).eps)


def check_tables(cfg: ModelConfig, tensors: Mapping[str, np.ndarray]) -> None:
    """Each stored positional table must be fairseq's: rows pad+1.. (the rows FSMT reads for real
    tokens) within table_tolerance of ours. Rows up to pad are never read for a real token."""
    for side in ("encoder", "decoder"):
        name = f"model.{side}.embed_positions.weight"
        if name not in tensors:
            continue
        stored = tensors[name]
        rows, first = stored.shape[0], cfg.pad_id + 1
        table = positional_encoding(POSITIONS, rows, cfg.d_model)
        error = float(np.max(np.abs(stored[first:].astype(np.float64) - table[first:]), initial=0.0))
        if not error <= table_tolerance(rows, stored.dtype):  # NaN fails too
            raise CheckpointError(f"{WHAT}: {name} is not fairseq's sinusoidal table (tensor2tensor's "
                                  f"[sin | cos]): off by {error:.3g} at rows {first}..{rows - 1}")


def _tensor_names(cfg: ModelConfig, rows: int) -> dict[str, tuple[int, ...]]:
    """Every tensor name an FSMT file of `cfg` may hold, with its shape (`rows`: the tables')."""
    d = cfg.d_model
    shapes: dict[str, tuple[int, ...]] = {
        "model.encoder.embed_tokens.weight": (cfg.src_vocab_size, d),
        "model.decoder.embed_tokens.weight": (cfg.tgt_vocab_size, d),
        "model.decoder.output_projection.weight": (cfg.tgt_vocab_size, d),
        "model.encoder.embed_positions.weight": (rows, d), "model.decoder.embed_positions.weight": (rows, d)}
    for theirs, (_, kind) in marian.module_map(cfg).items():
        if theirs.endswith("fc1"):
            weight = (cfg.d_ff, d)
        elif theirs.endswith("fc2"):
            weight = (d, cfg.d_ff)
        else:
            weight = (d, d) if kind == "linear" else (d,)
        shapes[f"{theirs}.weight"] = weight
        shapes[f"{theirs}.bias"] = (weight[0],)
    return shapes


def params_from_fsmt(cfg: ModelConfig, tensors: Mapping[str, np.ndarray], rows: int) -> Params:
    """Canonical parameters from an FSMT state dict (checked name by name, shape by shape; the
    positional tables checked against ours and dropped). `rows`: the tables' (table_rows)."""
    expected = _tensor_names(cfg, rows)
    for name, value in tensors.items():
        if name not in expected:
            raise CheckpointError(f"{WHAT}: unexpected tensor {name} for this config")
        if tuple(value.shape) != expected[name]:
            raise CheckpointError(f"{WHAT}: {name} has shape {tuple(value.shape)}, the config "
                                  f"expects {expected[name]}")
    check_tables(cfg, tensors)
    params: Params = {}
    for theirs, (mine, kind) in marian.module_map(cfg).items():
        for suffix in ("weight", "bias"):
            if f"{theirs}.{suffix}" not in tensors:
                raise CheckpointError(f"{WHAT}: missing {theirs}.{suffix}")
        weight = tensors[f"{theirs}.weight"]
        if kind == "linear":
            params[f"{mine}.kernel"] = weight.T
        else:
            params[f"{mine}.scale"] = weight
        params[f"{mine}.bias"] = tensors[f"{theirs}.bias"]
    enc, dec = "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"
    out = "model.decoder.output_projection.weight"
    names = embedding_names(cfg)

    def first(candidates: list[str], what: str) -> np.ndarray:  # tied copies must be equal
        return marian._first_present(tensors, candidates, what, WHAT)

    tied = {"all": [dec, enc, out], "src_tgt": [dec, enc], "decoder": [dec, out], "none": [dec]}
    params[names.tgt] = first(tied[cfg.share_embeddings], "the target embedding")
    if cfg.share_embeddings in ("decoder", "none"):
        params[names.src] = first([enc], "the source embedding")
    if cfg.share_embeddings in ("src_tgt", "none"):
        params["generator.kernel"] = first([out], "the output projection").T
    params = {name: np.ascontiguousarray(value) for name, value in params.items()}
    check_params(cfg, params, WHAT)
    return params


def read_fsmt(path: str | os.PathLike, **overrides: Any) -> tuple[ModelConfig, Params]:
    """(config, canonical params) of a Hugging Face FSMT directory."""
    directory = Path(path)
    if not (directory / CONFIG_FILE).is_file():
        raise CheckpointError(f"{directory}: not an FSMT directory (no {CONFIG_FILE})")
    hf = marian.read_config(directory)
    cfg = config_from_fsmt(hf, source=str(directory / CONFIG_FILE), **overrides)
    tensors = marian._read_weights(directory, cfg, WHAT)
    if cfg.share_embeddings == "none" and "share_embeddings" not in overrides:
        cfg = cfg.replace(share_embeddings=marian.sharing_of(tensors, "model.encoder.embed_tokens.weight",
                                                             "model.decoder.embed_tokens.weight",
                                                             "model.decoder.output_projection.weight"))
    return cfg, params_from_fsmt(cfg, tensors, table_rows(hf))


def is_fsmt(path: str | os.PathLike) -> bool:
    """A directory whose config.json says model_type "fsmt" (never raises)."""
    return marian.has_model_type(path, "fsmt")


# -- ours -> FSMT ----------------------------------------------------------------------------

def check_representable(cfg: ModelConfig) -> None:
    """Refuse, naming the field, a config that FSMT's code cannot compute."""
    problems = []
    if cfg.norm_first:
        problems.append("norm_first=true (FSMT is post-norm)")
    if cfg.has_final_norm:
        problems.append("final_norm=true (FSMT has no final LayerNorm)")
    if cfg.positional_encoding != POSITIONS:
        problems.append(f"positional_encoding={cfg.positional_encoding!r} (FSMT computes {POSITIONS})")
    if cfg.position_offset != cfg.pad_id + 1:
        problems.append(f"position_offset={cfg.position_offset} (FSMT's first token reads row pad_id + 1 "
                        f"= {cfg.pad_id + 1})")
    if cfg.layer_norm_eps != LAYER_NORM_EPS:
        problems.append(f"layer_norm_eps={cfg.layer_norm_eps} (FSMT's LayerNorm uses {LAYER_NORM_EPS})")
    if cfg.output_bias:
        problems.append("output_bias=true (FSMT's output projection has no bias)")
    if cfg.logit_scale != 1.0:
        problems.append(f"logit_scale={cfg.logit_scale!r} (FSMT's logits are output_projection(h))")
    if cfg.bos_id == cfg.pad_id:
        problems.append(f"bos_id={cfg.bos_id} equals pad_id (FSMT masks a start token equal to pad)")
    if problems:
        raise ConfigError("cannot write as FSMT: " + "; ".join(problems))


def config_to_fsmt(cfg: ModelConfig, dtype: str = "float32",
                   langs: Sequence[str] | None = None) -> dict[str, Any]:
    """The `config.json` of `cfg` as an FSMTForConditionalGeneration. `langs`: the language pair
    (FSMTConfig's field, read by its tokenizer only); left out (FSMTConfig's default) when None."""
    check_representable(cfg)
    out: dict[str, Any] = {
        "architectures": ["FSMTForConditionalGeneration"], "model_type": "fsmt", "is_encoder_decoder": True,
        "src_vocab_size": cfg.src_vocab_size, "tgt_vocab_size": cfg.tgt_vocab_size, "d_model": cfg.d_model,
        "encoder_layers": cfg.num_encoder_layers, "decoder_layers": cfg.num_decoder_layers,
        "encoder_attention_heads": cfg.num_heads, "decoder_attention_heads": cfg.num_heads,
        "encoder_ffn_dim": cfg.d_ff, "decoder_ffn_dim": cfg.d_ff,
        "activation_function": marian.ACTIVATIONS_OUT[cfg.activation], "dropout": cfg.dropout,
        "attention_dropout": cfg.attention_dropout, "activation_dropout": cfg.activation_dropout_rate,
        "scale_embedding": cfg.scale_embeddings, "max_position_embeddings": cfg.max_len,
        "pad_token_id": cfg.pad_id, "decoder_start_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id,
        # Our search never forces a token at the length limit; FSMTConfig's default forces eos there.
        "forced_eos_token_id": None, "bos_token_id": None,
        "tie_word_embeddings": cfg.share_embeddings == "all",
        # FSMTConfig's own search defaults (num_beams 5), made generation_config.json's: greedy.
        "num_beams": 1, "max_length": cfg.max_len, "length_penalty": 1.0, "early_stopping": False,
        "encoder_layerdrop": 0.0, "decoder_layerdrop": 0.0, "use_cache": True, "dtype": dtype,
    }
    if langs is not None:
        out["langs"] = list(langs)
    return out


def params_to_fsmt(cfg: ModelConfig, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """FSMT's state dict (the tensors `save_pretrained` writes) from canonical params, the
    positional tables recomputed."""
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
    names = embedding_names(cfg)
    out["model.decoder.embed_tokens.weight"] = np.asarray(params[names.tgt])
    if cfg.share_embeddings != "all":  # tie_word_embeddings false: three tensors, as save_pretrained writes
        out["model.encoder.embed_tokens.weight"] = np.asarray(params[names.src])
        output = params.get("generator.kernel")
        out["model.decoder.output_projection.weight"] = (np.asarray(params[names.tgt]) if output is None
                                                         else np.asarray(output).T)
    table = positional_encoding(POSITIONS, cfg.max_len + cfg.pad_id + 1, cfg.d_model)
    table[cfg.pad_id] = 0.0  # fairseq zeroes the padding row
    for side in ("encoder", "decoder"):
        out[f"model.{side}.embed_positions.weight"] = table.astype(dtype)
    return {name: np.ascontiguousarray(value) for name, value in out.items()}


def langs_of(companions: str | os.PathLike | None) -> list[str] | None:
    """The language pair that travels with a model (rosetta/interop/marian_files.py): an FSMT
    directory's config.json `langs`, else its tokenizer's (tokenizer_config.json, which a checkpoint's
    sidecar keeps); None when neither says."""
    if companions is None or not Path(companions).is_dir():
        return None
    for name in (CONFIG_FILE, "tokenizer_config.json"):
        path = Path(companions) / name
        if not path.is_file():
            continue
        data = read_json(path, "a model or tokenizer config", limit=marian.CONFIG_LIMIT,
                         schema={"langs": field("array")})
        langs = data.get("langs")
        if langs is None or (name == CONFIG_FILE and data.get("model_type") != "fsmt"):
            continue
        if len(langs) != 2 or not all(isinstance(lang, str) for lang in langs):
            raise ConfigError(f"{path}: langs {langs!r} is not a pair of language codes (FSMTTokenizer "
                              f"needs two, e.g. [\"en\", \"de\"])")
        return list(langs)
    return None


def write_fsmt(path: str | os.PathLike, cfg: ModelConfig, params: Mapping[str, np.ndarray],
               langs: Sequence[str] | None = None) -> Path:
    """Write a directory that `FSMTForConditionalGeneration.from_pretrained` loads; nothing is written
    on refusal."""
    import safetensors.numpy

    tensors = params_to_fsmt(cfg, params)  # refuses before anything is written
    dtype = next(name for name, dt in {**DTYPES, "float64": np.dtype(np.float64)}.items()
                 if dt == next(iter(tensors.values())).dtype)
    if dtype == "float64":  # FSMT's weights are float32 (or half): float64 is our in-memory type
        tensors, dtype = {k: v.astype(np.float32) for k, v in tensors.items()}, "float32"
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"{directory}: exists and is not a directory")
    atomic_write_bytes(directory / WEIGHTS_FILE, safetensors.numpy.save(tensors, metadata={"format": "pt"}))
    atomic_write_bytes(directory / "generation_config.json",
                       (json.dumps(marian.generation_config(cfg), indent=2) + "\n").encode())
    # config.json last: a directory is only an FSMT model once its weights are complete.
    config = json.dumps(config_to_fsmt(cfg, dtype, langs), indent=2) + "\n"
    atomic_write_bytes(directory / CONFIG_FILE, config.encode())
    return directory
