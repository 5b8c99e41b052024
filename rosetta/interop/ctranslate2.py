"""Our model -> a CTranslate2 model directory, through CTranslate2's own converter.

    rosetta convert de-en.safetensors de-en-ct2/ --to ctranslate2

CTranslate2 is what opus-mt users deploy with. Its binary format is CTranslate2's business: we
write the model as Hugging Face Marian (`write_marian` + the tokenizer files, `copy_companions`)
into a temporary folder and run `ctranslate2.converters.TransformersConverter` on it, as a user
would on an opus-mt download. What its Marian loader (`MarianMTLoader` in
ctranslate2/converters/transformers.py, checked against 4.8.5) assumes, and we check first:

- the decoder starts from a zero vector (`start_from_zero_embedding`), not from the start
  token's row: the target embedding row of `bos_id` (Marian's `decoder_start_token_id`;
  opus-mt's `<pad>`, a row Hugging Face's Marian conversion appends as zeros) must be exactly
  zero;
- the last row of the embeddings, the output projection and its bias is Hugging Face's added
  `<pad>` and is dropped unconditionally (`_remove_pad_weights`), the last vocabulary entry only
  when it is the string `<pad>`: `pad_id` must be the last id, and its token `<pad>`;
- one vocabulary, the tokenizer's `get_vocab()` (the source one), for both sides
  (`BartLoader.set_vocabulary`): separate source and target vocabularies are refused. Separate
  embedding *tables* over one vocabulary are fine: the loader copies all three.

What it takes as Marian computes it, so nothing to refuse: `scale_embedding` (its `embed_scale`),
every activation we have (relu, gelu, gelu_new, swish are in its `_SUPPORTED_ACTIVATIONS`),
`final_logits_bias` (kept when non-zero, its pad entry dropped with the rest), post-norm without
final or embedding LayerNorm; the rest of what Marian cannot hold `check_representable` refuses
(LayerNorm epsilon 1e-5 included). docs/ctranslate2.md.

Four more routes, chosen by the tokenizer that goes with the model (`route`):
- an M2M100 tokenizer (`sentencepiece.bpe.model`, rosetta/interop/m2m100_tokenizer.py): the model
  is written as an M2M100 directory (`write_m2m100` + the tokenizer files) and converted by the
  same TransformersConverter (its M2M100Loader: pre-norm, positions from row pad + 1, the decoder
  started from `</s>`'s row); its vocabulary lists the language codes read from the tokenizer's
  `additional_special_tokens`, which transformers 5's M2M100Tokenizer no longer fills, so the
  converter is handed a tokenizer that lists them (`_listing_codes`);
- an NLLB-200 tokenizer (`tokenizer.json` + `tokenizer_config.json`, NllbTokenizer,
  rosetta/interop/nllb_tokenizer.py): the same M2M100 directory with the NLLB tokenizer's own files
  beside it, converted by the plain TransformersConverter, whose AutoTokenizer loads NllbTokenizer:
  its get_vocab() by id (the pieces, the added tokens and the codes), then `madeupword`s up to the
  embedding's rows. CTranslate2 numbers a token by its place in that list: the export is refused
  where a place is not the token's id (`_check_places`);
- our BPE (`tokenizer.json`: a run of `rosetta train`, pad at 0): CTranslate2's spec API, filled as
  its own converters fill it (rosetta/interop/ctranslate2_spec.py);
- FSMT's (`vocab-src.json`, `vocab-tgt.json`, `merges.txt`: an FSMT directory or its checkpoint's
  sidecar): the same spec API with the two vocabularies by id ("fsmt"). TransformersConverter has no
  FSMT loader; the spec is filled as CTranslate2's fairseq converter fills fairseq's transformer.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from rosetta.checkpoint import check_params
from rosetta.config import ModelConfig
from rosetta.errors import CheckpointError, ConfigError
from rosetta.generation import GenerationSettings
from rosetta.interop import m2m100, marian, marian_files
from rosetta.interop.m2m100_tokenizer import M2M100TextTokenizer, find_text_tokenizer
from rosetta.interop.nllb_tokenizer import SPECIAL_TOKENS_MAP, TOKENIZER_JSON, NllbTextTokenizer
from rosetta.params import embedding_names
from rosetta.tokenizer import (
    TOKENIZER_CONFIG,
    VOCAB,
    SentencePieceTokenizer,
    Tokenizer,
    is_fsmt_tokenizer_dir,
)

PAD_TOKEN = "<pad>"  # the only last entry MarianMTLoader.get_vocabulary drops
INSTALL = "pip install -e '.[ctranslate2]' (ctranslate2, transformers, sentencepiece; and torch)"
# The files a CTranslate2 model directory may hold (an earlier export's are replaced).
CT2_FILES = ("model.bin", "shared_vocabulary.json", "source_vocabulary.json", "target_vocabulary.json",
             "vocabulary.json", "config.json")
NPZ_HINT = ("convert the original Marian model (its .npz and .yml vocabularies) with CTranslate2's "
            "ct2-marian-converter, which keeps both vocabularies")


class FsmtVocabularies(NamedTuple):
    """FSMTTokenizer's files in `directory`: its vocabularies are read, its Moses step never run."""
    directory: Path


