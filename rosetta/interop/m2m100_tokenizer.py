"""M2M100's tokenizer, read from a Hugging Face M2M100 directory: what transformers'
`M2M100Tokenizer` computes (transformers/models/m2m_100/tokenization_m2m_100.py, read at 5.24),
with the `sentencepiece` package doing the pieces, and the language codes as it numbers them.

- Files: `sentencepiece.bpe.model` (the pieces), `vocab.json` (piece -> id, fairseq's dictionary:
  `<s>` 0, `<pad>` 1, `</s>` 2, `<unk>` 3, then the pieces), `tokenizer_config.json` (src_lang,
  tgt_lang, language_codes: "m2m100" or "wmt21").
- Language codes: `__de__` for "de"; code i of the list has id len(vocab.json) + i (the model's
  vocabulary then holds `num_madeup_words` more rows, which no text reaches).
- Source: `[__src__] pieces </s>` (`set_src_lang_special_tokens`: the code first, eos last); the
  four special tokens' strings in the text (`</s>`, `<unk>`, ...) stay whole, the rest (a code's
  string `__fr__` too, in 5.24) is cut by the SentencePiece model; a piece missing from vocab.json
  is `<unk>`.
- Generation: the decoder starts from `</s>` (decoder_start_token_id) and the target language code
  is forced first (generate's forced_bos_token_id): `lang_id(code)` gives it.
- Decoding (`decode(ids, skip_special_tokens=True)`): the special ids are skipped (the four, and
  every language code); an id that is neither a piece nor a code is the string `<unk>`, kept as
  text; runs of pieces are joined by the SentencePiece model. One departure, on purpose:
  transformers 5.24 keeps the language codes in the text (`__en__ A man ...`; 4.x skipped them,
  as fairseq does); rosetta skips them, so a translation is the text alone (what 5.24 prints for
  the ids without their codes).

NLLB-200's `NllbTokenizer` (ids from its tokenizer.json) is not this: find_text_tokenizer reads a
directory of it with rosetta/interop/nllb_tokenizer.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from rosetta import json_input
from rosetta.config import ModelConfig
from rosetta.errors import TokenizerError
from rosetta.interop.nllb_tokenizer import CLASSES as NLLB_CLASSES
from rosetta.interop.nllb_tokenizer import TOKENIZER_JSON, NllbTextTokenizer, is_nllb_tokenizer_dir
from rosetta.tokenizer import (
    TOKENIZER_CONFIG,
    VOCAB,
    TextTokenizer,
    _split_on,
    _spm,
    _vocab,
    clean_up_tokenization,
    find_tokenizer,
)

SPM_FILE = "sentencepiece.bpe.model"
TOKENIZER_FILES = (SPM_FILE, VOCAB, TOKENIZER_CONFIG)
CLASSES = ("M2M100Tokenizer", "NllbTokenizer", "NllbTokenizerFast")  # the directories read here
# FAIRSEQ_LANGUAGE_CODES of tokenization_m2m_100.py: the order gives the ids.
LANGUAGE_CODES = {
    "m2m100": ("af am ar ast az ba be bg bn br bs ca ceb cs cy da de el en es et fa ff fi fr fy ga gd gl gu "
               "ha he hi hr ht hu hy id ig ilo is it ja jv ka kk km kn ko lb lg ln lo lt lv mg mk ml mn mr "
               "ms my ne nl no ns oc or pa pl ps pt ro ru sd si sk sl so sq sr ss su sv sw ta th tl tn tr uk "
               "ur uz vi wo xh yi yo zh zu").split(),
    "wmt21": "en ha is ja cs ru zh de".split(),
}
SCHEMA = {
    "src_lang": json_input.field("string", "null"), "tgt_lang": json_input.field("string", "null"),
    "language_codes": json_input.field("string", "null"),
    "tokenizer_class": json_input.field("string", "null"),
    "clean_up_tokenization_spaces": json_input.field("boolean", "null"),
    **{f"{role}_token": json_input.field("string", "null") for role in ("bos", "eos", "unk", "pad")},
}


class M2M100TextTokenizer:
    """rosetta's TextTokenizer over an M2M100 directory (the module docstring). `src_lang` is the
    source language its encode_source marks (tokenizer_config.json's, else "en", as M2M100Tokenizer);
    `tgt_lang` the target's (tokenizer_config.json's, else None)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        config_path = self.directory / TOKENIZER_CONFIG
        config = (json_input.read_json(config_path, "the tokenizer config", schema=SCHEMA,
                                       error=TokenizerError) if config_path.is_file() else {})
        for name in (SPM_FILE, VOCAB):
            if not (self.directory / name).is_file():
                raise TokenizerError(f"{self.directory / name}: missing (M2M100's tokenizer needs "
                                     f"{SPM_FILE} and {VOCAB})")
        codes = config.get("language_codes") or "m2m100"
        if codes not in LANGUAGE_CODES:
            raise TokenizerError(f"{config_path}: language_codes {codes!r}: one of "
                                 f"{', '.join(LANGUAGE_CODES)}")
        self.spm = _spm(self.directory / SPM_FILE)
        self.encoder = _vocab(self.directory / VOCAB)
        self.special = {role: str(config.get(f"{role}_token") or default) for role, default in
                        (("bos", "<s>"), ("eos", "</s>"), ("unk", "<unk>"), ("pad", "<pad>"))}
        for role, token in self.special.items():
            if token not in self.encoder:
                raise TokenizerError(f"{self.directory / VOCAB}: has no {role} token {token!r}")
        self.codes = LANGUAGE_CODES[codes]
        self.lang_ids = {f"__{code}__": len(self.encoder) + i for i, code in enumerate(self.codes)}
        self.decoder = {i: piece for piece, i in self.encoder.items()}
        self.decoder.update({i: token for token, i in self.lang_ids.items()})
        self.special_ids = {self.encoder[t] for t in self.special.values()} | set(self.lang_ids.values())
        # Split out of the text whole: the four (transformers 5.24 cuts a code's string, `__fr__`, into
        # pieces like any text; only the ids the tokenizer adds are codes).
        self.specials = sorted(set(self.special.values()), key=len, reverse=True)
        self.clean_up_spaces = bool(config.get("clean_up_tokenization_spaces"))
        self.src_lang = config.get("src_lang") or "en"
        self.tgt_lang = config.get("tgt_lang")
        self.lang_id(self.src_lang, f"{config_path}: src_lang")
        if self.tgt_lang is not None:
            self.lang_id(self.tgt_lang, f"{config_path}: tgt_lang")

    @property
    def src_vocab_size(self) -> int:
        return len(self.encoder) + len(self.codes)

    tgt_vocab_size = src_vocab_size

    def lang_id(self, code: str, what: str = "language") -> int:
        """The id of a language code ("de" or "__de__"); a TokenizerError naming `what` otherwise."""
        token = code if code.startswith("__") and code.endswith("__") else f"__{code}__"
        if token not in self.lang_ids:
            shown = ", ".join(self.codes[:12])
            raise TokenizerError(f"{what} {code!r} is not a language code of {self.directory} "
                                 f"({len(self.codes)} codes: {shown}, ...)")
        return self.lang_ids[token]

    def _ids(self, text: str, lang: str) -> list[int]:
        unk = self.encoder[self.special["unk"]]
        ids = [self.lang_id(lang)]
        for part in _split_on(text, self.specials):
            if part in self.specials:  # a special token's string stays whole (PreTrainedTokenizer.tokenize)
                ids.append(self.encoder[part])
                continue
            ids.extend(self.encoder.get(piece, unk) for piece in self.spm.encode(part, out_type=str))
        return ids + [self.encoder[self.special["eos"]]]

    def encode_source(self, text: str) -> list[int]:
        """`M2M100Tokenizer(text, src_lang=...).input_ids`: the code, the pieces, `</s>`."""
        return self._ids(text, self.src_lang)

    def encode_target(self, text: str) -> list[int]:
        """`M2M100Tokenizer(text_target=text, tgt_lang=...).input_ids`."""
        return self._ids(text, self.tgt_lang or self.src_lang)

    def decode(self, ids: Iterable[int]) -> str:
        """`M2M100Tokenizer.decode(ids, skip_special_tokens=True)` (convert_tokens_to_string)."""
        out, run = "", []
        for i in ids:
            if int(i) in self.special_ids:
                continue
            token = self.decoder.get(int(i), self.special["unk"])
            if token == self.special["unk"]:  # a special string: not through SentencePiece
                out, run = out + self.spm.decode(run) + token, []
            else:
                run.append(token)
        text = (out + self.spm.decode(run)).strip()
        return clean_up_tokenization(text) if self.clean_up_spaces else text

    def check_fits(self, cfg: ModelConfig) -> None:
        """vocab.json and the codes inside both embeddings, its `</s>` and `<pad>` the config's ids."""
        where = self.directory / VOCAB
        for size, field in ((cfg.src_vocab_size, "src_vocab_size"), (cfg.tgt_vocab_size, "tgt_vocab_size")):
            top = max(self.encoder.values())
            if self.src_vocab_size > size or top >= len(self.encoder):
                raise TokenizerError(f"{where}: {len(self.encoder)} entries (ids up to {top}) and "
                                     f"{len(self.codes)} language codes, but the model's {field} (its "
                                     f"embedding) has {size} rows")
        for role, field_id in (("eos", cfg.eos_id), ("pad", cfg.pad_id)):
            token = self.special[role]
            if self.encoder[token] != field_id:
                raise TokenizerError(f"{where}: {token!r} has id {self.encoder[token]}, but the model's "
                                     f"{role}_id is {field_id}")

    def __repr__(self) -> str:
        return f"M2M100TextTokenizer({str(self.directory)!r}, src_lang={self.src_lang!r})"


