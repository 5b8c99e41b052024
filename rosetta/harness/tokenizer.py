"""A joint byte-level BPE vocabulary (paper §5.1: a shared source-target BPE vocabulary).

Built on the HuggingFace `tokenizers` library: NFC normalisation, the byte-level
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
from typing import Any

from rosetta.files import atomic_write_bytes
from rosetta.harness.data import DataError

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)  # ids 0, 1, 2, 3 in this order
BYTE_ALPHABET_SIZE = 256


class TokenizerError(DataError):
    """A tokenizer file or argument that cannot be used."""


def _hf():  # imported lazily: `tokenizers` is an optional dependency (the `train` extra)
    try:
        import tokenizers
    except ImportError:
        raise TokenizerError(
            "the BPE tokenizer needs the `tokenizers` package: pip install -e '.[train]'"
        ) from None
    return tokenizers


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
            raise TokenizerError(f"tokenizer file {str(path)!r} does not exist")
        try:
            backend = _hf().Tokenizer.from_file(str(path))
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

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size})"
