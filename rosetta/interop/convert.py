"""One roof over the converters: read a model in any format, write it in any other.

    rosetta.interop.convert.convert("opus-mt-de-en/", "de-en.safetensors")          # marian -> rosetta
    convert("model.msgpack", "hf-out/", to_format="marian", overrides={"max_len": 512})

Formats: `rosetta` (our checkpoint file, SPEC §3), `marian` (a Hugging Face `MarianMTModel`
directory), `flax-wmt` (Flax's `examples/wmt` parameter tree, msgpack), `fsmt` (a Hugging Face
`FSMTForConditionalGeneration` directory: config.json's model_type "fsmt"; written with `--to
fsmt`), `m2m100` (a Hugging Face `M2M100ForConditionalGeneration` directory, M2M100 and NLLB-200:
model_type "m2m_100"; written with `--to m2m100`). `nn-transformer` takes module objects, not a
file: `read_nn_transformer` brings it under the same roof for Python users. The input format is
detected where it is unambiguous; the output
format comes from the destination's name (`.safetensors` -> rosetta, `.msgpack` -> flax-wmt, a
directory -> marian) unless given. Whatever the output format cannot represent is refused, naming
the config field, before anything is written.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from rosetta.checkpoint import FORMAT, load_checkpoint, read_header, save_checkpoint
from rosetta.config import ModelConfig
from rosetta.errors import CheckpointError, ConfigError, RosettaError
from rosetta.files import leftover_temporary
from rosetta.interop import flax_msgpack, flax_wmt, fsmt, m2m100, marian, marian_files
from rosetta.params import Params

FORMATS = ("rosetta", "marian", "flax-wmt", "ctranslate2", "fsmt", "m2m100")
WRITE_ONLY = ("ctranslate2",)  # CTranslate2's model directory is an output only
READ_FORMATS = tuple(f for f in FORMATS if f not in WRITE_ONLY)
FORMAT_NAMES = {"rosetta": "rosetta", "marian": "Marian", "flax-wmt": "Flax WMT",
                "ctranslate2": "CTranslate2", "fsmt": "FSMT", "m2m100": "M2M100"}
TOKENIZER_CLASSES = {"marian": "MarianTokenizer", "fsmt": "FSMTTokenizer", "m2m100": "M2M100Tokenizer"}
SUFFIXES = {".safetensors": "rosetta", ".msgpack": "flax-wmt"}


def _is_rosetta(path: Path) -> bool:
    """A safetensors file whose metadata says our format (header only; never raises)."""
    try:
        return dict(read_header(path).metadata).get("format") == FORMAT
    except (OSError, CheckpointError):
        return False


def is_marian_like(path: str | os.PathLike) -> bool:
    """A directory holding config.json: a Hugging Face model directory, whatever that file says
    (detect_format reads it and names it when it is broken). Run and checkpoint directories of
    `rosetta train` never hold one."""
    return Path(path).is_dir() and (Path(path) / marian.CONFIG_FILE).is_file()


def _check_marian_config(path: Path) -> None:
    """A Marian-like directory's config.json must be JSON saying model_type "marian"; a
    ConfigError naming the file otherwise (not the weights file beside it)."""
    config = path / marian.CONFIG_FILE
    model_type = marian.read_config(path).get("model_type")
    if model_type != "marian":
        raise ConfigError(f"{config}: model_type is {model_type!r}, not 'marian', 'fsmt' or 'm2m_100' "
                          f"(rosetta reads Hugging Face MarianMTModel, FSMTForConditionalGeneration and "
                          f"M2M100ForConditionalGeneration directories)")


def _msgpack_problem(path: Path) -> str | None:
    """Why a .msgpack file is not a Flax WMT params tree, from flax_msgpack's full parse."""
    try:
        flax_msgpack.decode_tree(path.read_bytes(), str(path))
    except OSError as e:
        return f"{path}: cannot read: {e.strerror or e}"
    except RosettaError as e:
        # The reader's message names the file, then why; keep why, name the file once.
        detail = str(e).removeprefix(f"{path}: ").split("truncated?): ", 1)[-1]
        return f"{path}: not a valid flax msgpack file (truncated?): {detail}"
    except MemoryError:
        raise
    except Exception as e:  # a parser's own exception on hostile bytes
        return f"{path}: not a valid flax msgpack file (truncated?): {type(e).__name__}: {e}"
    return (f"{path}: a msgpack tree, but not Flax examples/wmt params (an encoder with encoderblock_0 "
            f"and encoder_norm, and a decoder); pass --from {'|'.join(READ_FORMATS)}")


