"""The opus-mt case of the tests: the directory `rosetta example opus-mt` writes
(rosetta/harness/example.py: SentencePiece models and a small MarianMTModel trained on Multi30k,
laid out as Helsinki-NLP publishes opus-mt), built once per test session, and the sentences the
tests translate with it. Nothing in the directory comes from rosetta's models: it is what Hugging
Face's own code writes and reads.
"""

from __future__ import annotations

from pathlib import Path

from rosetta.harness.example import (  # noqa: F401  (the tests' names for the builder's parts)
    LANGUAGE_CODES,
    MAX_POSITIONS,
    SENTENCES,
    marian_vocab,
    multi30k,
    spm_pieces,
    train_spm,
)
from rosetta.harness.example import build_opus_mt_dir as _build


def build_opus_mt_dir(out: Path, separate: bool = False, steps: int = 250, seed: int = 0,
                      spm_size: int = 500) -> Path:
    """Write the directory into `out` (new or empty) and return it: `rosetta example opus-mt OUT`."""
    return _build(out, separate=separate, steps=steps, seed=seed, spm_size=spm_size)


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
        if not out.is_dir():  # the builder renames a complete directory into place: present is complete
            build_opus_mt_dir(out, separate=separate)
    return out