def _tokenizer(source: str | os.PathLike | None, cfg: ModelConfig) -> Any:
    """The tokenizer going with the model (checked against it), or a ConfigError: CTranslate2's
    model directory holds the vocabulary, so there is no export without one."""
    found: Any = None
    if source is not None:
        marian_files.check_companions(source, cfg)  # broken files or another model's: named
        if Path(source).is_dir() and is_fsmt_tokenizer_dir(source):  # only the vocabularies are needed
            found = FsmtVocabularies(Path(source))
        else:
            found = find_text_tokenizer(source) if Path(source).is_dir() else Tokenizer.load(source)
    if found is None:
        where = "" if source is None else f" ({source} holds none)"
        raise ConfigError(f"--to ctranslate2 needs the model's tokenizer{where}: CTranslate2's model "
                          f"directory holds the vocabulary; convert a Marian directory, a checkpoint file "
                          f"with its NAME.tokenizer/ folder beside it, or a run directory")
    return found


def route(cfg: ModelConfig, tokenizer: str | os.PathLike | None) -> str:
    """How the model goes to CTranslate2, from its tokenizer (checked against it): "marian", "m2m100",
    "nllb", "spec" (our BPE) or "fsmt"; a ConfigError without one."""
    return _route_of(_tokenizer(tokenizer, cfg))


def _route_of(found: Any) -> str:
    if isinstance(found, FsmtVocabularies):
        return "fsmt"
    if isinstance(found, NllbTextTokenizer):
        return "nllb"
    if isinstance(found, M2M100TextTokenizer):
        return "m2m100"
    return "spec" if isinstance(found, Tokenizer) else "marian"


def check_ctranslate2(cfg: ModelConfig, params: Mapping[str, Any],
                      tokenizer: str | os.PathLike | None) -> None:
    """Refuse, naming the field, what CTranslate2's Marian loader would convert into a different
    model (the module docstring), and what Marian cannot hold. Writes nothing."""
    try:
        marian.check_representable(cfg)
    except ConfigError as e:
        raise ConfigError(f"--to ctranslate2 goes through a Marian export: {e}") from None
    check_params(cfg, params)
    if cfg.src_vocab_size != cfg.tgt_vocab_size:
        raise ConfigError(f"src_vocab_size={cfg.src_vocab_size} differs from tgt_vocab_size="
                          f"{cfg.tgt_vocab_size}: CTranslate2's Hugging Face Marian loader registers one "
                          f"vocabulary for both sides; {NPZ_HINT}")
    tok = _tokenizer(tokenizer, cfg)
    if isinstance(tok, SentencePieceTokenizer) and tok.separate_vocabs:
        raise ConfigError(f"{tok.directory / TOKENIZER_CONFIG}: separate_vocabs is true: CTranslate2's "
                          f"Hugging Face Marian loader registers the source vocabulary ({VOCAB}) for the "
                          f"target side too, so the target pieces would be wrong; {NPZ_HINT}")
    last = cfg.src_vocab_size - 1
    if cfg.pad_id != last:
        raise ConfigError(f"pad_id={cfg.pad_id} is not the last id of the vocabulary ({last}): CTranslate2's "
                          f"Marian loader drops the last row of the embeddings and the output layer as "
                          f"Hugging Face's added {PAD_TOKEN}, so another token's row would go (opus-mt "
                          f"models put {PAD_TOKEN} last; rosetta's BPE puts it at 0)")
    if isinstance(tok, SentencePieceTokenizer):
        pad_token, where = tok.special["pad"], tok.directory / VOCAB
    else:
        pad_token, where = tok.id_to_token(cfg.pad_id), Path(tokenizer)
    if pad_token != PAD_TOKEN:
        raise ConfigError(f"{where}: pad token {pad_token!r} (pad_id {cfg.pad_id}) is not {PAD_TOKEN!r}: "
                          f"CTranslate2's Marian loader drops the last vocabulary entry only when it is "
                          f"{PAD_TOKEN!r}, and the last rows of the weights always")
    name = embedding_names(cfg).tgt
    row = np.asarray(params[name][cfg.bos_id], dtype=np.float64)
    if np.any(row != 0):
        raise ConfigError(f"bos_id={cfg.bos_id}: the decoder start token's row of {name} is not zero "
                          f"(max |x| {np.abs(row).max():.3g}): CTranslate2 starts the decoder from a zero "
                          f"vector (start_from_zero_embedding), so it would translate differently; opus-mt "
                          f"models start from {PAD_TOKEN}, whose row is zero")


