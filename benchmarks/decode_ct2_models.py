"""The models benchmarks/decode_ct2.py decodes (`--model`): random weights of base size, written as the
Hugging Face directory CTranslate2's own converter reads, with a tokenizer it loads. The pieces never
go through SentencePiece (the benchmark feeds ids and tokens), so each directory's SentencePiece
model is a tiny one; vocab.json holds made-up pieces `▁w{i}` up to the vocabulary's size.

- marian: opus-mt's shape (post-norm, swish, `<pad>` last with a zero row and the decoder start,
  one shared table, an output bias), eos banned through that bias.
- m2m100: M2M100's shape (pre-norm, a final LayerNorm on each stack, ReLU, `scale_embedding`, one
  shared table that is the output projection, positions from row pad_id + 1; fairseq's ids `<s>` 0,
  `<pad>` 1, `</s>` 2 = decoder start, `<unk>` 3, then the pieces, M2M100's 100 language codes and
  8 "madeupword" rows), an M2M100Tokenizer directory (rosetta/interop/m2m100_tokenizer.py). The
  source is `__de__ pieces </s>`; each engine forces `__en__` first (our generate's forced_first,
  CTranslate2's target_prefix). M2M100 has no output bias, and our generate may not ban eos (a
  search without it never ends), so eos is kept from winning through the weights instead: on
  EOS_DIMS dimensions the decoder's final LayerNorm gives a constant (scale 0, bias EOS_PUSH), every
  row of the shared table is 0 there but eos's, which is -1: eos's logit is lowered by
  EOS_DIMS * EOS_PUSH (32, against logits of about unit scale) and no other logit changes. Every
  engine then emits exactly its length limit. `<pad>`'s row is zero (M2M100's padding_idx) and
  CTranslate2 suppresses it, as our search bans pad.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from rosetta import init_params
from rosetta.config import ModelConfig
from rosetta.files import atomic_write_bytes

MODELS = ("marian", "m2m100")
BASE = {"vocab_size": 32000, "d_model": 512, "encoder_layers": 6, "decoder_layers": 6,
        "encoder_attention_heads": 8, "decoder_attention_heads": 8, "encoder_ffn_dim": 2048,
        "decoder_ffn_dim": 2048, "activation_function": "swish", "scale_embedding": True,
        "max_position_embeddings": 512, "eos_token_id": 0, "dropout": 0.0}
QUICK = {**BASE, "vocab_size": 512, "d_model": 64, "encoder_layers": 2, "decoder_layers": 2,
         "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 128,
         "decoder_ffn_dim": 128, "max_position_embeddings": 64}
# M2M100's: BASE's sizes (vocabulary 32,000 including the codes and made-up words), M2M100's ids.
M2M100_FIELDS = {"activation_function": "relu", "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
                 "decoder_start_token_id": 2, "attention_dropout": 0.0, "activation_dropout": 0.0}
SRC_LANG, TGT_LANG = "de", "en"
MADEUP_WORDS = 8  # M2M100's num_madeup_words
EOS_DIMS, EOS_PUSH = 8, 4.0  # eos's logit lowered by 32 (the module docstring)


class Built(NamedTuple):
    """A model written for the benchmark: what each engine needs to decode it alike."""

    cfg: ModelConfig
    params: dict[str, np.ndarray]
    directory: Path  # the Hugging Face directory convert() reads
    src_first: list[int]  # ids every source starts with (M2M100: the source language code)
    words: tuple[int, int]  # [low, high): the ids of the made-up pieces the random sources draw from
    forced_first: int | None  # our generate's forced first target token
    ct2_options: dict[str, Any]  # translate_batch's extra arguments (target_prefix is set per batch)
    prefix: str | None  # CTranslate2's target_prefix token (forced_first's piece)
    eos: str  # how eos is kept out, for the results' settings


def _tiny_spm(model_type: str = "unigram") -> bytes:
    import sentencepiece as spm

    model = tempfile.SpooledTemporaryFile()
    spm.SentencePieceTrainer.train(sentence_iterator=iter([f"w{i} w{i + 1} w{i + 2}" for i in range(300)]),
                                   model_writer=model, vocab_size=40, model_type=model_type, minloglevel=2)
    model.seek(0)
    return model.read()


def marian_model(hf: dict, out: Path, seed: int = 0) -> tuple[ModelConfig, dict]:
    """(config, params) of a random opus-mt-shaped model, written as a Marian directory `out` with
    a tokenizer CTranslate2's converter reads (vocab.json: `</s>` 0, `<unk>` 1, `<pad>` last)."""
    from rosetta.interop.marian import config_from_marian, write_marian

    vocab = hf["vocab_size"]
    cfg = config_from_marian({**hf, "pad_token_id": vocab - 1, "decoder_start_token_id": vocab - 1})
    params = init_params(cfg, seed=seed)
    params["shared_embed.embedding"][cfg.pad_id] = 0.0  # opus-mt: the decoder start row is zero
    params["generator.bias"][cfg.eos_id] = -1e9  # eos never wins: every sentence runs to its limit
    write_marian(out, cfg, params)
    words = {"</s>": 0, "<unk>": 1, **{f"\u2581w{i}": i for i in range(2, vocab - 1)}, "<pad>": vocab - 1}
    (out / "vocab.json").write_text(json.dumps(words))
    (out / "tokenizer_config.json").write_text(json.dumps({"separate_vocabs": False}))
    data = _tiny_spm()  # MarianTokenizer, which the converter loads, needs the two model files
    for name in ("source.spm", "target.spm"):
        atomic_write_bytes(out / name, data)
    return cfg, params


