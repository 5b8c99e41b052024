"""The two sides of `rosetta diff`: what each argument names, and running it on one batch.

A side is one of
    PATH[@BACKEND[:DTYPE]]  a model file or directory rosetta.interop.convert.read_model reads (a
                            rosetta checkpoint, a Marian directory, a flax-wmt msgpack), run in
                            BACKEND (default numpy) at DTYPE (default the backend's first: numpy's
                            is float64, so a converted model runs as the float64 reference);
    DIR@transformers        a Marian (M2M100) directory run by Hugging Face's own MarianMTModel
                            (M2M100ForConditionalGeneration) at float32, its stages captured with
                            hooks (rosetta/diff/forward/transformers_side.py);
    PATH.npz                an activation dump (rosetta/diff/shared/dump.py): stages someone else's code
                            computed, on the batch stored with them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rosetta.backends import MODEL_BACKENDS, BackendModel, get_backend
from rosetta.config import ModelConfig
from rosetta.diff.forward import transformers_side
from rosetta.diff.shared.dump import Dump, read_dump, stage_kind
from rosetta.diff.shared.metrics import DUMP_TOLERANCES, FLOAT64_TOLERANCE, LOW_PRECISION, dump_tolerance
from rosetta.errors import ConfigError, InputError
from rosetta.params import Params
from rosetta.parity import TOLERANCES, diagnostic_batch, random_batch

# The fields that fix the stages' shapes: two sides that differ here cannot be compared.
SHAPE_FIELDS = ("src_vocab_size", "tgt_vocab_size", "d_model", "num_heads", "num_encoder_layers",
                "num_decoder_layers", "d_ff")
# The batches `rosetta diff` may run two models on when --src is not given (docs/diff.md).
BATCHES = {"diagnostic": diagnostic_batch, "random": random_batch}
# What may follow '@': one of our backends, or the original implementation of a Marian directory.
SIDE_BACKENDS = (*MODEL_BACKENDS, transformers_side.BACKEND)
_SPEC = re.compile(r"(?P<path>.+?)(@(?P<backend>[a-z]+)(:(?P<dtype>[a-z0-9]+))?)?")


@dataclass
class Side:
    """One side: a model (config, params, backend, dtype), Hugging Face's MarianMTModel of a Marian
    directory (`original`, with the weights read_model reads from it), or a dump."""

    label: str
    model: BackendModel | None = None
    weights: tuple[ModelConfig, Params] | None = None
    dump: Dump | None = None
    original: Any = None

    @property
    def config(self) -> ModelConfig | None:
        return None if self.weights is None else self.weights[0]

    @property
    def tolerance(self) -> float:
        """This side's agreement bound with the reference (rosetta.parity.TOLERANCES)."""
        if self.model is not None:
            key = (self.model.name, self.model.dtype)
            return FLOAT64_TOLERANCE if key == ("numpy", "float64") else TOLERANCES.get(key, 3e-2)
        if self.original is not None:
            return DUMP_TOLERANCES[transformers_side.DTYPE]
        return dump_tolerance(self.dump)

    @property
    def low_precision(self) -> str | None:
        """The 16-bit type this side computes in (LOW_PRECISION), None for 32 and 64 bits. A dump
        says only its arrays' dtype: float16 arrays (NumPy has no bfloat16) count as 16-bit."""
        if self.model is not None:
            return self.model.dtype if self.model.dtype in LOW_PRECISION else None
        if self.dump is not None:
            return next((str(v.dtype) for v in self.dump.stages.values() if str(v.dtype) in LOW_PRECISION),
                        None)
        return None

    def stages(self, src: np.ndarray, tgt: np.ndarray) -> dict[str, np.ndarray]:
        """Every stage this side has for the batch (src, tgt); a dump must hold that batch."""
        if self.original is not None:
            return transformers_side.marian_stages(self.original, src, tgt)
        if self.dump is None:
            return self.model.stages(src, tgt, fine=True)
        if self.dump.src.shape != np.shape(src) or self.dump.tgt.shape != np.shape(tgt) \
                or (self.dump.src != src).any() or (self.dump.tgt != tgt).any():
            raise InputError(f"{self.label}: the dump holds another batch (src {self.dump.src.shape}, "
                             f"tgt {self.dump.tgt.shape}) than the one asked for (src {np.shape(src)}, "
                             f"tgt {np.shape(tgt)}); two dumps must be computed on the same src and tgt")
        return self.dump.stages


def _split(spec: str) -> tuple[str, str | None, str | None]:
    m = _SPEC.fullmatch(spec)
    path, backend, dtype = m["path"], m["backend"], m["dtype"]
    if backend is not None and backend not in SIDE_BACKENDS:  # an '@' that is part of the path
        path, backend, dtype = spec, None, None
    return path, backend, dtype


def is_dump(spec: str) -> bool:
    return Path(_split(spec)[0]).suffix == ".npz"


def parse_side(spec: str, cfg: ModelConfig | None = None) -> Side:
    """The side a command-line argument names (see the module docstring). For a dump, `cfg` is
    the model it will be compared with: its widths bound what the dump may claim before any of
    its data is read (rosetta.diff.shared.dump.read_dump)."""
    from rosetta.interop.convert import read_model  # the converters pull in the formats' readers

    path, backend, dtype = _split(spec)
    if Path(path).suffix == ".npz":
        if backend is not None:
            raise ConfigError(f"{spec}: a dump holds computed stages; it has no backend to run")
        return Side(spec, dump=read_dump(path, cfg))
    if backend == transformers_side.BACKEND and dtype not in (None, transformers_side.DTYPE):
        raise ConfigError(f"{spec}: @{backend} runs Hugging Face's model at {transformers_side.DTYPE} only")
    cfg, params = read_model(path)
    if backend == transformers_side.BACKEND:
        return Side(spec, weights=(cfg, params), original=transformers_side.load_marian_model(path))
    model = get_backend(backend or "numpy")(cfg, params, dtype)
    return Side(spec, model=model, weights=(cfg, params))