def search_note(settings: GenerationSettings, cfg: ModelConfig) -> str:
    """One line: what generation_config.json asks, as translate_batch's arguments. CTranslate2's
    model directory holds no search settings, and its converter reads none (docs/ctranslate2.md)."""
    # Hugging Face forces eos into the last place; CTranslate2 forces nothing (docs/ctranslate2.md).
    length = settings.max_new_tokens - 1 if settings.forced_eos else settings.max_new_tokens
    parts = [f"beam_size={settings.beam}", f"length_penalty={settings.alpha:g}",
             f"max_decoding_length={length}"]
    if settings.forced_first is not None:  # M2M100's and NLLB's target language code
        parts.append(f"target_prefix with the piece of id {settings.forced_first}")
    if settings.banned:
        parts.append(f"suppress_sequences with the pieces of ids {', '.join(map(str, settings.banned))}")
    start = ("" if settings.decoder_start == cfg.bos_id else
             f"; its decoder_start_token_id {settings.decoder_start} is not config.json's ({cfg.bos_id}), "
             f"and CTranslate2 starts from a zero vector")
    return (f"{settings.source}: a CTranslate2 model holds no search settings: give translate_batch "
            f"{', '.join(parts)}{start} (docs/ctranslate2.md)")


def _converter() -> Any:
    """CTranslate2's TransformersConverter class; it loads the Marian export with transformers
    and torch, so all three must be there."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        from ctranslate2.converters import TransformersConverter
    except ImportError as e:
        package = (e.name or "ctranslate2").split(".")[0]
        raise ConfigError(f"--to ctranslate2 needs the {package} package: {INSTALL}") from None
    return TransformersConverter


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' progress bars and advice while the converter loads our export (e.g. "pip
    install sacremoses", for a tokenizer feature CTranslate2 does not use) are not the user's
    business: `rosetta convert` prints one line. Its settings are restored afterwards."""
    from transformers.utils import logging

    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def _listing_codes(converter_class: Any) -> Any:
    """TransformersConverter whose tokenizer lists M2M100's language codes in special_tokens_map's
    additional_special_tokens, where CTranslate2's M2M100Loader (get_vocabulary) reads them."""
    class Converter(converter_class):
        def load_tokenizer(self, tokenizer_class: Any, model_name_or_path: str, **kwargs: Any) -> Any:
            tok = super().load_tokenizer(tokenizer_class, model_name_or_path, **kwargs)
            codes = sorted(tok.lang_token_to_id, key=tok.lang_token_to_id.get)
            base = type(tok)

            class Listed(base):  # the instance keeps its state; only the property changes
                @property
                def special_tokens_map(self) -> dict[str, Any]:
                    return {**base.special_tokens_map.fget(self), "additional_special_tokens": codes}

            tok.__class__ = Listed
            return tok

    return Converter


