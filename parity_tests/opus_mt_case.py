"""A directory laid out as Helsinki-NLP publishes opus-mt, built here from Multi30k, for the tests
of real-model workflows (tokenizers, translate, convert, CTranslate2, diff against transformers).

What it holds, as opus-mt does: `source.spm` and `target.spm` (unigram SentencePiece models,
trained with `sentencepiece` on German and English Multi30k text); `vocab.json`, the joint
vocabulary (`</s>` 0, `<unk>` 1, the pieces of both models, two language codes, `<pad>` last), or
with `separate=True` `vocab.json` + `target_vocab.json` and `"separate_vocabs": true`;
`tokenizer_config.json`; `config.json` + `model.safetensors` of a small `MarianMTModel` trained
here for a few hundred steps (`<pad>` is the decoder start and its embedding row is zero, as in
opus-mt, where Hugging Face's conversion appended it as a zero row: the tied output projection
would train it, so each step sets it back); `generation_config.json` as opus-mt writes it (beam 4,
`<pad>` banned, eos forced at max_length, logits renormalized).

Nothing here comes from rosetta: the directory is what Hugging Face's own code writes and reads.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

DATA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "multi30k"
LANGUAGE_CODES = (">>en<<", ">>fr<<")  # in the joint vocabulary, as multi-target opus-mt models have
SENTENCES = 3000  # Multi30k training pairs the case learns from
MAX_POSITIONS = 96  # max_position_embeddings and generation max_length


def multi30k(lang: str, count: int, split: str = "train") -> list[str]:
    import gzip

    with gzip.open(DATA_DIR / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
        return [next(f).strip() for _ in range(count)]


def train_spm(sentences: list[str], vocab_size: int) -> bytes:
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_writer=model,
                                   vocab_size=vocab_size,
                                   model_type="unigram", character_coverage=1.0, num_threads=1,
                                   shuffle_input_sentence=False, minloglevel=2)
    return model.getvalue()


def spm_pieces(model: bytes) -> list[str]:
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor(model_proto=model)
    return [processor.IdToPiece(i) for i in range(processor.GetPieceSize())]


def marian_vocab(*piece_lists: list[str], codes: tuple[str, ...] = ()) -> dict[str, int]:
    """opus-mt's layout: `</s>` 0, `<unk>` 1, every other piece once in order, `<pad>` last."""
    vocab = {"</s>": 0, "<unk>": 1}
    for piece in [*codes, *(p for pieces in piece_lists for p in pieces)]:
        if piece not in vocab and piece not in ("<s>", "<pad>"):
            vocab[piece] = len(vocab)
    vocab["<pad>"] = len(vocab)
    return vocab


def build_opus_mt_dir(out: Path, separate: bool = False, steps: int = 250, seed: int = 0,
                      spm_size: int = 500) -> Path:
    """Write the directory (see the module docstring) into `out` and return it."""
    import torch
    from transformers import MarianConfig, MarianMTModel, MarianTokenizer

    out.mkdir(parents=True, exist_ok=True)
    de, en = multi30k("de", SENTENCES), multi30k("en", SENTENCES)
    src_spm, tgt_spm = train_spm(de, spm_size), train_spm(en, spm_size)
    (out / "source.spm").write_bytes(src_spm)
    (out / "target.spm").write_bytes(tgt_spm)
    if separate:  # one vocabulary a side, of equal size, so that <pad> (last) has one id in both
        src_vocab, tgt_vocab = marian_vocab(spm_pieces(src_spm)), marian_vocab(spm_pieces(tgt_spm))
        assert len(src_vocab) == len(tgt_vocab)
        (out / "target_vocab.json").write_text(json.dumps(tgt_vocab, ensure_ascii=False, indent=2))
    else:
        src_vocab = tgt_vocab = marian_vocab(spm_pieces(src_spm), spm_pieces(tgt_spm), codes=LANGUAGE_CODES)
    (out / "vocab.json").write_text(json.dumps(src_vocab, ensure_ascii=False, indent=2))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"source_lang": "de", "target_lang": "en", "separate_vocabs": separate, "model_max_length": 512,
         "tokenizer_class": "MarianTokenizer"}, indent=2))
    pad = src_vocab["<pad>"]
    config = MarianConfig(
        vocab_size=len(src_vocab), decoder_vocab_size=len(tgt_vocab) if separate else None, d_model=64,
        encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=MAX_POSITIONS, dropout=0.0,
        activation_function="swish", scale_embedding=True, pad_token_id=pad, eos_token_id=0,
        decoder_start_token_id=pad, forced_eos_token_id=0, share_encoder_decoder_embeddings=not separate,
        tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = MarianMTModel(config)
    tokenizer = MarianTokenizer.from_pretrained(out)
    ids = [(tokenizer(s).input_ids, tokenizer(text_target=t).input_ids) for s, t in zip(de, en, strict=True)]
    ids = [(s, t) for s, t in ids if len(s) <= 48 and len(t) <= 48]
    rng = np.random.default_rng(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        batch = [ids[i] for i in rng.choice(len(ids), 32, replace=False)]
        src = torch.full((32, max(len(s) for s, _ in batch)), pad)
        labels = torch.full((32, max(len(t) for _, t in batch)), -100)  # -100: not a target
        for row, (s, t) in enumerate(batch):
            src[row, :len(s)], labels[row, :len(t)] = torch.tensor(s), torch.tensor(t)
        loss = model(input_ids=src, attention_mask=(src != pad).long(), labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with torch.no_grad():  # opus-mt: the <pad> (decoder start) row is zero; the tied lm_head trains it
            model.model.encoder.embed_tokens.weight[pad] = 0
            model.model.decoder.embed_tokens.weight[pad] = 0
    model.eval()
    model.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps(
        {"bad_words_ids": [[pad]], "bos_token_id": 0, "decoder_start_token_id": pad, "eos_token_id": 0,
         "forced_eos_token_id": 0, "max_length": MAX_POSITIONS, "num_beams": 4, "pad_token_id": pad,
         "renormalize_logits": True}, indent=2))
    return out


# Test sentences: Multi30k test 2016 lines (never trained on), a language code, an unknown
# character, a special token's string inside the text.
def case_sentences(count: int = 6) -> list[str]:
    return multi30k("de", count, "test_2016_flickr")


EXTRA_SENTENCES = [">>fr<< Ein Hund läuft.", "Ein Hund läuft ☃ über die Straße.",
                   "Ein </s> Mann <unk> singt."]


def shared_case(base: Path, separate: bool) -> Path:
    """The case directory, built once for the whole test session: pytest-xdist's workers share
    `base` (the session's temporary directory, parent of their own) and take turns under a file lock.
    Tests read it and never change it (a test that breaks a file works on a copy)."""
    import fcntl

    out = base / f"opus-mt-case-{'separate' if separate else 'joint'}"
    with open(base / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "generation_config.json").is_file():  # written last: the case is complete
            build_opus_mt_dir(out, separate=separate)
    return out
