"""Tokenizers: source text -> model ids, target ids -> text. One interface, `TextTokenizer`,
and its two implementations:

- `Tokenizer`: our joint byte-level BPE (paper §5.1: a shared source-target BPE vocabulary), the
  one `rosetta train` learns and writes as `tokenizer.json`;
- `SentencePieceTokenizer`: Marian's (the opus-mt models'), built on the `sentencepiece` package
  as transformers' `MarianTokenizer` is: pieces from `source.spm`, ids through `vocab.json`
  (`target_vocab.json` when the vocabularies are separate), `</s>` appended, target ids decoded
  with the vocabulary and a `.spm` model, special tokens skipped.

`load_tokenizer(path)` reads either from a file or a directory.

Our BPE: built on the HuggingFace `tokenizers` library: NFC normalisation, the byte-level
pre-tokenizer (GPT-2's split into words, numbers and punctuation, each word with its
leading space) and the matching decoder, so that `decode(encode(s)) == s` for any NFC text
`s` without leading whitespace: no `<unk>`, no detokenisation heuristics, and BLEU computed
on decoded text is BLEU on real text. The special tokens are `<pad>`=0, `<s>`=1 (bos),
`</s>`=2 (eos), `<unk>`=3, the `ModelConfig` defaults; text that happens to contain the
string `</s>` is encoded as ordinary characters, never as a special id.
Training is deterministic: the same sentences and settings give the same vocabulary.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from rosetta import json_input
from rosetta.config import ModelConfig, read_json_object
from rosetta.errors import TokenizerError
from rosetta.files import atomic_write_bytes

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)  # ids 0, 1, 2, 3 in this order
BYTE_ALPHABET_SIZE = 256


@runtime_checkable
class TextTokenizer(Protocol):
    """What `rosetta translate`, `evaluate` and `diff` need of a tokenizer."""

    src_vocab_size: int  # ids the source side can produce: the model's src_vocab_size
    tgt_vocab_size: int  # ids the target side can decode: the model's tgt_vocab_size

    def encode_source(self, text: str) -> list[int]:
        """The source ids the model reads for `text`, eos appended."""

    def encode_target(self, text: str) -> list[int]:
        """The target ids of `text` (the labels of training), eos appended."""

    def decode(self, ids: Iterable[int]) -> str:
        """The text of target ids (a search's output), special tokens skipped."""

    def check_fits(self, cfg: ModelConfig) -> None:
        """A TokenizerError naming the file or field when this tokenizer is not the model's."""


def _hf():  # imported lazily: `tokenizers` is an optional dependency (the `train` extra)
    try:
        import tokenizers
    except ImportError:
        raise TokenizerError(
            "the BPE tokenizer needs the `tokenizers` package: pip install -e '.[train]'"
        ) from None
    return tokenizers


def no_tokenizer_at(path: Path) -> TokenizerError:
    """The refusal of a tokenizer path that is not a regular file: missing, or a directory, device or
    FIFO (never opened: a FIFO's open waits for a writer)."""
    what = "is not a regular file" if path.exists() else "does not exist"
    return TokenizerError(f"tokenizer file {str(path)!r} {what}")


class Tokenizer:
    """A trained joint BPE vocabulary. Make one with `Tokenizer.train` or `Tokenizer.load`."""

    pad_id, bos_id, eos_id, unk_id = 0, 1, 2, 3

    def __init__(self, backend: Any) -> None:
        """Wrap a `tokenizers.Tokenizer` whose special tokens have ids 0..3 (checked)."""
        for expected, token in enumerate(SPECIAL_TOKENS):
            got = backend.token_to_id(token)
            if got != expected:
                raise TokenizerError(
                    f"special token {token!r} has id {got}, expected {expected} "
                    f"(pad, bos, eos, unk must be 0, 1, 2, 3)"
                )
        # Special-token strings inside input text are ordinary text, not control ids.
        # (This flag is not part of the saved JSON, so it is set on every construction.)
        backend.encode_special_tokens = True
        self._tok = backend

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def train(
        cls, sentences: Iterable[str], vocab_size: int = 8000, min_frequency: int = 2
    ) -> Tokenizer:
        """Learn a BPE vocabulary of at most `vocab_size` entries (4 special tokens, the 256
        byte symbols, then merges) from `sentences`; for a joint vocabulary pass the source
        and the target sentences together. Merges seen fewer than `min_frequency` times are
        not learned, so a small corpus can give a smaller vocabulary than asked for."""
        minimum = len(SPECIAL_TOKENS) + BYTE_ALPHABET_SIZE + 1
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < minimum:
            raise TokenizerError(
                f"vocab_size must be an integer >= {minimum} (4 special tokens, 256 bytes, "
                f"one merge), got {vocab_size!r}"
            )
        if isinstance(min_frequency, bool) or not isinstance(min_frequency, int) or min_frequency < 1:
            raise TokenizerError(f"min_frequency must be an integer >= 1, got {min_frequency!r}")
        hf = _hf()
        backend = hf.Tokenizer(hf.models.BPE(unk_token=UNK))
        backend.normalizer = hf.normalizers.NFC()
        backend.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=True)
        backend.decoder = hf.decoders.ByteLevel()
        trainer = hf.trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        backend.train_from_iterator(sentences, trainer)
        return cls(backend)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Read a tokenizer saved by `save` (a `tokenizers` JSON file)."""
        path = Path(path)
        if not path.is_file():
            raise no_tokenizer_at(path)
        # The one JSON reader's bounds first (size, depth, numbers), then the library parses the text.
        raw = json_input.read_bytes(path, json_input.DEFAULT_LIMIT, "a tokenizer file", TokenizerError)
        json_input.decode(raw, str(path), error=TokenizerError)
        try:
            backend = _hf().Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # the Rust side raises plain Exception on bad JSON
            raise TokenizerError(f"cannot read tokenizer file {str(path)!r}: {e}") from None
        return cls(backend)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the tokenizer as JSON, atomically (temporary file, then rename)."""
        path = Path(path)
        atomic_write_bytes(path, self.to_json().encode("utf-8"))
        return path

    def to_json(self) -> str:
        """The tokenizer as the `tokenizers` JSON text that `save` writes."""
        return self._tok.to_str()

    # -- properties ------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included: use it as `src_vocab_size`/`tgt_vocab_size`."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> Any:
        """The wrapped `tokenizers.Tokenizer`."""
        return self._tok

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    # -- encode / decode -------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """The token ids of `text`; no bos or eos is added (the batcher adds them)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` for many texts at once (parallel in the Rust library)."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`: stops at the first eos, skips pad and bos, joins the bytes back
        into text. The model's raw output (`[bos, y1, ..., eos, pad, ...]`) decodes as is."""
        kept = []
        size = self.vocab_size
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i in (self.pad_id, self.bos_id):
                continue
            if not 0 <= i < size:
                raise TokenizerError(f"token id {i} is outside the vocabulary [0, {size})")
            kept.append(i)
        text = self._tok.decode(kept, skip_special_tokens=False)
        return text[1:] if text.startswith(" ") else text  # undo add_prefix_space

    def decode_batch(self, batch: Iterable[Iterable[int]]) -> list[str]:
        """`decode` for each row of `batch` (e.g. a `[batch, length]` array)."""
        return [self.decode(row) for row in batch]

    # -- TextTokenizer ----------------------------------------------------------------------
    @property
    def src_vocab_size(self) -> int:
        return self.vocab_size

    @property
    def tgt_vocab_size(self) -> int:
        return self.vocab_size

    def encode_source(self, text: str) -> list[int]:
        """`encode(text)` with eos appended, as the batcher builds a source (rosetta/harness/batching.py)."""
        return self.encode(text) + [self.eos_id]

    def encode_target(self, text: str) -> list[int]:
        return self.encode(text) + [self.eos_id]

    def check_fits(self, cfg: ModelConfig) -> None:
        if self.vocab_size != cfg.src_vocab_size or (cfg.pad_id, cfg.bos_id, cfg.eos_id) != (0, 1, 2):
            raise TokenizerError(
                f"the tokenizer has {self.vocab_size} ids (pad, bos, eos 0, 1, 2) but the model's source "
                f"vocabulary has {cfg.src_vocab_size} (pad, bos, eos {cfg.pad_id}, {cfg.bos_id}, "
                f"{cfg.eos_id}): not the tokenizer the model was trained with")

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size})"


