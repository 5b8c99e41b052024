"""Our own runs -> a CTranslate2 model directory, through CTranslate2's Python spec API.

The Hugging Face route (rosetta/interop/ctranslate2.py) needs what CTranslate2's Marian loader
assumes (pad last, a zero start row); a model trained here has `<pad>` at 0 and learns its start
token's row. So its weights are put into `ctranslate2.specs.TransformerSpec` directly, the way
CTranslate2's own fairseq and OpenNMT-py converters fill it (converters/fairseq.py, opennmt_py.py,
read at 4.8.5), and `spec.save` writes `model.bin` and the vocabularies. The spec says the same
model we compute:

- pre-norm or post-norm (`pre_norm`), a final LayerNorm on each stack exactly when pre-norm
  (CTranslate2 has no post-norm final norm and no pre-norm without one: other combinations are
  refused), LayerNorm epsilon in `config.layer_norm_epsilon`;
- self-attention's q, k, v fused in one linear (`utils.fuse_linear`), cross-attention's k and v;
  weights as `nn.Linear` holds them, [out, in] (our kernels transposed);
- the positional table ours (rosetta.positional.model_table: the offset already applied), every
  row up to max_len; `scale_embeddings` as ours; the output projection our generator (or the tied
  table), its bias if any; `logit_scale` other than 1 is refused (CTranslate2 has none);
- the decoder starts from the embedding of `bos_id` (`config.decoder_start_token`): no zero row
  needed; tokens by id from the run's tokenizer (our BPE: `tokenizer.json`), one list per side.

CTranslate2 may emit `<pad>`, which our search never does: pass `suppress_sequences=[["<pad>"]]`
(docs/ctranslate2.md).

FSMT (`write_fsmt_spec`, fairseq's WMT19 Transformer, rosetta/interop/fsmt.py) goes the same way:
CTranslate2's TransformersConverter has no FSMT loader, and what its fairseq converter fills for
fairseq's transformer is what the spec above says of an FSMT config (post-norm, no final norm,
positions from row pad + 1, `embed_scale`, the decoder started from `</s>`, the output projection),
with FSMTTokenizer's two vocabularies (`vocab-src.json`, `vocab-tgt.json`) by id.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rosetta.checkpoint import check_params
from rosetta.config import ModelConfig, read_json_object
from rosetta.errors import ConfigError, TokenizerError
from rosetta.params import embedding_names
from rosetta.positional import model_table
from rosetta.tokenizer import BOS, FSMT_SRC_VOCAB, FSMT_TGT_VOCAB, UNK, Tokenizer

ACTIVATIONS = {"relu": "RELU", "gelu": "GELU", "gelu_tanh": "GELUTanh", "silu": "SWISH"}


def check_spec(cfg: ModelConfig, params: Mapping[str, Any]) -> None:
    """Refuse, naming the field, what TransformerSpec cannot say."""
    check_params(cfg, params)
    if cfg.has_final_norm != cfg.norm_first:
        raise ConfigError(f"final_norm={cfg.has_final_norm} with norm_first={cfg.norm_first}: CTranslate2's "
                          f"Transformer has a final LayerNorm exactly when it is pre-norm")
    if cfg.logit_scale != 1.0:
        raise ConfigError(f"logit_scale={cfg.logit_scale:g}: CTranslate2's Transformer has no logit scale")


def _linear(spec: Any, params: Mapping[str, Any], *names: str) -> None:
    """spec.weight [out, in] (and bias) from our kernels [in, out], several fused along out."""
    spec.weight = np.concatenate([np.asarray(params[f"{n}.kernel"]).T for n in names], axis=0)
    if f"{names[0]}.bias" in params:
        spec.bias = np.concatenate([np.asarray(params[f"{n}.bias"]) for n in names])


def _norm(spec: Any, params: Mapping[str, Any], name: str) -> None:
    spec.gamma, spec.beta = np.asarray(params[f"{name}.scale"]), np.asarray(params[f"{name}.bias"])


def _stack(spec: Any, cfg: ModelConfig, params: Mapping[str, Any], side: str, table: np.ndarray) -> None:
    # The encoder's embeddings are a list (one a source feature), the decoder's one spec.
    embeddings = spec.embeddings[0] if isinstance(spec.embeddings, list) else spec.embeddings
    embeddings.weight = table
    spec.scale_embeddings = cfg.scale_embeddings
    spec.position_encodings.encodings = model_table(cfg, cfg.max_len).astype(table.dtype)
    if cfg.has_final_norm:
        _norm(spec.layer_norm, params, f"{side}.final_norm")
    for i, layer in enumerate(spec.layer):
        p = f"{side}.layers.{i}"
        _linear(layer.self_attention.linear[0], params, *(f"{p}.self_attn.{x}" for x in "qkv"))
        _linear(layer.self_attention.linear[1], params, f"{p}.self_attn.o")
        _norm(layer.self_attention.layer_norm, params, f"{p}.self_attn_norm")
        if side == "decoder":
            _linear(layer.attention.linear[0], params, f"{p}.cross_attn.q")
            _linear(layer.attention.linear[1], params, f"{p}.cross_attn.k", f"{p}.cross_attn.v")
            _linear(layer.attention.linear[2], params, f"{p}.cross_attn.o")
            _norm(layer.attention.layer_norm, params, f"{p}.cross_attn_norm")
        _linear(layer.ffn.linear_0, params, f"{p}.ffn.linear1")
        _linear(layer.ffn.linear_1, params, f"{p}.ffn.linear2")
        _norm(layer.ffn.layer_norm, params, f"{p}.ffn_norm")


def tokens_by_id(tokenizer: Tokenizer, size: int, where: str) -> list[str]:
    """The tokenizer's token of every id below `size` (the model's vocabulary)."""
    tokens = [tokenizer.id_to_token(i) for i in range(size)]
    if None in tokens:
        raise ConfigError(f"{where}: has no token for id {tokens.index(None)} of the model's {size}")
    return tokens


def fsmt_tokens(path: str | os.PathLike, size: int) -> list[str]:
    """The tokens of an FSMT vocabulary file (token -> id) in id order, `size` of them (the model's
    table). CTranslate2 numbers tokens by their place in the list: a place that is not its token's id
    (a gap, a repeated id, an id past the table) is refused in one line."""
    vocab = read_json_object(Path(path), "the vocabulary", TokenizerError)
    odd = next((t for t, i in vocab.items() if isinstance(i, bool) or not isinstance(i, int)), None)
    if odd is not None:
        raise TokenizerError(f"{path}: {odd!r} has id {vocab[odd]!r}; ids are integers")
    tokens = sorted(vocab, key=vocab.__getitem__)
    for place, token in enumerate(tokens):
        if vocab[token] != place:
            raise TokenizerError(f"{path}: {token!r} has id {vocab[token]!r} at place {place} of the list "
                                 f"by id: CTranslate2 numbers tokens by their place, so it would read "
                                 f"and write other tokens than the model's")
    if len(tokens) != size:
        raise TokenizerError(f"{path}: {len(tokens)} tokens, but the model's table has {size} rows")
    return tokens


def _save(out: str | os.PathLike, cfg: ModelConfig, params: Mapping[str, Any], src_tokens: Sequence[str],
          tgt_tokens: Sequence[str], bos: str, unk: str) -> Path:
    """Fill TransformerSpec with (cfg, params) and the vocabularies by id, save it into `out`, a folder
    that does not exist yet (ctranslate2.py moves it into place)."""
    import ctranslate2.specs as specs
    from ctranslate2.specs import common_spec

    check_spec(cfg, params)
    names = embedding_names(cfg)
    src_table, tgt_table = np.asarray(params[names.src]), np.asarray(params[names.tgt])
    spec = specs.TransformerSpec.from_config(
        (cfg.num_encoder_layers, cfg.num_decoder_layers), cfg.num_heads, pre_norm=cfg.norm_first,
        no_final_norm=not cfg.has_final_norm,
        activation=getattr(common_spec.Activation, ACTIVATIONS[cfg.activation]))
    _stack(spec.encoder, cfg, params, "encoder", src_table)
    _stack(spec.decoder, cfg, params, "decoder", tgt_table)
    out_kernel = params.get("generator.kernel")
    spec.decoder.projection.weight = tgt_table if out_kernel is None else np.asarray(out_kernel).T
    if cfg.output_bias:
        spec.decoder.projection.bias = np.asarray(params["generator.bias"])
    spec.register_source_vocabulary(list(src_tokens))
    spec.register_target_vocabulary(list(tgt_tokens))
    spec.config.layer_norm_epsilon = cfg.layer_norm_eps
    spec.config.bos_token, spec.config.eos_token, spec.config.unk_token = bos, tgt_tokens[cfg.eos_id], unk
    spec.config.decoder_start_token = tgt_tokens[cfg.bos_id]
    spec.validate()
    spec.optimize(quantization=None)
    Path(out).mkdir()
    spec.save(str(out))
    return Path(out)


def write_spec(out: str | os.PathLike, cfg: ModelConfig, params: Mapping[str, Any],
               tokenizer: str | os.PathLike) -> Path:
    """Save the CTranslate2 model of (cfg, params) with the BPE `tokenizer` (a tokenizer.json) into
    `out`, a folder that does not exist yet (ctranslate2.py moves it into place)."""
    check_spec(cfg, params)
    tok = Tokenizer.load(tokenizer)
    src_tokens = tokens_by_id(tok, cfg.src_vocab_size, str(tokenizer))
    tgt_tokens = tokens_by_id(tok, cfg.tgt_vocab_size, str(tokenizer))
    # Our byte-level BPE never emits <unk>; CTranslate2 needs one named.
    unk = UNK if UNK in tgt_tokens else tgt_tokens[cfg.eos_id]
    return _save(out, cfg, params, src_tokens, tgt_tokens, tgt_tokens[cfg.bos_id], unk)


def write_fsmt_spec(out: str | os.PathLike, cfg: ModelConfig, params: Mapping[str, Any],
                    directory: str | os.PathLike) -> Path:
    """Save the CTranslate2 model of (cfg, params) with FSMTTokenizer's vocabularies (`directory`'s
    vocab-src.json and vocab-tgt.json, checked against the model by marian_files.check_companions)
    into `out`, a folder that does not exist yet. As CTranslate2's fairseq converter: fairseq's
    `<s>` is bos, `<unk>` unk, the decoder starts from `bos_id` (`</s>`), eos is `</s>`."""
    check_spec(cfg, params)
    directory = Path(directory)
    src_tokens = fsmt_tokens(directory / FSMT_SRC_VOCAB, cfg.src_vocab_size)
    tgt_tokens = fsmt_tokens(directory / FSMT_TGT_VOCAB, cfg.tgt_vocab_size)
    # fairseq's converter renames <pad> to OpenNMT's <blank> (_get_vocab); kept here, so that each
    # token is FSMTTokenizer's. Its add_source_eos is not set: FSMTTokenizer's ids end with </s>
    # already, as the tokens CTranslate2's Hugging Face loaders take do.
    bos = BOS if BOS in tgt_tokens else tgt_tokens[cfg.bos_id]
    unk = UNK if UNK in src_tokens and UNK in tgt_tokens else tgt_tokens[cfg.eos_id]
    return _save(out, cfg, params, src_tokens, tgt_tokens, bos, unk)