def parse_sides(a: str, b: str) -> tuple[Side, Side]:
    """Both sides, a model side first so that a dump is read knowing the model's shape."""
    if is_dump(a) and not is_dump(b):
        side_b = parse_side(b)
        return parse_side(a, side_b.config), side_b
    side_a = parse_side(a)
    return side_a, parse_side(b, side_a.config)


def check_compatible(a: Side, b: Side) -> None:
    """A ConfigError naming the first field (or dump stage) whose shape differs between sides."""
    if a.config is not None and b.config is not None:
        for field in SHAPE_FIELDS:
            x, y = getattr(a.config, field), getattr(b.config, field)
            if x != y:
                raise ConfigError(f"the sides differ in {field}: {x} ({a.label}) vs {y} ({b.label}); "
                                  f"only models of one shape can be compared stage by stage")
    for model_side, dump_side in ((a, b), (b, a)):
        if model_side.config is not None and dump_side.dump is not None:
            _check_dump_fits(model_side.config, dump_side)


def _check_dump_fits(cfg: ModelConfig, side: Side) -> None:
    """The dump's widths and layer indices must be the model's."""
    for name, value in side.dump.stages.items():
        kind = stage_kind(name)
        width = {"enc": ("d_model", value.shape[-1]), "dec": ("d_model", value.shape[-1]),
                 "logits": ("tgt_vocab_size", value.shape[-1])}.get(kind, ("num_heads", value.shape[1]))
        if getattr(cfg, width[0]) != width[1]:
            raise ConfigError(f"{side.label}: stage {name!r} has {width[0]} {width[1]}, the model has "
                              f"{getattr(cfg, width[0])}")
        layer = re.match(r"(encoder|decoder)\.layers\.(\d+)", name)
        if layer and int(layer[2]) >= getattr(cfg, f"num_{layer[1]}_layers"):
            raise ConfigError(f"{side.label}: stage {name!r}: the model has "
                              f"{getattr(cfg, f'num_{layer[1]}_layers')} {layer[1]} layers")


def pick_batch(sides: Sequence[Side], seed: int = 0,
               kind: str = "diagnostic") -> tuple[np.ndarray, np.ndarray]:
    """The batch both sides run on: a dump's own (two dumps must agree), else BATCHES[kind] of the
    first side's config (rosetta.parity.diagnostic_batch by default: every catalogue entry can show)."""
    dumps = [s for s in sides if s.dump is not None]
    if dumps:
        src, tgt = dumps[0].dump.src, dumps[0].dump.tgt
        for other in dumps[1:]:
            other.stages(src, tgt)  # refuses another batch, naming it
        return src, tgt
    if kind not in BATCHES:
        raise InputError(f"unknown batch {kind!r}; known: {', '.join(BATCHES)}")
    return BATCHES[kind](sides[0].config, seed=seed)


def side_tokenizer(sides: Sequence[Side]) -> Any:
    """The tokenizer a model side's directory or checkpoint sidecar holds (Marian's SentencePiece
    files, M2M100's sentencepiece.bpe.model + vocab.json, or our tokenizer.json), checked against
    that side's model; the first side's first, None when no side's directory holds one."""
    from rosetta.interop.m2m100_tokenizer import find_text_tokenizer
    from rosetta.interop.marian_files import companion_dir

    for side in sides:
        folder = companion_dir(_split(side.label)[0])  # a directory, or a checkpoint file's sidecar
        tokenizer = find_text_tokenizer(folder) if side.config is not None and folder is not None else None
        if tokenizer is not None:
            tokenizer.check_fits(side.config)
            return tokenizer
    return None


def translated_input(sides: Sequence[Side], src: np.ndarray) -> np.ndarray:
    """Decoder input ids [B, T] for `src`: the start token, then the greedy translation of the
    first side that is one of our models (a real sentence pair, not a random one), padded. The
    first token is forced as generate forces it: the forced_bos_token_id of that side's
    generation_config.json (M2M100's and NLLB's target language code), where it has one."""
    from rosetta.interop.marian_files import companion_dir, read_generation_settings

    side = next((s for s in sides if s.model is not None), None)
    if side is None:
        raise InputError(f"without --tgt the decoder input is a translation by one of our backends "
                         f"({', '.join(MODEL_BACKENDS)}), and no side is one; give --tgt")
    cfg = side.config
    folder = companion_dir(_split(side.label)[0])  # a directory, or a checkpoint file's sidecar
    settings = read_generation_settings(folder, cfg) if folder is not None else None
    forced = None if settings is None else settings.forced_first
    rows = [([cfg.bos_id] + tokens)[:cfg.max_len]
            for tokens in side.model.generate(src, 1, forced_first=forced).tokens]
    tgt = np.full((len(rows), max(map(len, rows))), cfg.pad_id, dtype=np.int64)
    for b, row in enumerate(rows):
        tgt[b, :len(row)] = row
    return tgt


def pad_id(sides: Sequence[Side]) -> int:
    """The pad id that decides which positions count: a model side's; 0 between two dumps."""
    return next((s.config.pad_id for s in sides if s.config is not None), 0)