def m2m100_model(hf: dict, out: Path, seed: int = 0) -> tuple[ModelConfig, dict, dict[str, int], int]:
    """(config, params, language code ids, vocab.json's size: the first code's id) of a random
    M2M100-shaped model of `hf`'s sizes, written as an M2M100 directory `out` with M2M100Tokenizer's
    files (the module docstring)."""
    from transformers import M2M100Tokenizer

    from rosetta.interop.m2m100 import config_from_m2m100, write_m2m100
    from rosetta.interop.m2m100_tokenizer import LANGUAGE_CODES, SPM_FILE

    codes = len(LANGUAGE_CODES["m2m100"])
    words = hf["vocab_size"] - codes - MADEUP_WORDS
    if words < 8:
        raise ValueError(f"vocab_size {hf['vocab_size']}: M2M100's {codes} codes and {MADEUP_WORDS} made-up "
                         f"words leave no pieces")
    cfg = config_from_m2m100({**hf, **M2M100_FIELDS, "model_type": "m2m_100"})
    params = init_params(cfg, seed=seed)
    table = params["shared_embed.embedding"]
    table[cfg.pad_id] = 0.0  # nn.Embedding's padding_idx row
    dims = slice(cfg.d_model - EOS_DIMS, cfg.d_model)
    table[:, dims] = 0.0
    table[cfg.eos_id, dims] = -1.0
    params["decoder.final_norm.scale"][dims] = 0.0
    params["decoder.final_norm.bias"][dims] = EOS_PUSH
    write_m2m100(out, cfg, params)
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, **{f"\u2581w{i}": i for i in range(4, words)}}
    (out / "vocab.json").write_text(json.dumps(vocab))
    atomic_write_bytes(out / SPM_FILE, _tiny_spm("bpe"))
    tokenizer = M2M100Tokenizer(str(out / "vocab.json"), str(out / SPM_FILE), src_lang=SRC_LANG,
                                tgt_lang=TGT_LANG, model_max_length=hf["max_position_embeddings"])
    tokenizer.save_pretrained(out)
    return cfg, params, {code: tokenizer.get_lang_id(code) for code in (SRC_LANG, TGT_LANG)}, words


def build(model: str, quick: bool, out: Path) -> Built:
    """`model` (one of MODELS) at base size, or small with `quick`, written into the new folder `out`."""
    hf = QUICK if quick else BASE
    if model == "marian":
        cfg, params = marian_model(hf, out)
        return Built(cfg, params, out, [], (2, cfg.pad_id), None, {}, None, "eos banned")
    if model == "m2m100":
        cfg, params, lang, words = m2m100_model(hf, out)
        return Built(cfg, params, out, [lang[SRC_LANG]], (4, words), lang[TGT_LANG],
                     {"suppress_sequences": [["<pad>"]]}, f"__{TGT_LANG}__", "eos kept out by the weights")
    raise ValueError(f"model {model!r}: one of {', '.join(MODELS)}")