def _check_places(vocabulary: list[str], tokenizer: NllbTextTokenizer, out: Path) -> None:
    """CTranslate2 numbers a token by its place in the vocabulary its converter wrote (the tokenizer's
    get_vocab() sorted by id, then M2M100Loader's madeup words): every id of ours must be its
    token's place there, or CTranslate2 would read and write other tokens than the model's."""
    size = tokenizer.src_vocab_size
    for token_id in range(size):
        token = tokenizer.backend.id_to_token(token_id)
        placed = vocabulary[token_id] if token_id < len(vocabulary) else None
        if placed != token:
            raise CheckpointError(f"{out}: CTranslate2's vocabulary has {placed!r} at place {token_id}, "
                                  f"where {tokenizer.directory / TOKENIZER_JSON} has {token!r}: CTranslate2 "
                                  f"numbers tokens by their place, so the export would read other tokens")


def _move_into(staging: Path, out: Path) -> None:
    """Put the converted model at `out`. A missing or empty `out`: one rename of the whole folder.
    A folder that holds files (convert() let it through on --overwrite): CTranslate2's own files
    of an earlier export are replaced one by one, config.json last, and other files stay, as a
    Marian export leaves them (CTranslate2's force would remove the whole folder)."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        os.replace(staging, out)
        return
    new = sorted(p.name for p in staging.iterdir())
    for name in CT2_FILES:  # an earlier export's vocabulary file of another layout goes
        if name not in new and (out / name).is_file():
            (out / name).unlink()
    for name in sorted(new, key=lambda n: n == "config.json"):
        os.replace(staging / name, out / name)


def _convert(converter_class: Any, hf_dir: str, staging: Path, out: Path) -> None:
    """CTranslate2's converter on the Marian export; its refusals as one CheckpointError line."""
    try:
        with _quiet_transformers():
            converter_class(hf_dir).convert(str(staging))
    except Exception as e:  # noqa: BLE001 - third-party code: its refusals come in many types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{out}: CTranslate2's converter failed: {first}") from None


def write_ctranslate2(path: str | os.PathLike, cfg: ModelConfig, params: Mapping[str, Any],
                      tokenizer: str | os.PathLike | None = None) -> Path:
    """Write a CTranslate2 model directory (`ctranslate2.Translator(path)` loads it) through
    CTranslate2's converter; `tokenizer` is what convert() passes (marian_files.companion_dir).
    Everything is checked before anything is written; a failed conversion leaves `path` as it was."""
    found = _tokenizer(tokenizer, cfg)  # NLLB-200's tokenizer.json is 17 MB: read once
    way = _route_of(found)
    if way == "marian":
        check_ctranslate2(cfg, params, tokenizer)
    elif way in ("m2m100", "nllb"):
        check_params(cfg, params)
        try:
            m2m100.check_representable(cfg)
        except ConfigError as e:
            raise ConfigError(f"--to ctranslate2 goes through an M2M100 export: {e}") from None
    else:
        from rosetta.interop.ctranslate2_spec import check_spec

        check_spec(cfg, params)
    converter_class = _converter()
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out}: exists and is not a directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    # The model is converted beside `out` (moving it into place is then a rename on one file
    # system), into a folder the converter creates itself, with the usual permissions.
    holder = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        if way == "spec":
            from rosetta.interop.ctranslate2_spec import write_spec

            bpe = Path(tokenizer) / marian_files.BPE_FILE if Path(tokenizer).is_dir() else Path(tokenizer)
            write_spec(holder / "model", cfg, params, bpe)
        elif way == "fsmt":
            from rosetta.interop.ctranslate2_spec import write_fsmt_spec

            write_fsmt_spec(holder / "model", cfg, params, found.directory)
        else:
            with tempfile.TemporaryDirectory(prefix=f"rosetta-{way}-") as hf_dir:
                if way == "marian":
                    marian.write_marian(hf_dir, cfg, params)
                else:
                    m2m100.write_m2m100(hf_dir, cfg, params)
                if way == "nllb":  # NllbTokenizer's files as they are: AutoTokenizer reads what we read
                    for name in (TOKENIZER_JSON, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP):
                        if (found.directory / name).is_file():
                            shutil.copyfile(found.directory / name, Path(hf_dir) / name)
                else:
                    if way == "m2m100":
                        converter_class = _listing_codes(converter_class)
                    marian_files.copy_companions(tokenizer, cfg, hf_dir, way)
                _convert(converter_class, hf_dir, holder / "model", out)
            if way == "nllb":
                vocabulary = json.loads((holder / "model" / "shared_vocabulary.json").read_text("utf-8"))
                _check_places(vocabulary, found, out)
        _move_into(holder / "model", out)
    finally:
        shutil.rmtree(holder, ignore_errors=True)
    return out
