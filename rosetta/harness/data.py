"""Training data: the Multi30k task 1 corpus (load, download) and synthetic copy/reverse tasks.

Multi30k (Elliott et al. 2016) is read from its untouched gzipped raw files
`{split}.{lang}.gz`, one sentence per line, line i of one language translating line i of the
other. Where they live is resolved by `resolve_data_dir`: an explicit directory, else the
`ROSETTA_DATA_DIR` environment variable, else the copy bundled in the package
(`rosetta/data/multi30k`, package data: it travels in the wheel).

The synthetic tasks need no files: random token-id sequences and their copy or reversal, a
quick check that a model and its training loop can learn anything at all.

Everything here is NumPy and the standard library; no deep-learning framework is imported.
"""

from __future__ import annotations

import gzip
import os
import urllib.error
import urllib.request
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO

import numpy as np

from rosetta.errors import RosettaError
from rosetta.files import atomic_write_bytes

SPLITS: tuple[str, ...] = ("train", "val", "test_2016_flickr", "test_2017_flickr")
LANGUAGES: tuple[str, ...] = ("de", "en", "fr")
SPLIT_SIZES: dict[str, int] = {
    "train": 29000, "val": 1014, "test_2016_flickr": 1000, "test_2017_flickr": 1000,
}
URL_BASE = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw"
DATA_DIR_ENV = "ROSETTA_DATA_DIR"
# The untouched public files shipped as package data (pyproject.toml): found beside this module, so the
# default is the same in a checkout, an editable install and an installed wheel.
BUNDLED_DATA_DIR = Path(__file__).resolve().parents[1] / "data" / "multi30k"
SYNTHETIC_TASKS: tuple[str, ...] = ("copy", "reverse")
# Token ids 0, 1 and 2 are pad, bos and eos (the ModelConfig defaults); data tokens start here.
FIRST_DATA_ID = 3
# The most text one data file may hold, decompressed, and the most lines: Multi30k's largest file is
# 4 MB (29,000 lines), WMT14 en-de's largest side about 0.7 GB (4.5 M lines); a gzip file that inflates
# past either (a bomb, or not a corpus: a line costs a Python string, ~50 bytes beyond its text) is
# refused before it takes the machine's memory.
MAX_DATA_FILE_BYTES = 2 << 30
MAX_DATA_FILE_LINES = 50_000_000


class DataError(RosettaError):
    """A data directory, file, split, language or argument that cannot be used."""


# -- Multi30k: where the files are ---------------------------------------------------------------

def default_data_dir() -> Path:
    """`$ROSETTA_DATA_DIR` if set, else `BUNDLED_DATA_DIR`, the package's own copy (not checked)."""
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        return Path(env).expanduser()
    return BUNDLED_DATA_DIR


def resolve_data_dir(data_dir: str | os.PathLike[str] | None = None) -> Path:
    """The Multi30k directory to read: `data_dir` if given, else `default_data_dir()`.

    Raises DataError naming the directory (and how it was chosen) if it does not exist or is a file.
    """
    if data_dir is not None:
        path, how = Path(data_dir).expanduser(), "given directory"
    elif os.environ.get(DATA_DIR_ENV):
        path, how = default_data_dir(), f"${DATA_DIR_ENV}"
    else:
        path, how = default_data_dir(), "the package's bundled copy"
    if not path.is_dir():
        # A file where the folder should be is named as such, not as a missing folder.
        state = "is not a directory" if path.exists() else "does not exist"
        raise DataError(
            f"Multi30k data directory {str(path)!r} ({how}) {state}; pass data_dir=, set "
            f"${DATA_DIR_ENV}, or fetch the files with rosetta.harness.data.download_multi30k({str(path)!r})"
        )
    return path


def _check_split_lang(split: str, langs: Iterable[str]) -> None:
    if split not in SPLITS:
        raise DataError(f"unknown Multi30k split {split!r}; choose one of {', '.join(SPLITS)}")
    for lang in langs:
        if lang not in LANGUAGES:
            raise DataError(f"unknown Multi30k language {lang!r}; choose one of {', '.join(LANGUAGES)}")


def read_lines(path: str | os.PathLike[str]) -> list[str]:
    """The lines of a UTF-8 text file, gzipped if its name ends in `.gz`, each stripped of
    surrounding whitespace. Only `\\n` separates lines. DataError names a missing or bad file, or
    one holding more than MAX_DATA_FILE_BYTES or MAX_DATA_FILE_LINES of text."""
    path = Path(path)
    if not path.is_file():  # a folder or a FIFO in its place is named as such (a FIFO is never opened)
        state = ("is a directory" if path.is_dir() else "is not a regular file" if path.exists()
                 else "does not exist")
        raise DataError(f"data file {str(path)!r} {state}")
    try:
        chunks, size, lines = [], 0, 0
        with (gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")) as f:
            while chunk := f.read(1 << 20):  # streamed, a MiB at a time: never more than the bounds held
                size, lines = size + len(chunk), lines + chunk.count(b"\n")
                if size > MAX_DATA_FILE_BYTES or lines > MAX_DATA_FILE_LINES:
                    inflated = " decompressed" if path.suffix == ".gz" else ""
                    raise DataError(f"data file {str(path)!r} holds more than {MAX_DATA_FILE_BYTES:,} "
                                    f"bytes or {MAX_DATA_FILE_LINES:,} lines of text{inflated}: refused "
                                    "before it fills the memory (no corpus this reader reads is that large)")
                chunks.append(chunk)
        text = b"".join(chunks).decode("utf-8")
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"cannot read data file {str(path)!r}: {e}") from None
    except UnicodeDecodeError as e:
        raise DataError(f"data file {str(path)!r} is not UTF-8 text: {e}") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last line
    return [line.strip() for line in lines]


