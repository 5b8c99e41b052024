"""`rosetta example opus-mt DIR`: a small trained directory laid out as Helsinki-NLP publishes
opus-mt, built offline from Multi30k, for trying the Marian workflows (translate, convert,
CTranslate2, diff against transformers) without a download. The test suite's opus-mt case is this.

What it holds, as opus-mt does: `source.spm` and `target.spm` (unigram SentencePiece models,
trained with `sentencepiece` on German and English Multi30k text); `vocab.json`, the joint
vocabulary (`</s>` 0, `<unk>` 1, the pieces of both models, two language codes, `<pad>` last), or
with `separate=True` `vocab.json` + `target_vocab.json` and `"separate_vocabs": true`;
`tokenizer_config.json`; `config.json` + `model.safetensors` of a small `MarianMTModel` trained
here for a few hundred steps (`<pad>` is the decoder start and its embedding row is zero, as in
opus-mt, where Hugging Face's conversion appended it as a zero row: the tied output projection
would train it, so each step sets it back); `generation_config.json` as opus-mt writes it (beam 4,
`<pad>` banned, eos forced at max_length, logits renormalized).

The model is Hugging Face's own code (transformers, torch, sentencepiece: the extras), not ours:
the directory is what transformers writes and reads. It is built in a temporary folder beside DIR
and renamed into place, so an interrupted build never leaves a DIR that looks complete.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import importlib
import io
import json
import os
import re
import secrets
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from rosetta.errors import RosettaError
from rosetta.harness.data import DataError, read_lines, resolve_data_dir

LANGUAGE_CODES = (">>en<<", ">>fr<<")  # in the joint vocabulary, as multi-target opus-mt models have
SENTENCES = 3000  # Multi30k training pairs the model learns from
MAX_POSITIONS = 96  # max_position_embeddings and generation max_length
# Adam steps of the default build: at 750 it translates the journey's sentences recognisably (15.6
# BLEU on the first 200 of test2016 at b7a7bc1, 2-core AMD EPYC, about 45 s); at 250, 6.2; at 40 it
# repeats one word (docs/real-models.md).
DEFAULT_STEPS = 750
REQUIRED = ("torch", "transformers", "sentencepiece")  # what the build imports; each an extra


def multi30k(lang: str, count: int, split: str = "train",
             data_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """The first `count` sentences of one language of a Multi30k split (rosetta.harness.data's reader:
    `data_dir`, else $ROSETTA_DATA_DIR, else the package's bundled copy)."""
    path = resolve_data_dir(data_dir) / f"{split}.{lang}.gz"
    lines = read_lines(path)
    if len(lines) < count:
        raise DataError(f"data file {str(path)!r} has {len(lines)} lines; the example model needs {count}")
    return lines[:count]


def train_spm(sentences: list[str], vocab_size: int) -> bytes:
    """A unigram SentencePiece model of `sentences`, serialized (deterministic: one thread, no shuffle)."""
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


def check_example_args(out: str | os.PathLike[str], steps: int = DEFAULT_STEPS) -> Path:
    """Everything refusable before any work: DIR (absent or an empty folder, in a folder that can be
    written, its name short enough for the build's folder beside it, not a dangling symlink, not
    being built by another `rosetta example`), `steps` (>= 1) and the packages. Raises RosettaError
    naming DIR, the flag or the package. Returns the folder to build: DIR as an absolute path, or
    the folder DIR links to when DIR is a symlink to an empty folder (the link is kept)."""
    given = Path(out)
    out = Path(os.path.abspath(given))  # "." has no name to put the build's folder beside
    folder = _nearest_folder(given, out)
    _check_name_lengths(given, out, folder)
    if out.is_symlink() and not out.exists():
        raise RosettaError(f"{given}: a symlink to {os.readlink(out)}, which does not exist; create that "
                           "folder, or name a new or empty folder")
    _check_unused(given, out)
    out = Path(os.path.realpath(out))  # a symlink to an empty folder: build beside its target
    if out != Path(os.path.abspath(given)):
        folder = _nearest_folder(given, out)
        _check_name_lengths(given, out, folder)
    _probe_folder(given, folder)
    _check_not_building(given, out)
    sweep_partials(out)
    if steps < 1:
        raise RosettaError(f"--steps {steps}: the model trains for at least 1 step")
    for name in REQUIRED:
        try:
            importlib.import_module(name)
        except ImportError:
            raise RosettaError(f"the example model needs {name!r}, which is not installed "
                               f"(pip install {name}; or pip install 'rosetta-transformer[dev]')") from None
    return out


def _check_unused(given: Path, out: Path) -> None:
    if out.is_dir() and any(out.iterdir()):
        raise RosettaError(f"{given}: exists and is not empty; name a new or empty folder")
    if out.exists() and not out.is_dir():
        raise RosettaError(f"{given}: exists and is not a folder; name a new or empty folder")


def _partial_name(name: str) -> str:
    """The build's folder beside DIR, the longest name the build creates there (the lock's is shorter)."""
    return f".{name}.partial-{os.getpid()}-{secrets.token_hex(4)}"


def _nearest_folder(given: Path, out: Path) -> Path:
    """The deepest existing folder on the way to `out` (absolute); a file or dangling link on the
    way is refused, naming it."""
    folder = Path(out.anchor)
    for part in out.parts[1:-1]:
        step = folder / part
        if not os.path.isdir(step):  # False too for a name the file system finds too long
            if os.path.lexists(step):
                what = "a file" if os.path.exists(step) else "a broken symlink"
                raise RosettaError(f"cannot write {given}: {step} is {what}, not a directory")
            break
        folder = step
    return folder


def _check_name_lengths(given: Path, out: Path, folder: Path) -> None:
    """Every name the build creates fits the file system (PC_NAME_MAX, in bytes): the missing
    folders on the way to DIR, and beside DIR its build folder `.DIR.partial-PID-XXXXXXXX`, which is
    DIR's name and some 25 bytes more (a name that fits alone can overflow there)."""
    try:
        limit = os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return  # the file system does not say; the build's own errors stay one line (building)
    for part in out.relative_to(folder).parts[:-1]:
        if (size := len(os.fsencode(part))) > limit:
            raise RosettaError(f"cannot write {given}: the folder name {part[:40]}... is {size} bytes; "
                               f"the file system of {folder} allows {limit}")
    extra = len(os.fsencode(_partial_name(out.name))) - len(os.fsencode(out.name))
    size = len(os.fsencode(out.name))
    if size + extra > limit:
        raise RosettaError(f"{given}: its name is {size} bytes, too long here: the build's folder beside "
                           f"it (.NAME.partial-PID-XXXXXXXX) adds {extra} and the file system of {folder} "
                           f"allows {limit} (PC_NAME_MAX); name a folder of at most {limit - extra} bytes")


def _probe_folder(given: Path, folder: Path) -> None:
    """Create and remove a folder in `folder`, as the build will (os.access says yes to root on a
    read-only mount)."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".rosetta-probe-", dir=folder))
    except OSError as e:
        raise RosettaError(f"cannot write {given}: a folder cannot be created in {folder} "
                           f"({e.strerror or type(e).__name__})") from None


def _lock_path(out: Path) -> Path:
    return out.with_name(f".{out.name}.lock")


def _check_not_building(given: Path, out: Path) -> None:
    """Refuse DIR while another `rosetta example` holds its lock (`building`), naming its process."""
    try:
        fd = os.open(_lock_path(out), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return  # no lock file: nobody is building DIR
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 16, 0).decode("ascii", "replace").strip()
        raise RosettaError(f"{given}: another rosetta example (process {holder or 'unknown'}) is building it "
                           "now; wait for it to finish, or name another folder") from None
    finally:
        os.close(fd)


@contextlib.contextmanager
def _locked(out: Path) -> Iterator[None]:
    """DIR's lock, `.DIR.lock` beside it, flock'ed for the block (the kernel drops it when the process
    dies, even by kill -9) and holding our pid; removed at the end. A second build of the same DIR is
    refused at once, where it used to build for nothing and fail at the rename."""
    lock = _lock_path(out)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            _check_not_building(out, out)  # names the holder
            continue  # it finished between the two looks: try again
        try:  # the holder removes the file before unlocking: a lock on a removed file is no lock
            if os.path.samestat(os.fstat(fd), os.stat(lock)):
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        yield
    finally:
        lock.unlink(missing_ok=True)
        os.close(fd)


@contextlib.contextmanager
def building(out: Path) -> Iterator[Path]:
    """A fresh build folder beside `out` (as check_example_args returned it) for the block, renamed to
    `out` when the block ends, removed on every other exit; DIR's lock held throughout, and DIR
    checked again under it (another build may have finished while this one read its data)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with _locked(out):
        _check_unused(out, out)
        work = out.with_name(_partial_name(out.name))
        work.mkdir()  # as `out` would be made (mode 0777 less the umask; tempfile.mkdtemp forces 0700)
        try:
            yield work
            if out.is_dir():
                try:
                    out.rmdir()  # empty (checked); rename needs the name free, or an empty folder on POSIX
                except OSError as e:
                    raise RosettaError(f"{out}: something wrote into it during the build ({e.strerror}); "
                                       "its files are left as they are and this build is discarded") from None
            work.rename(out)
        except BaseException:  # an interrupt too: no half-built folder is left behind
            shutil.rmtree(work, ignore_errors=True)
            raise


def sweep_partials(out: Path) -> list[Path]:
    """Remove the build folders `.DIR.partial-<pid>-<hex>` beside `out` whose process no longer
    exists (a build killed with -9 cannot remove its own); say so on stderr, and return them. One
    that cannot be removed is named in a RosettaError; a live process's is left to it."""
    swept = []
    for work in sorted(out.parent.glob(f".{glob.escape(out.name)}.partial-*")):
        match = re.fullmatch(rf"\.{re.escape(out.name)}\.partial-([0-9]+)-[0-9a-f]+", work.name)
        if match is None or not work.is_dir() or work.is_symlink() or _alive(int(match[1])):
            continue
        try:
            shutil.rmtree(work)
        except OSError as e:
            raise RosettaError(f"{work}: a build folder left by process {match[1]}, which no longer exists, "
                               f"cannot be removed ({e.strerror or e}); remove it") from None
        print(f"rosetta: removed {work} (left by process {match[1]}, which no longer exists)",
              file=sys.stderr)
        swept.append(work)
    return swept


def _alive(pid: int) -> bool:
    """Whether process `pid` exists here (signal 0 checks without sending; another user's: alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0
    return True


def build_opus_mt_dir(out: str | os.PathLike[str], separate: bool = False, steps: int = DEFAULT_STEPS,
                      seed: int = 0, spm_size: int = 500,
                      data_dir: str | os.PathLike[str] | None = None) -> Path:
    """Write the directory (see the module docstring) into `out`, a new or empty folder, and return it.

    The same arguments and data give the same bytes (the tests compare against transformers on it).
    Built in a temporary folder beside `out`, then renamed to it: nothing is left under `out` if the
    build stops. Raises RosettaError for a missing package, a used `out`, or unreadable data.
    """
    named = Path(os.path.abspath(out))
    out = check_example_args(out, steps)
    de, en = multi30k("de", SENTENCES, data_dir=data_dir), multi30k("en", SENTENCES, data_dir=data_dir)
    with building(out) as work, _quiet():
        _write(work, de, en, separate, steps, seed, spm_size)
    return named


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Without transformers' save progress bar and its advice to install sacremoses (Marian's
    tokenizer does not use it): the command's output is what it wrote. Restored afterwards."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Recommended: pip install sacremoses")
            yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def _write(out: Path, de: list[str], en: list[str], separate: bool, steps: int, seed: int,
           spm_size: int) -> None:
    """The files of the directory into `out` (a fresh folder), generation_config.json last."""
    import torch
    from transformers import MarianConfig, MarianMTModel, MarianTokenizer

    src_spm, tgt_spm = train_spm(de, spm_size), train_spm(en, spm_size)
    (out / "source.spm").write_bytes(src_spm)
    (out / "target.spm").write_bytes(tgt_spm)
    if separate:  # one vocabulary a side, of equal size, so that <pad> (last) has one id in both
        src_vocab, tgt_vocab = marian_vocab(spm_pieces(src_spm)), marian_vocab(spm_pieces(tgt_spm))
        if len(src_vocab) != len(tgt_vocab):
            raise RosettaError(f"separate vocabularies of {len(src_vocab)} and {len(tgt_vocab)} pieces: "
                               "<pad> (last) would have two ids; the data gives SentencePiece too few pieces")
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

    def zero_start_row() -> None:  # opus-mt: the <pad> (decoder start) row is zero; the tied head trains it
        with torch.no_grad():
            model.model.encoder.embed_tokens.weight[pad] = 0
            model.model.decoder.embed_tokens.weight[pad] = 0

    train_hf(model, ids, pad, steps, seed, zero_start_row)
    model.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps(
        {"bad_words_ids": [[pad]], "bos_token_id": 0, "decoder_start_token_id": pad, "eos_token_id": 0,
         "forced_eos_token_id": 0, "max_length": MAX_POSITIONS, "num_beams": 4, "pad_token_id": pad,
         "renormalize_logits": True}, indent=2))


def train_hf(model, ids: list[tuple[list[int], list[int]]], pad: int, steps: int, seed: int,
             after_step: Callable[[], None] | None = None) -> None:
    """`steps` Adam updates (lr 3e-3) of a Hugging Face seq2seq `model` on batches of 32 of the
    (source ids, label ids) pairs `ids` no longer than 48 tokens, drawn with numpy's generator at `seed`
    (`after_step` after each update); the model is left in eval mode. The examples' training (opus-mt's
    MarianMTModel, example_nllb's M2M100ForConditionalGeneration)."""
    import torch

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
        if after_step is not None:
            after_step()
    model.eval()