# -- Marian's SentencePiece tokenizer ----------------------------------------------------------

SOURCE_SPM, TARGET_SPM = "source.spm", "target.spm"
VOCAB, TARGET_VOCAB, TOKENIZER_CONFIG = "vocab.json", "target_vocab.json", "tokenizer_config.json"
# The fields of tokenizer_config.json read here, typed: "false" as a string would read as true, and an
# AddedToken object as its Python repr.
TOKENIZER_CONFIG_SCHEMA = {
    "separate_vocabs": json_input.field("boolean"),
    "clean_up_tokenization_spaces": json_input.field("boolean"),
    **{f"{role}_token": json_input.field("string", "null") for role in ("eos", "unk", "pad")},
}
MARIAN_TOKENIZER_FILES = (SOURCE_SPM, TARGET_SPM, VOCAB, TARGET_VOCAB, TOKENIZER_CONFIG)
SPIECE_UNDERLINE = "\u2581"
# The largest SentencePiece model read: opus-mt's are under 1 MB, NLLB-200's 4.8 MB; a file past it is
# refused from its size before a byte is read (sentencepiece itself would read it whole).
MAX_SPM_BYTES = 64 << 20


def _spm(path: Path) -> Any:
    """A `sentencepiece.SentencePieceProcessor` of `path` (a TokenizerError naming it)."""
    try:
        import sentencepiece
    except ImportError:
        raise TokenizerError(f"{path}: Marian's tokenizer needs the `sentencepiece` package: "
                             f"pip install -e '.[marian]'") from None
    if not path.is_file():
        raise TokenizerError(f"{path}: missing (a Marian tokenizer needs {SOURCE_SPM} and {TARGET_SPM})")
    raw = json_input.read_bytes(path, MAX_SPM_BYTES, "a SentencePiece model", TokenizerError)
    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(raw)
    except (OSError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "ParseFromArray" in first:  # the library's source line and call: say what it means
            first = "its bytes do not parse as a ModelProto"
        raise TokenizerError(f"{path}: not a SentencePiece model: {first}") from None
    return processor


def _vocab(path: Path) -> dict[str, int]:
    """A Marian vocabulary file: piece -> id, every id a distinct integer >= 0."""
    if not path.is_file():
        raise TokenizerError(f"{path}: missing (the Marian vocabulary, piece -> id)")
    vocab = read_json_object(path, "the vocabulary", TokenizerError)
    seen: dict[int, str] = {}
    for piece, i in vocab.items():
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise TokenizerError(f"{path}: {piece!r} has id {i!r}; ids are integers >= 0")
        if i in seen:
            raise TokenizerError(f"{path}: {seen[i]!r} and {piece!r} both have id {i}")
        seen[i] = piece
    if not vocab:
        raise TokenizerError(f"{path}: the vocabulary is empty")
    return vocab


class SentencePieceTokenizer:
    """Marian's tokenizer, read from an opus-mt directory: what transformers' `MarianTokenizer`
    computes (transformers/models/marian/tokenization_marian.py, checked against 5.23), with the
    `sentencepiece` package doing the pieces."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        config_path = self.directory / TOKENIZER_CONFIG
        config = (json_input.read_json(config_path, "the tokenizer config", schema=TOKENIZER_CONFIG_SCHEMA,
                                       error=TokenizerError) if config_path.is_file() else {})
        self.separate_vocabs = bool(config.get("separate_vocabs", False))
        self.clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self.special = {role: str(config.get(f"{role}_token") or default)
                        for role, default in (("eos", EOS), ("unk", UNK), ("pad", PAD))}
        self.spm_source = _spm(self.directory / SOURCE_SPM)
        self.spm_target = _spm(self.directory / TARGET_SPM)
        self.encoder = _vocab(self.directory / VOCAB)
        self.target_encoder = (_vocab(self.directory / TARGET_VOCAB) if self.separate_vocabs
                               else self.encoder)
        for role, token in self.special.items():
            for path, vocab in ((VOCAB, self.encoder), (TARGET_VOCAB, self.target_encoder)):
                if token not in vocab:
                    raise TokenizerError(f"{self.directory / path}: has no {role} token {token!r}")
        self.decoder = {i: piece for piece, i in self.target_encoder.items()}
        # MarianTokenizer decodes a joint vocabulary's pieces with the source model (its default
        # use_source_tokenizer = not separate_vocabs), a separate one's with the target model.
        self.spm_decode = self.spm_target if self.separate_vocabs else self.spm_source
        self.special_ids = {self.target_encoder[t] for t in self.special.values()}
        self.eos_id = self.encoder[self.special["eos"]]

    @property
    def src_vocab_size(self) -> int:
        return len(self.encoder)

    @property
    def tgt_vocab_size(self) -> int:
        return len(self.target_encoder)

    def _pieces(self, text: str, spm: Any) -> list[str]:
        """MarianTokenizer.tokenize: the special tokens' strings stay whole; in each other part a
        leading language code (`>>fra<<`) is one token, the rest SentencePiece pieces."""
        out: list[str] = []
        specials = sorted(set(self.special.values()), key=len, reverse=True)
        for part in _split_on(text, specials):
            if part in specials:
                out.append(part)
                continue
            if part.startswith(">>") and (end := part.find("<<")) != -1:
                out.append(part[:end + 2])
                part = part[end + 2:]
            out.extend(spm.encode(part, out_type=str))
        return out

    def _ids(self, pieces: list[str], vocab: dict[str, int]) -> list[int]:
        unk = vocab[self.special["unk"]]
        return [vocab.get(piece, unk) for piece in pieces] + [vocab[self.special["eos"]]]

    def encode_source(self, text: str) -> list[int]:
        """`MarianTokenizer(text).input_ids`: pieces, unknown ones `<unk>`, `</s>` appended."""
        return self._ids(self._pieces(text, self.spm_source), self.encoder)

    def encode_target(self, text: str) -> list[int]:
        """`MarianTokenizer(text_target=text).input_ids`."""
        return self._ids(self._pieces(text, self.spm_target), self.target_encoder)

    def decode(self, ids: Iterable[int]) -> str:
        """`MarianTokenizer.decode(ids, skip_special_tokens=True)`."""
        pieces = []
        for i in ids:
            i = int(i)
            if i in self.special_ids:
                continue
            piece = self.decoder.get(i)
            if piece is None:  # as MarianTokenizer: the spm model's piece, else <unk>
                piece = self.spm_decode.IdToPiece(i) if 0 <= i < self.spm_decode.GetPieceSize() else ""
                piece = piece or self.special["unk"]
            pieces.append(piece)
        text = self.spm_decode.DecodePieces(pieces).replace(SPIECE_UNDERLINE, " ").strip()
        return clean_up_tokenization(text) if self.clean_up_spaces else text

    def check_fits(self, cfg: ModelConfig) -> None:
        """Each vocabulary's size must be its embedding's, its ids inside it, its `</s>` and `<pad>`
        the config's eos_id and pad_id."""
        for path, vocab, size, field in ((VOCAB, self.encoder, cfg.src_vocab_size, "src_vocab_size"),
                                         (TARGET_VOCAB if self.separate_vocabs else VOCAB,
                                          self.target_encoder, cfg.tgt_vocab_size, "tgt_vocab_size")):
            where = self.directory / path
            if len(vocab) != size:
                raise TokenizerError(f"{where}: {len(vocab)} entries, but the model's {field} (its "
                                     f"embedding) has {size} rows")
            top = max(vocab, key=vocab.__getitem__)
            if vocab[top] >= size:
                raise TokenizerError(f"{where}: {top!r} has id {vocab[top]}, outside the embedding's "
                                     f"{size} rows")
            for role, field_id in (("eos", cfg.eos_id), ("pad", cfg.pad_id)):
                token = self.special[role]
                if vocab[token] != field_id:
                    raise TokenizerError(f"{where}: {token!r} has id {vocab[token]}, but the model's "
                                         f"{role}_id is {field_id}")

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({str(self.directory)!r}, separate_vocabs={self.separate_vocabs})"


def clean_up_tokenization(text: str) -> str:
    """PreTrainedTokenizerBase.clean_up_tokenization (a tokenizer's clean_up_tokenization_spaces)."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


def _split_on(text: str, specials: Sequence[str]) -> list[str]:
    """`text` cut around every occurrence of the `specials` (longest first), empty parts dropped."""
    parts, start, i = [], 0, 0
    while i < len(text):
        hit = next((s for s in specials if text.startswith(s, i)), None)
        if hit is None:
            i += 1
            continue
        parts += [text[start:i], hit]
        i = start = i + len(hit)
    parts.append(text[start:])
    return [p for p in parts if p]


def is_marian_tokenizer_dir(directory: str | os.PathLike[str]) -> bool:
    return (Path(directory) / SOURCE_SPM).exists() or (Path(directory) / VOCAB).exists()


# -- FSMT's tokenizer: its files are checked, never run ----------------------------------------

# transformers' FSMTTokenizer (tokenization_fsmt.py VOCAB_FILES_NAMES): the source and target
# vocabularies and the BPE merges. It runs Moses' punctuation normalizer and tokenizer (the
# `sacremoses` package) before BPE; rosetta does not depend on sacremoses, so it reads the files'
# sizes and special ids (check_fsmt_vocabularies) and refuses to tokenize text with them.
FSMT_SRC_VOCAB, FSMT_TGT_VOCAB, FSMT_MERGES = "vocab-src.json", "vocab-tgt.json", "merges.txt"
FSMT_TOKENIZER_FILES = (FSMT_SRC_VOCAB, FSMT_TGT_VOCAB, FSMT_MERGES)


def is_fsmt_tokenizer_dir(directory: str | os.PathLike[str]) -> bool:
    return any((Path(directory) / name).exists() for name in FSMT_TOKENIZER_FILES)


def check_fsmt_vocabularies(directory: str | os.PathLike[str], cfg: ModelConfig) -> None:
    """FSMT's files must be the model's: each vocabulary the size of its embedding, its ids inside it,
    `</s>` and `<pad>` (FSMTTokenizer's sep and pad tokens) the config's eos_id and pad_id."""
    directory = Path(directory)
    for name in FSMT_TOKENIZER_FILES:
        if not (directory / name).is_file():
            raise TokenizerError(f"{directory / name}: missing (FSMT's tokenizer needs "
                                 f"{', '.join(FSMT_TOKENIZER_FILES)})")
    for name, size, field in ((FSMT_SRC_VOCAB, cfg.src_vocab_size, "src_vocab_size"),
                              (FSMT_TGT_VOCAB, cfg.tgt_vocab_size, "tgt_vocab_size")):
        vocab = _vocab(directory / name)
        top = max(vocab, key=vocab.__getitem__)
        if len(vocab) != size or vocab[top] >= size:
            raise TokenizerError(f"{directory / name}: {len(vocab)} entries, ids up to {vocab[top]}, but "
                                 f"the model's {field} (its embedding) has {size} rows")
        for token, field_id, role in ((EOS, cfg.eos_id, "eos_id"), (PAD, cfg.pad_id, "pad_id")):
            if vocab.get(token) != field_id:
                raise TokenizerError(f"{directory / name}: {token!r} has id {vocab.get(token)}, but the "
                                     f"model's {role} is {field_id}")


def fsmt_refusal(directory: str | os.PathLike[str]) -> str:
    """The one line `translate` answers for FSMT's files: what is missing to tokenize with them."""
    return (f"{directory}: FSMT's tokenizer (Moses normalization and tokenization, then BPE with "
            f"{', '.join(FSMT_TOKENIZER_FILES)}) is not in rosetta: it needs the `sacremoses` package, "
            f"which rosetta does not depend on; tokenize with transformers' FSMTTokenizer (pip install "
            f"sacremoses) or pass --tokenizer")


def find_tokenizer(directory: str | os.PathLike[str]) -> Tokenizer | SentencePieceTokenizer | None:
    """The tokenizer a directory holds: Marian's (`source.spm`, `vocab.json`, ...) or ours
    (`tokenizer.json`); None when it holds neither. FSMT's files are refused (fsmt_refusal)."""
    directory = Path(directory)
    if is_fsmt_tokenizer_dir(directory):
        raise TokenizerError(fsmt_refusal(directory))
    if (directory / "sentencepiece.bpe.model").exists():  # rosetta/interop/m2m100_tokenizer.py reads it
        raise TokenizerError(f"{directory}: M2M100's tokenizer (sentencepiece.bpe.model): read it with "
                             f"rosetta.interop.m2m100_tokenizer.find_text_tokenizer")
    if is_marian_tokenizer_dir(directory):
        return SentencePieceTokenizer(directory)
    if (directory / "tokenizer.json").is_file():
        return Tokenizer.load(directory / "tokenizer.json")
    return None


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer | SentencePieceTokenizer:
    """The tokenizer of a `tokenizer.json` file, or of a directory holding Marian's files or one."""
    path = Path(path)
    if not path.is_dir():
        return Tokenizer.load(path)
    found = find_tokenizer(path)
    if found is None:
        raise TokenizerError(f"{path}: holds no tokenizer ({SOURCE_SPM} + {VOCAB}, or tokenizer.json)")
    return found
