"""The M2M100 (NLLB-style) case of the tests: the directory `rosetta example nllb` writes
(rosetta/harness/example_nllb.py: a BPE SentencePiece model, M2M100Tokenizer's files, a small
M2M100ForConditionalGeneration trained briefly on Multi30k in both directions), built once per
test session and shared by pytest-xdist's workers; and the sentences the tests translate with it.
Nothing in the directory comes from rosetta's models.
"""

from __future__ import annotations

import fcntl
from pathlib import Path

from rosetta.harness.example import multi30k

STEPS = 100  # every check compares two implementations, not translation quality


def case_sentences(count: int = 5) -> list[str]:
    """Multi30k test 2016 lines (never trained on), an unknown character, special tokens' strings."""
    return multi30k("de", count, "test_2016_flickr") + ["Ein Hund läuft ☃ über die Straße.",
                                                        "Ein </s> Mann <unk> singt __fr__ laut."]


def shared_case(base: Path) -> Path:
    """The case directory under `base`, built once under a file lock (opus_mt_case.shared_case)."""
    from rosetta.harness.example_nllb import build_nllb_dir

    out = base / "nllb-case"
    with open(base / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.is_dir():  # renamed into place complete: present is complete
            build_nllb_dir(out, steps=STEPS)
    return out