def detect_format(path: str | os.PathLike) -> str:
    """The format of an existing input, or a ConfigError (CheckpointError) naming the file that
    is broken."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if path.is_dir():
        if is_marian_like(path):
            if fsmt.is_fsmt(path):  # config.json's model_type decides
                return "fsmt"
            if m2m100.is_m2m100(path):
                return "m2m100"
            _check_marian_config(path)
            return "marian"
        if (path / "model.safetensors").is_file():
            return "rosetta"  # a checkpoint directory of a training run
        raise ConfigError(f"{path}: a directory that is neither a Marian model (config.json with "
                          f"model_type 'marian') nor a checkpoint directory (model.safetensors)")
    if not path.is_file():  # a device, a FIFO, a socket: not opened (a FIFO's open waits for a writer)
        raise CheckpointError(f"{path}: not a regular file or a directory")
    if flax_wmt.is_flax_wmt(path):
        return "flax-wmt"
    if _is_rosetta(path):
        return "rosetta"
    if path.suffix.lower() == ".msgpack":
        raise ConfigError(_msgpack_problem(path))
    raise ConfigError(f"{path}: format not recognised; pass --from {'|'.join(READ_FORMATS)}")


def output_format(path: str | os.PathLike) -> str:
    """The format a destination's name asks for: .safetensors, .msgpack, or no suffix (a Marian
    directory)."""
    suffix = Path(path).suffix.lower()
    if not suffix:
        return "marian"
    if suffix not in SUFFIXES:
        raise ConfigError(f"{path}: cannot tell the output format from the name; pass --to "
                          f"{'|'.join(FORMATS)}")
    return SUFFIXES[suffix]


def _check_format(fmt: str, flag: str) -> None:
    if fmt not in FORMATS:
        raise ConfigError(f"{flag} {fmt!r}: one of {', '.join(FORMATS)}")


def read_model(path: str | os.PathLike, fmt: str | None = None,
               overrides: Mapping[str, Any] | None = None) -> tuple[ModelConfig, Params]:
    """(config, canonical params) of `path` in format `fmt` (detected when None)."""
    path, overrides = Path(path), dict(overrides or {})
    fmt = fmt or detect_format(path)
    _check_format(fmt, "--from")
    if fmt in WRITE_ONLY:
        raise ConfigError(f"--from {fmt}: rosetta writes {fmt} models but does not read them")
    if fmt == "rosetta":
        ckpt = load_checkpoint(path / "model.safetensors" if path.is_dir() else path)
        cfg = ckpt.config.replace(**overrides) if overrides else ckpt.config
        return cfg, dict(ckpt.params)
    if fmt == "marian":
        return marian.read_marian(path, **overrides)
    if fmt == "fsmt":
        return fsmt.read_fsmt(path, **overrides)
    if fmt == "m2m100":
        return m2m100.read_m2m100(path, **overrides)
    return flax_wmt.read_flax_wmt(path, **overrides)


def write_model(path: str | os.PathLike, cfg: ModelConfig, params: Mapping[str, Any], fmt: str,
                tokenizer: str | os.PathLike | None = None) -> Path:
    """Write `params` as `fmt`; refuses (writing nothing) what the format cannot represent.
    `tokenizer` (the files that go with the model: rosetta/interop/marian_files.py) is needed by
    ctranslate2, whose model directory holds the vocabulary."""
    _check_format(fmt, "--to")
    if fmt == "ctranslate2":
        from rosetta.interop.ctranslate2 import write_ctranslate2  # needs the ctranslate2 extra

        return write_ctranslate2(path, cfg, params, tokenizer)
    if fmt == "rosetta":
        return save_checkpoint(path, cfg, params)
    if fmt == "marian":
        return marian.write_marian(path, cfg, params)
    if fmt == "fsmt":
        return fsmt.write_fsmt(path, cfg, params, fsmt.langs_of(tokenizer))
    if fmt == "m2m100":
        return m2m100.write_m2m100(path, cfg, params)
    return flax_wmt.write_flax_wmt(path, cfg, params)


class Converted(NamedTuple):
    from_format: str
    to_format: str
    path: Path
    config: ModelConfig
    companions: list[Path]  # the tokenizer and generation config files written with the model
    notes: tuple[str, ...] = ()  # what the written model does not carry or do, one line each


def convert(src: str | os.PathLike, dst: str | os.PathLike, from_format: str | None = None,
            to_format: str | None = None, overrides: Mapping[str, Any] | None = None,
            overwrite: bool = False, tokenizer: str | os.PathLike | None = None) -> Converted:
    """Read `src`, write `dst`: the formats, the written path, the model's config and the files
    that went with it. A Marian or CTranslate2 output goes into a folder that is missing or
    empty, or any folder with `overwrite`. The tokenizer travels with the weights
    (rosetta/interop/marian_files.py): `src`'s own (a Marian directory's, a checkpoint file's
    sidecar) or `tokenizer` (a run's tokenizer.json), checked against the model before anything
    is written."""
    if Path(src).resolve() == Path(dst).resolve():
        raise ConfigError(f"{dst}: the destination is the source")
    fmt_in = from_format or detect_format(src)
    fmt_out = to_format or output_format(dst)
    _check_format(fmt_in, "--from")
    _check_format(fmt_out, "--to")
    # A folder already holding files (a Hugging Face download, an earlier export: telling them
    # apart by name would guess) keeps them unless the user says otherwise.
    folder_out = fmt_out in ("marian", "ctranslate2", "fsmt", "m2m100")
    leftovers = _leftovers(Path(dst)) if folder_out else {}
    if folder_out and not overwrite and Path(dst).is_dir() and any(
            entry not in leftovers for entry in Path(dst).iterdir()):
        files = ("config.json, model.bin and the vocabulary" if fmt_out == "ctranslate2"
                 else f"{marian.CONFIG_FILE}, {marian.WEIGHTS_FILE} and other files of the same names")
        raise ConfigError(f"{dst} is a folder that is not empty: writing the {FORMAT_NAMES[fmt_out]} model "
                          f"there replaces its {files}; pass --overwrite to replace them, or choose a new or "
                          f"empty folder")
    cfg, params = read_model(src, fmt_in, overrides)
    companions = tokenizer if tokenizer is not None else marian_files.companion_dir(src)
    # What `translate` would refuse of the tokenizer and generation_config.json, refused first.
    settings = marian_files.check_companions(companions, cfg) if companions is not None else None
    notes = list(settings.notes) if settings is not None else []
    if fmt_out in ("marian", "fsmt", "m2m100") and not marian_files.has_tokenizer(companions):
        notes.append(f"{src}: no tokenizer goes with the model (a Marian directory's own files, a checkpoint "
                     f"file's NAME.tokenizer/ folder), so {dst} gets none; "
                     f"{TOKENIZER_CLASSES[fmt_out]} needs one, and "
                     f"`rosetta translate` its --tokenizer")
    if fmt_out == "ctranslate2" and settings is not None:
        from rosetta.interop.ctranslate2 import search_note

        notes.append(search_note(settings, cfg))
    for leftover, who in leftovers.items():  # only now: a refusal above leaves the folder as it was
        leftover.unlink(missing_ok=True)
        notes.append(f"removed {leftover}, a partial file {who}")
    path = write_model(dst, cfg, params, fmt_out, companions)
    written = ([] if fmt_out == "ctranslate2"
               else marian_files.copy_companions(companions, cfg, path, fmt_out))
    return Converted(fmt_in, fmt_out, path, cfg, written, tuple(notes))


def _leftovers(dst: Path) -> dict[Path, str]:
    """The partial files that writes of ours killed part-way left in the folder `dst` (kill -9 during
    an export leaves only a hidden temporary: rosetta/files.py), each with who left it, to be removed
    before writing. One whose writer may still be running is refused, named: the folder is in use."""
    if not dst.is_dir():
        return {}
    stale = {}
    for entry in sorted(dst.iterdir()):
        found = leftover_temporary(entry)
        if found is not None and not found[0]:
            raise ConfigError(f"{dst} holds {entry.name}, a partial file {found[1]}; wait for that write, "
                              "or delete the file if it was stopped")
        if found is not None:
            stale[entry] = found[1]
    return stale


def read_nn_transformer(*args: Any, **kwargs: Any) -> tuple[ModelConfig, Params]:
    """`torch.nn.Transformer` modules -> (config, params): rosetta.interop.nn_transformer's
    `port_nn_transformer` (it needs torch, imported only here)."""
    from rosetta.interop.nn_transformer import port_nn_transformer

    return port_nn_transformer(*args, **kwargs)