def _tokenizer_class(directory: Path) -> str | None:
    path = directory / TOKENIZER_CONFIG
    if not path.is_file():
        return None
    # Only the class: the rest is checked by the reader of that class (NLLB's tokens may be objects).
    schema = {"tokenizer_class": SCHEMA["tokenizer_class"]}
    config = json_input.read_json(path, "the tokenizer config", schema=schema, error=TokenizerError)
    return config.get("tokenizer_class")


def is_m2m100_tokenizer_dir(directory: str | os.PathLike[str]) -> bool:
    directory = Path(directory)
    return directory.is_dir() and ((directory / SPM_FILE).exists() or _tokenizer_class(directory) in CLASSES)


def find_text_tokenizer(directory: str | os.PathLike[str], m2m100: bool = False) -> TextTokenizer | None:
    """The tokenizer a directory holds: NLLB's (tokenizer_config.json's class NllbTokenizer[Fast] and
    a tokenizer.json: rosetta/interop/nllb_tokenizer.py), M2M100's (its `sentencepiece.bpe.model`, or
    `m2m100`: the directory is an M2M100 model, whose tokenizer files must then be there), else what
    rosetta.tokenizer.find_tokenizer finds."""
    directory = Path(directory)
    if not (m2m100 or is_m2m100_tokenizer_dir(directory)):
        return find_tokenizer(directory)
    kind = _tokenizer_class(directory)
    if is_nllb_tokenizer_dir(directory, kind):
        return NllbTextTokenizer(directory)
    if kind in NLLB_CLASSES and not (directory / VOCAB).is_file():
        raise TokenizerError(f"{directory / TOKENIZER_JSON}: missing ({kind} reads NLLB-200's ids from "
                             f"its tokenizer.json, as transformers 5.24 does)")
    return M2M100TextTokenizer(directory)
