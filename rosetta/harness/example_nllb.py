"""`rosetta example nllb DIR`: a small trained directory laid out as Hugging Face publishes M2M100
(`facebook/m2m100_418M`; NLLB-200's dense models share the architecture), built offline from
Multi30k, for trying the M2M100 / NLLB workflows (translate with language codes, convert,
CTranslate2) without a download.

What it holds, every file written by Hugging Face's and SentencePiece's own code:
`sentencepiece.bpe.model` (one BPE SentencePiece model of German and English Multi30k text);
`vocab.json` (fairseq's dictionary: `<s>` 0, `<pad>` 1, `</s>` 2, `<unk>` 3, then the pieces) and
`tokenizer_config.json`, as `M2M100Tokenizer.save_pretrained` writes them (src_lang de, tgt_lang en;
the 100 language codes `__af__` ... `__zu__` follow vocab.json's ids); `config.json` +
`model.safetensors` of a small `M2M100ForConditionalGeneration` (d_model 64, 2+2 layers, pre-norm,
fairseq's positions, one shared table; 8 "madeupword" rows after the codes, as M2M100 has) trained
here in both directions, de->en and en->de, each target starting with its language code as fairseq
trains it; `generation_config.json` as M2M100's (decoder start `</s>`, beam 4), with `<pad>` banned
and the English code forced first (forced_bos_token_id: `--tgt-lang de` turns it).

The model is Hugging Face's own code (transformers, torch, sentencepiece: the extras). Built in a
folder beside DIR and renamed into place, as rosetta/harness/example.py builds opus-mt's.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

from rosetta.harness.example import SENTENCES, _quiet, building, check_example_args, multi30k, train_hf

MAX_POSITIONS = 96  # max_position_embeddings and generation max_length
MADEUP_WORDS = 8  # M2M100's num_madeup_words: rows after the language codes
DEFAULT_STEPS = 750
SPM_SIZE = 1000


def train_bpe_spm(sentences: list[str], vocab_size: int) -> bytes:
    """A BPE SentencePiece model of `sentences` (M2M100's `sentencepiece.bpe.model`), serialized,
    deterministic (one thread, no shuffle)."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_writer=model,
                                   vocab_size=vocab_size, model_type="bpe", character_coverage=1.0,
                                   num_threads=1, shuffle_input_sentence=False, minloglevel=2)
    return model.getvalue()


def fairseq_vocab(model: bytes) -> dict[str, int]:
    """fairseq's dictionary over a SentencePiece model: the four specials, then its pieces in order."""
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor(model_proto=model)
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for i in range(processor.GetPieceSize()):
        if not (processor.IsControl(i) or processor.IsUnknown(i)):
            vocab.setdefault(processor.IdToPiece(i), len(vocab))
    return vocab


def build_nllb_dir(out: str | os.PathLike[str], steps: int = DEFAULT_STEPS, seed: int = 0,
                   data_dir: str | os.PathLike[str] | None = None) -> Path:
    """Write the directory (the module docstring) into `out`, a new or empty folder, and return it.
    The same arguments and data give the same bytes. RosettaError for a missing package, a used
    `out`, or unreadable data, before any work."""
    named = Path(os.path.abspath(out))
    out = check_example_args(out, steps)
    de, en = multi30k("de", SENTENCES, data_dir=data_dir), multi30k("en", SENTENCES, data_dir=data_dir)
    with building(out) as work, _quiet():
        _write(work, de, en, steps, seed)
    return named


def _write(out: Path, de: list[str], en: list[str], steps: int, seed: int) -> None:
    import torch
    from transformers import M2M100Config, M2M100ForConditionalGeneration, M2M100Tokenizer

    spm_model = train_bpe_spm(de + en, SPM_SIZE)
    vocab = fairseq_vocab(spm_model)
    (out / "sentencepiece.bpe.model").write_bytes(spm_model)
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False, indent=2))
    tokenizer = M2M100Tokenizer(str(out / "vocab.json"), str(out / "sentencepiece.bpe.model"), src_lang="de",
                                tgt_lang="en", model_max_length=MAX_POSITIONS)
    tokenizer.save_pretrained(out)
    codes = len(tokenizer.lang_code_to_id)
    config = M2M100Config(
        vocab_size=len(vocab) + codes + MADEUP_WORDS, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
        max_position_embeddings=MAX_POSITIONS, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        encoder_layerdrop=0.0, decoder_layerdrop=0.0, activation_function="relu", scale_embedding=True,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    torch.manual_seed(seed)
    model = M2M100ForConditionalGeneration(config)

    def pairs(src_lang: str, tgt_lang: str, sources: list[str], targets: list[str]) -> list:
        tokenizer.src_lang, tokenizer.tgt_lang = src_lang, tgt_lang
        return [(tokenizer(s).input_ids, tokenizer(text_target=t).input_ids)
                for s, t in zip(sources, targets, strict=True)]

    ids = pairs("de", "en", de, en) + pairs("en", "de", en, de)  # labels: [__tgt__] pieces </s>
    train_hf(model, ids, config.pad_token_id, steps, seed)
    model.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps(
        {"bad_words_ids": [[config.pad_token_id]], "bos_token_id": 0, "decoder_start_token_id": 2,
         "eos_token_id": 2, "forced_bos_token_id": tokenizer.get_lang_id("en"), "max_length": MAX_POSITIONS,
         "num_beams": 4, "pad_token_id": 1}, indent=2))