def load_multi30k(
    split: str,
    src_lang: str = "de",
    tgt_lang: str = "en",
    data_dir: str | os.PathLike[str] | None = None,
) -> list[tuple[str, str]]:
    """The sentence pairs `(source, target)` of one Multi30k task 1 split, in file order.

    `split` is one of `SPLITS`, the languages any of `LANGUAGES`. Reads
    `{data_dir}/{split}.{lang}.gz` for both languages; `data_dir=None` resolves as in
    `resolve_data_dir`. Raises DataError for an unknown split or language, a missing directory
    or file, or files whose line counts differ.
    """
    _check_split_lang(split, (src_lang, tgt_lang))
    directory = resolve_data_dir(data_dir)
    src_path, tgt_path = (directory / f"{split}.{lang}.gz" for lang in (src_lang, tgt_lang))
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        raise DataError(
            f"Multi30k split {split!r}: {str(src_path)!r} has {len(src)} lines but "
            f"{str(tgt_path)!r} has {len(tgt)}; line i of one must translate line i of the other"
        )
    return list(zip(src, tgt, strict=True))


# -- Multi30k: download --------------------------------------------------------------------------

def download_multi30k(
    dest_dir: str | os.PathLike[str],
    splits: Iterable[str] = SPLITS,
    langs: Iterable[str] = LANGUAGES,
    url_base: str | None = None,
    timeout: float = 60.0,
    opener: Callable[[str, float], IO[bytes]] | None = None,
) -> list[Path]:
    """Fetch `{url_base}/{split}.{lang}.gz` into `dest_dir` for every split and language
    (`url_base=None`: the module's `URL_BASE`, the public Multi30k repository).

    Files already in `dest_dir` are kept, not fetched again. Each download is checked to be
    a readable gzip file, then written to a temporary file and renamed into place, so an
    interrupted run never leaves a partial file under the final name. `opener(url, timeout)`
    returns a readable binary file object (default `urllib.request.urlopen`; `file://` URLs
    work too). Returns the paths of all requested files. Raises DataError naming the URL when
    a download fails (e.g. no network) or is not gzip data.
    """
    splits, langs = list(splits), list(langs)
    for split in splits:
        _check_split_lang(split, langs)
    open_url = opener if opener is not None else _urlopen
    base = (URL_BASE if url_base is None else url_base).rstrip("/")
    dest = Path(dest_dir).expanduser()
    dest.mkdir(parents=True, exist_ok=True)
    paths = []
    for split in splits:
        for lang in langs:
            name = f"{split}.{lang}.gz"
            path = dest / name
            paths.append(path)
            if path.is_file():
                continue
            url = f"{base}/{name}"
            try:
                with open_url(url, timeout) as response:
                    data = response.read()
            except (OSError, ValueError) as e:  # URLError and HTTPError are OSErrors
                reason = e.reason if isinstance(e, urllib.error.URLError) else e
                raise DataError(
                    f"could not download {url}: {reason} (no network? copy the Multi30k files "
                    f"into {str(dest)!r} by hand, or point $ROSETTA_DATA_DIR at a copy)"
                ) from None
            try:
                gzip.decompress(data)
            except (OSError, EOFError, zlib.error) as e:
                raise DataError(f"download of {url} is not a gzip file ({e}); nothing written") from None
            atomic_write_bytes(path, data)
    return paths


def _urlopen(url: str, timeout: float) -> IO[bytes]:
    return urllib.request.urlopen(url, timeout=timeout)


# -- Synthetic tasks -----------------------------------------------------------------------------

def synthetic_pairs(
    task: str = "copy",
    num_examples: int = 1000,
    vocab_size: int = 64,
    min_len: int = 1,
    max_len: int = 16,
    seed: int = 0,
) -> list[tuple[list[int], list[int]]]:
    """`num_examples` pairs `(source, target)` of token ids for a task that needs no files.

    Each source has a length drawn uniformly from `[min_len, max_len]` and tokens drawn
    uniformly from `[3, vocab_size)` (0, 1, 2 stay free for pad, bos, eos). `copy`: the
    target is the source; `reverse`: the target is the source reversed. The same arguments
    always give the same pairs.
    """
    if task not in SYNTHETIC_TASKS:
        raise DataError(f"unknown synthetic task {task!r}; choose one of {', '.join(SYNTHETIC_TASKS)}")
    checks = (("num_examples", num_examples, 0), ("vocab_size", vocab_size, FIRST_DATA_ID + 1),
              ("min_len", min_len, 1), ("max_len", max_len, 1))
    for name, value, minimum in checks:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
            raise DataError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if min_len > max_len:
        raise DataError(f"min_len ({min_len}) must not exceed max_len ({max_len})")
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_len, max_len + 1, size=num_examples)
    tokens = rng.integers(FIRST_DATA_ID, vocab_size, size=int(lengths.sum()))
    pairs = []
    start = 0
    for length in lengths.tolist():
        src = tokens[start:start + length].tolist()
        start += length
        pairs.append((src, list(src) if task == "copy" else src[::-1]))
    return pairs
