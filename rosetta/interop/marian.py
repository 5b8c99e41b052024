"""Hugging Face Marian (`MarianMTModel`, the opus-mt models) <-> the canonical checkpoint.

A Marian directory holds `config.json` and `model.safetensors` (or shards listed in
`model.safetensors.index.json`, or a `pytorch_model.bin`, read with `torch.load(weights_only=True)`
and never unpickled freely). NumPy and safetensors do the conversion: torch is needed only for a
`.bin`. Conventions of `transformers/models/marian/modeling_marian.py` (checked against 5.23):

- post-norm (`x = LN(x + sublayer(x))`), no final norm on either stack, `nn.LayerNorm`'s fixed
  epsilon 1e-5 (PITFALLS 2, 3);
- positions: `[sin | cos]` with the paper's frequencies, our `sinusoidal_concat` (PITFALLS 1), not
  stored (older saves store `model.*.embed_positions.weight`: checked against the table, dropped);
- `scale_embedding`: token embeddings times sqrt(d_model) (PITFALLS 8);
- `decoder_start_token_id` is our `bos_id`; opus-mt models set it to `pad_token_id` (PITFALLS 12);
- `share_encoder_decoder_embeddings` (one source/target table) and `tie_word_embeddings` (the
  output projection is the target table) give our `share_embeddings`; a separate target vocabulary
  is `decoder_vocab_size`;
- `final_logits_bias` [1, V] is always there: our `generator.bias` (`output_bias = true`);
- q/k/v/out projections are separate `nn.Linear`s with biases, `weight` [out, in] (PITFALLS 7).

| Marian name (layer i) | canonical name | transform |
| --- | --- | --- |
| `model.{en,de}coder.layers.i.self_attn.{q,k,v}_proj` | `….self_attn.{q,k,v}` | weight.T |
| `model.{en,de}coder.layers.i.self_attn.out_proj` | `….self_attn.o` | weight.T |
| `model.{en,de}coder.layers.i.self_attn_layer_norm` | `….self_attn_norm` | weight -> scale |
| `model.decoder.layers.i.encoder_attn.{q,k,v,out}_proj` | `….cross_attn.{q,k,v,o}` | weight.T |
| `model.decoder.layers.i.encoder_attn_layer_norm` | `decoder.layers.i.cross_attn_norm` | weight -> scale |
| `model.{en,de}coder.layers.i.fc1`, `fc2` | `….ffn.linear1`, `….ffn.linear2` | weight.T |
| `model.{en,de}coder.layers.i.final_layer_norm` | `….ffn_norm` | weight -> scale |
| `model.shared.weight` | `shared_embed.embedding` | as is |
| `model.encoder.embed_tokens.weight` | `src_embed.embedding` (unshared) | as is |
| `model.decoder.embed_tokens.weight` | `tgt_embed.embedding` (unshared) | as is |
| `lm_head.weight` [V, d] (untied) | `generator.kernel` [d, V] | transposed |
| `final_logits_bias` [1, V] | `generator.bias` [V] | row 0 |

Writing refuses what Marian cannot hold (pre-norm, final norms, another positional table or
epsilon, different heads or widths per stack are impossible on our side anyway). Absent biases
(`attention_bias`/`ffn_bias`/`output_bias` false) are written as zeros: the same function, exactly.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from rosetta.checkpoint import DTYPES, check_params
from rosetta.config import LIMITS, ModelConfig
from rosetta.errors import CheckpointError, ConfigError, RosettaError
from rosetta.files import atomic_write_bytes
from rosetta.interop.marian_fields import resolve_fields
from rosetta.json_input import Field, check_schema, field, read_json
from rosetta.params import Params, embedding_names, param_shapes
from rosetta.positional import positional_encoding

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
INDEX_FILE, PICKLE_FILE = "model.safetensors.index.json", "pytorch_model.bin"
LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default; Marian has no field for it

# MarianConfig's defaults (configuration_marian.py), for fields a config.json leaves out.
DEFAULTS: dict[str, Any] = {
    "vocab_size": 58101, "decoder_vocab_size": None, "max_position_embeddings": 1024,
    "encoder_layers": 12, "encoder_ffn_dim": 4096, "encoder_attention_heads": 16,
    "decoder_layers": 12, "decoder_ffn_dim": 4096, "decoder_attention_heads": 16,
    "activation_function": "gelu", "d_model": 1024, "dropout": 0.1, "attention_dropout": 0.0,
    "activation_dropout": 0.0, "decoder_start_token_id": 58100, "scale_embedding": False,
    "pad_token_id": 58100, "eos_token_id": 0, "share_encoder_decoder_embeddings": True,
    "tie_word_embeddings": True,
}
# Hugging Face activation names (activations.py ACT2CLS) -> ours: "gelu" and "gelu_python" are the
# exact erf form; gelu_new, gelu_pytorch_tanh, gelu_python_tanh, gelu_accurate and gelu_fast the tanh
# form (gelu_fast writes sqrt(2/pi) as 0.7978845608: 4e-12 relative, below float32's 6e-8).
ACTIVATIONS_IN = {"relu": "relu", "gelu": "gelu", "gelu_python": "gelu", "gelu_new": "gelu_tanh",
                  "gelu_pytorch_tanh": "gelu_tanh", "gelu_python_tanh": "gelu_tanh",
                  "gelu_accurate": "gelu_tanh", "gelu_fast": "gelu_tanh", "swish": "silu", "silu": "silu"}
# The JSON type of each field read from config.json (rosetta/json_input.py checks them first): null
# only where MarianConfig gives null a meaning (decoder_vocab_size: "as vocab_size"); a null elsewhere
# would silently become a default, and `scale_embedding: "yes"` would read as true.
CONFIG_SCHEMA: dict[str, Field] = {
    "model_type": field("string"), "decoder_vocab_size": field("integer", "null"),
    "activation_function": field("string"),
    **{name: field("integer") for name in (
        "vocab_size", "max_position_embeddings", "encoder_layers", "encoder_ffn_dim",
        "encoder_attention_heads", "decoder_layers", "decoder_ffn_dim", "decoder_attention_heads", "d_model",
        "decoder_start_token_id", "pad_token_id", "eos_token_id")},
    **{name: field("number") for name in ("dropout", "attention_dropout", "activation_dropout")},
    **{name: field("boolean") for name in (
        "scale_embedding", "share_encoder_decoder_embeddings", "tie_word_embeddings")},
}
CONFIG_LIMIT = 2**20  # bytes of config.json read at most: a Marian config takes about 1.5 kB
INDEX_SCHEMA = {"weight_map": field("object", required=True)}
INDEX_LIMIT = 64 * 2**20  # bytes of the shard index: a name and a file per tensor, ~100 bytes each
ACTIVATIONS_OUT = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_new", "silu": "swish"}
# (share_encoder_decoder_embeddings, tie_word_embeddings) <-> share_embeddings
SHARING = {(True, True): "all", (True, False): "src_tgt", (False, True): "decoder", (False, False): "none"}

LINEARS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "out_proj": "o"}


def _layer_names(side: str, i: int) -> dict[str, tuple[str, str]]:
    """Marian module -> (canonical module, kind) for one layer; kind is "linear" or "norm"."""
    ours, theirs = f"{side}.layers.{i}", f"model.{side}.layers.{i}"
    attn = [("self_attn", "self_attn")] + ([("encoder_attn", "cross_attn")] if side == "decoder" else [])
    out = {}
    for their_attn, our_attn in attn:
        for their_proj, our_proj in LINEARS.items():
            out[f"{theirs}.{their_attn}.{their_proj}"] = (f"{ours}.{our_attn}.{our_proj}", "linear")
        out[f"{theirs}.{their_attn}_layer_norm"] = (f"{ours}.{our_attn}_norm", "norm")
    out[f"{theirs}.fc1"] = (f"{ours}.ffn.linear1", "linear")
    out[f"{theirs}.fc2"] = (f"{ours}.ffn.linear2", "linear")
    out[f"{theirs}.final_layer_norm"] = (f"{ours}.ffn_norm", "norm")
    return out


def module_map(cfg: ModelConfig) -> dict[str, tuple[str, str]]:
    """Every Marian layer module of `cfg` -> (canonical module, kind)."""
    out: dict[str, tuple[str, str]] = {}
    for i in range(cfg.num_encoder_layers):
        out.update(_layer_names("encoder", i))
    for i in range(cfg.num_decoder_layers):
        out.update(_layer_names("decoder", i))
    return out


# -- Marian -> ours ---------------------------------------------------------------------------

def config_from_marian(hf: Mapping[str, Any], *, source: str = CONFIG_FILE, **overrides: Any) -> ModelConfig:
    """Our config for a Marian `config.json` (MarianConfig's defaults for absent fields), its fields'
    types checked first; `source` names the file in the messages."""
    hf = resolve_fields(hf, set(DEFAULTS), source)  # aliases, and the fields MarianMTModel ignores
    check_schema(hf, CONFIG_SCHEMA, source)
    if hf.get("model_type", "marian") != "marian":
        raise ConfigError(f"{source}: model_type {hf.get('model_type')!r} is not 'marian'")
    if hf.get("activation_function", "gelu") not in ACTIVATIONS_IN:
        raise ConfigError(f"{source}: activation_function {hf['activation_function']!r}: rosetta's model "
                          f"cannot compute it (it computes {', '.join(ACTIVATIONS_IN)})")
    c = {**DEFAULTS, **{k: v for k, v in hf.items() if k in DEFAULTS and v is not None}}
    for mine, theirs in (("encoder_attention_heads", "decoder_attention_heads"),
                         ("encoder_ffn_dim", "decoder_ffn_dim")):
        if c[mine] != c[theirs]:
            raise ConfigError(f"{source}: {mine}={c[mine]} differs from {theirs}={c[theirs]}; one "
                              f"value serves both stacks here (num_heads, d_ff)")
    share = SHARING[(c["share_encoder_decoder_embeddings"], c["tie_word_embeddings"])]
    _check_decoder_vocab(c["decoder_vocab_size"], c["vocab_size"], share, source)
    own_vocab = c["decoder_vocab_size"] or c["vocab_size"]
    tgt_vocab = c["vocab_size"] if share in ("all", "src_tgt") else own_vocab
    fields = dict(
        src_vocab_size=c["vocab_size"], tgt_vocab_size=tgt_vocab, d_model=c["d_model"],
        num_heads=c["encoder_attention_heads"], num_encoder_layers=c["encoder_layers"],
        num_decoder_layers=c["decoder_layers"], d_ff=c["encoder_ffn_dim"], dropout=c["dropout"],
        activation_dropout=c["activation_dropout"], attention_dropout=c["attention_dropout"],
        activation=ACTIVATIONS_IN[c["activation_function"]], norm_first=False, final_norm=False,
        layer_norm_eps=LAYER_NORM_EPS, attention_bias=True, ffn_bias=True,
        scale_embeddings=bool(c["scale_embedding"]), positional_encoding="sinusoidal_concat",
        share_embeddings=share, output_bias=True, max_len=c["max_position_embeddings"],
        pad_id=c["pad_token_id"], bos_id=c["decoder_start_token_id"], eos_id=c["eos_token_id"],
    )
    return ModelConfig.from_dict({**fields, **overrides})


def _check_decoder_vocab(size: int | None, vocab_size: int, share: str, source: str) -> None:
    """decoder_vocab_size within our bound and, with one table for both sides, the table's size:
    MarianMTModel builds the decoder's table and its loss with it even then."""
    if size is None:
        return
    bound = LIMITS["tgt_vocab_size"]
    if not 1 <= size <= bound:
        raise ConfigError(f"{source}: decoder_vocab_size must be in [1, {bound:,}] (a bound that keeps "
                          f"untrusted files from exhausting memory), got {size:,}")
    if share in ("all", "src_tgt") and size != vocab_size:
        raise ConfigError(f"{source}: decoder_vocab_size {size:,} must equal vocab_size {vocab_size:,} "
                          f"when share_encoder_decoder_embeddings is true (one table serves both sides)")


def _tensor_names(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name a Marian file of `cfg` may hold, with its shape (tied copies included)."""
    d = cfg.d_model
    shapes = {"final_logits_bias": (1, cfg.tgt_vocab_size), "lm_head.weight": (cfg.tgt_vocab_size, d),
              "model.shared.weight": (cfg.src_vocab_size, d),
              "model.encoder.embed_tokens.weight": (cfg.src_vocab_size, d),
              "model.decoder.embed_tokens.weight": (cfg.tgt_vocab_size, d),
              "model.encoder.embed_positions.weight": (cfg.max_len, d),
              "model.decoder.embed_positions.weight": (cfg.max_len, d)}
    ours = param_shapes(cfg)
    for theirs, (mine, kind) in module_map(cfg).items():
        for suffix in ("kernel", "scale"):
            if f"{mine}.{suffix}" in ours:
                shape = ours[f"{mine}.{suffix}"]
                shapes[f"{theirs}.weight"] = shape[::-1] if kind == "linear" else shape
        shapes[f"{theirs}.bias"] = (shape[-1],) if kind == "linear" else shape
    return shapes


def _first_present(tensors: Mapping[str, np.ndarray], names: list[str], what: str,
                   source: str = "Marian weights") -> np.ndarray:
    """The first of `names` present; every other one present must hold the same values (tied)."""
    found = [name for name in names if name in tensors]
    if not found:
        raise CheckpointError(f"{source}: missing {what} (one of {', '.join(names)})")
    for name in found[1:]:
        if not np.array_equal(tensors[name], tensors[found[0]]):
            raise CheckpointError(f"{source}: {name} differs from {found[0]}, but the config ties them")
    return tensors[found[0]]


def params_from_marian(cfg: ModelConfig, tensors: Mapping[str, np.ndarray]) -> Params:
    """Canonical parameters from a Marian state dict (checked name by name, shape by shape)."""
    expected = _tensor_names(cfg)
    for name, value in tensors.items():
        if name not in expected:
            raise CheckpointError(f"Marian weights: unexpected tensor {name} for this config")
        if tuple(value.shape) != expected[name]:
            raise CheckpointError(f"Marian weights: {name} has shape {tuple(value.shape)}, the config "
                                  f"expects {expected[name]}")
    for side in ("encoder", "decoder"):  # older saves store the table: it must be ours
        name = f"model.{side}.embed_positions.weight"
        if name in tensors:
            table = positional_encoding("sinusoidal_concat", cfg.max_len, cfg.d_model)
            if not np.allclose(tensors[name].astype(np.float64), table, atol=1e-6):
                raise CheckpointError(f"Marian weights: {name} is not the sinusoidal [sin | cos] table")
    params: Params = {}
    for theirs, (mine, kind) in module_map(cfg).items():
        weight = _first_present(tensors, [f"{theirs}.weight"], f"{theirs}.weight")
        if kind == "linear":
            params[f"{mine}.kernel"] = weight.T
        else:
            params[f"{mine}.scale"] = weight
        params[f"{mine}.bias"] = _first_present(tensors, [f"{theirs}.bias"], f"{theirs}.bias")
    src, tgt, out = "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "lm_head.weight"
    shared = "model.shared.weight"
    names = embedding_names(cfg)
    if cfg.share_embeddings == "all":
        params[names.src] = _first_present(tensors, [shared, src, tgt, out], "the shared embedding")
    elif cfg.share_embeddings == "src_tgt":
        params[names.src] = _first_present(tensors, [shared, src, tgt], "the shared embedding")
    elif cfg.share_embeddings == "decoder":
        params[names.src] = _first_present(tensors, [src], "the source embedding")
        params[names.tgt] = _first_present(tensors, [tgt, out], "the target embedding")
    else:
        params[names.src] = _first_present(tensors, [src], "the source embedding")
        params[names.tgt] = _first_present(tensors, [tgt], "the target embedding")
    if cfg.share_embeddings in ("none", "src_tgt"):
        params["generator.kernel"] = _first_present(tensors, [out], "lm_head.weight").T
    params["generator.bias"] = _first_present(tensors, ["final_logits_bias"], "final_logits_bias")[0]
    params = {name: np.ascontiguousarray(value) for name, value in params.items()}
    check_params(cfg, params, "Marian weights")
    return params


def _read_weights(directory: Path, cfg: ModelConfig, what: str = "Marian weights") -> dict[str, np.ndarray]:
    """The state dict of a Hugging Face directory (Marian's, FSMT's: `what` names it in messages):
    safetensors (single or sharded), else a weights-only .bin."""
    from rosetta.checkpoint import read_safetensors

    if (directory / WEIGHTS_FILE).is_file():
        return read_safetensors(directory / WEIGHTS_FILE, what)[1]
    if (directory / INDEX_FILE).is_file():
        index = read_json(directory / INDEX_FILE, "a shard index", limit=INDEX_LIMIT, schema=INDEX_SCHEMA)
        shards = sorted(set(index["weight_map"].values()))
        if not shards or any(Path(s).name != s for s in shards):
            raise CheckpointError(f"{directory / INDEX_FILE}: no weight_map of shard file names")
        tensors: dict[str, np.ndarray] = {}
        for shard in shards:
            tensors.update(read_safetensors(directory / shard, f"{what} shard")[1])
        return tensors
    if (directory / PICKLE_FILE).is_file():
        return _read_pickle(directory / PICKLE_FILE)
    raise CheckpointError(f"{directory}: no {WEIGHTS_FILE}, {INDEX_FILE} or {PICKLE_FILE}")


def _read_pickle(path: Path) -> dict[str, np.ndarray]:
    """A `pytorch_model.bin` through `torch.load(weights_only=True)`: tensors only, no code run."""
    try:
        import torch
    except ImportError:
        raise CheckpointError(f"{path}: reading a pytorch_model.bin needs torch; convert it to "
                              f"safetensors or install torch") from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - the unpickler's refusals come in many types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: refused by torch.load(weights_only=True): {first}") from None
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: not a state dict of tensors")
    # NumPy has no bfloat16 of torch's: float32 holds every bfloat16 value exactly.
    return {name: (value.float() if value.dtype == torch.bfloat16 else value).numpy()
            for name, value in state.items()}


def read_marian(path: str | os.PathLike, **overrides: Any) -> tuple[ModelConfig, Params]:
    """(config, canonical params) of a Hugging Face Marian directory."""
    directory = Path(path)
    if not (directory / CONFIG_FILE).is_file():
        raise CheckpointError(f"{directory}: not a Marian directory (no {CONFIG_FILE})")
    cfg = config_from_marian(read_config(directory), source=str(directory / CONFIG_FILE), **overrides)
    tensors = _read_weights(directory, cfg)
    if (cfg.share_embeddings == "src_tgt" and "share_embeddings" not in overrides
            and _separate_tables(tensors)):
        # transformers >= 5 ties the encoder and decoder tables to `shared` only together with
        # tie_word_embeddings; otherwise it computes with three tables, and so do we.
        cfg = cfg.replace(share_embeddings="none")
    return cfg, params_from_marian(cfg, tensors)


def _separate_tables(tensors: Mapping[str, np.ndarray]) -> bool:
    """True when the encoder and decoder token tables are both stored and differ from each other
    or from `model.shared`."""
    enc = tensors.get("model.encoder.embed_tokens.weight")
    dec = tensors.get("model.decoder.embed_tokens.weight")
    if enc is None or dec is None:
        return False
    shared = tensors.get("model.shared.weight", enc)
    return not (np.array_equal(enc, dec) and np.array_equal(enc, shared))


def read_config(directory: str | os.PathLike) -> dict[str, Any]:
    """The JSON object of `directory`'s config.json, read within rosetta/json_input.py's bounds (its
    fields are checked by config_from_marian); a ConfigError naming the file otherwise."""
    return read_json(Path(directory) / CONFIG_FILE, "a model config", limit=CONFIG_LIMIT)


def has_model_type(path: str | os.PathLike, model_type: str) -> bool:
    """A directory whose config.json says `model_type` (never raises): Marian's, FSMT's, M2M100's."""
    try:
        return read_config(path).get("model_type") == model_type
    except RosettaError:
        return False


def is_marian(path: str | os.PathLike) -> bool:
    """A directory whose config.json says model_type "marian" (never raises)."""
    return has_model_type(path, "marian")


def sharing_of(tensors: Mapping[str, np.ndarray], enc: str, dec: str, out: str) -> str:
    """The sharing that three untied tables (tensor names `enc`, `dec`, `out`) show: equal tables
    compute as one (SPEC §1 share_embeddings); "none" where one is missing (the reader names it)."""
    tables = [tensors.get(name) for name in (enc, dec, out)]
    if any(table is None for table in tables):
        return "none"
    enc_t, dec_t, out_t = tables
    return SHARING[(bool(np.array_equal(enc_t, dec_t)), bool(np.array_equal(out_t, dec_t)))]


# -- ours -> Marian ---------------------------------------------------------------------------

def check_representable(cfg: ModelConfig) -> None:
    """Refuse, naming the field, a config that Marian's code cannot compute."""
    problems = []
    if cfg.norm_first:
        problems.append("norm_first=true (Marian is post-norm)")
    if cfg.has_final_norm:
        problems.append("final_norm=true (Marian has no final LayerNorm)")
    if cfg.positional_encoding != "sinusoidal_concat":
        problems.append(f"positional_encoding={cfg.positional_encoding!r} (Marian computes "
                        f"sinusoidal_concat)")
    if cfg.layer_norm_eps != LAYER_NORM_EPS:
        problems.append(f"layer_norm_eps={cfg.layer_norm_eps} (Marian's LayerNorm uses {LAYER_NORM_EPS})")
    if cfg.position_offset != 0:
        problems.append(f"position_offset={cfg.position_offset} (Marian's first token reads row 0)")
    if cfg.logit_scale != 1.0:
        problems.append(f"logit_scale={cfg.logit_scale!r} (MarianMTModel's logits are lm_head(h) + "
                        f"final_logits_bias; its config has no logit scale)")
    if problems:
        raise ConfigError("cannot write as Marian: " + "; ".join(problems))


def config_to_marian(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """The `config.json` of `cfg` as a MarianMTModel."""
    check_representable(cfg)
    share, tie = next(key for key, value in SHARING.items() if value == cfg.share_embeddings)
    return {
        "architectures": ["MarianMTModel"], "model_type": "marian", "is_encoder_decoder": True,
        "vocab_size": cfg.src_vocab_size, "decoder_vocab_size": cfg.tgt_vocab_size,
        "d_model": cfg.d_model, "encoder_layers": cfg.num_encoder_layers,
        "decoder_layers": cfg.num_decoder_layers,
        "encoder_attention_heads": cfg.num_heads, "decoder_attention_heads": cfg.num_heads,
        "encoder_ffn_dim": cfg.d_ff, "decoder_ffn_dim": cfg.d_ff,
        "activation_function": ACTIVATIONS_OUT[cfg.activation], "dropout": cfg.dropout,
        "attention_dropout": cfg.attention_dropout, "activation_dropout": cfg.activation_dropout_rate,
        "scale_embedding": cfg.scale_embeddings, "max_position_embeddings": cfg.max_len,
        "pad_token_id": cfg.pad_id, "decoder_start_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id,
        # Our search never forces a token at the length limit; Marian's default forces eos there.
        "forced_eos_token_id": None, "bos_token_id": None,
        "share_encoder_decoder_embeddings": share, "tie_word_embeddings": tie,
        "encoder_layerdrop": 0.0, "decoder_layerdrop": 0.0, "use_cache": True, "dtype": dtype,
    }


def generation_config(cfg: ModelConfig) -> dict[str, Any]:
    """`generation_config.json`: greedy by default, pad never generated (as our search does)."""
    return {"decoder_start_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id, "pad_token_id": cfg.pad_id,
            "bad_words_ids": [[cfg.pad_id]], "forced_eos_token_id": None, "num_beams": 1,
            "max_length": cfg.max_len}


def params_to_marian(cfg: ModelConfig, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Marian's state dict (the tensors `save_pretrained` writes) from canonical params."""
    check_representable(cfg)
    check_params(cfg, params)
    dtype = np.asarray(next(iter(params.values()))).dtype

    def zeros(n: int) -> np.ndarray:  # an absent bias, exactly
        return np.zeros(n, dtype=dtype)

    out: dict[str, np.ndarray] = {}
    for theirs, (mine, kind) in module_map(cfg).items():
        if kind == "linear":
            kernel = np.asarray(params[f"{mine}.kernel"])
            out[f"{theirs}.weight"] = kernel.T
            out[f"{theirs}.bias"] = np.asarray(params.get(f"{mine}.bias", zeros(kernel.shape[1])))
        else:
            out[f"{theirs}.weight"] = np.asarray(params[f"{mine}.scale"])
            out[f"{theirs}.bias"] = np.asarray(params[f"{mine}.bias"])
    names = embedding_names(cfg)
    if cfg.share_embeddings in ("all", "src_tgt"):
        table = np.asarray(params[names.src])
        out["model.shared.weight"] = table
        if cfg.share_embeddings == "src_tgt":  # what save_pretrained writes for shared, untied
            out["model.encoder.embed_tokens.weight"] = out["model.decoder.embed_tokens.weight"] = table
    else:
        out["model.encoder.embed_tokens.weight"] = np.asarray(params[names.src])
        out["model.decoder.embed_tokens.weight"] = np.asarray(params[names.tgt])
    if cfg.share_embeddings in ("none", "src_tgt"):
        out["lm_head.weight"] = np.asarray(params["generator.kernel"]).T
    out["final_logits_bias"] = np.asarray(params.get("generator.bias", zeros(cfg.tgt_vocab_size)))[None, :]
    return {name: np.ascontiguousarray(value) for name, value in out.items()}


def write_marian(path: str | os.PathLike, cfg: ModelConfig, params: Mapping[str, np.ndarray]) -> Path:
    """Write a directory that `MarianMTModel.from_pretrained` loads; nothing is written on refusal."""
    import safetensors.numpy

    tensors = params_to_marian(cfg, params)  # refuses before anything is written
    dtype = next(name for name, dt in {**DTYPES, "float64": np.dtype(np.float64)}.items()
                 if dt == next(iter(tensors.values())).dtype)
    if dtype == "float64":  # Marian's weights are float32 (or half): float64 is our in-memory type
        tensors, dtype = {k: v.astype(np.float32) for k, v in tensors.items()}, "float32"
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"{directory}: exists and is not a directory")
    data = safetensors.numpy.save(tensors, metadata={"format": "pt"})
    atomic_write_bytes(directory / WEIGHTS_FILE, data)
    atomic_write_bytes(directory / "generation_config.json",
                       (json.dumps(generation_config(cfg), indent=2) + "\n").encode())
    # config.json last: a directory is only a Marian model once its weights are complete.
    config = json.dumps(config_to_marian(cfg, dtype), indent=2) + "\n"
    atomic_write_bytes(directory / CONFIG_FILE, config.encode())
    return directory


def hf_length_penalty(length: np.ndarray | int, length_penalty: float) -> np.ndarray:
    """Hugging Face's beam score divisor: `length ** length_penalty` (PITFALLS 15), vs Wu et al."""
    return np.asarray(length, dtype=np.float64) ** length_penalty
