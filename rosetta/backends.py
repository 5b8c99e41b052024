"""The backend interface and the one registry of backends. Every backend exposes a `Model` of
the same shape, so swapping backends is changing one word:

    model = rosetta.load("model.safetensors", backend="torch")   # or "numpy", "jax"
    logits = model.logits(src, tgt)                               # NumPy in, NumPy out

`BACKENDS` says what each name stands for: its model (a module `<package>.backend` defining
`Model`, a `BackendModel` subclass), its trainer (a module defining `Trainer`, the
rosetta.training.Trainer protocol), the backend that decodes the weights it trains, and the
framework it needs. Adding a backend is one line there.
"""

from __future__ import annotations

import importlib
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from rosetta.checkpoint import check_params, load_checkpoint, save_checkpoint
from rosetta.config import ModelConfig
from rosetta.errors import InputError, RosettaError
from rosetta.generation import (
    LENGTH_RULES,
    NO_CONSTRAINTS,
    Constraints,
    Generation,
    check_alpha,
    check_constraints,
    check_scores,
)
from rosetta.inputs import check_int, check_src, check_tgt
from rosetta.params import Params


@dataclass(frozen=True)
class Backend:
    """What a backend name stands for."""

    model: str | None  # module defining `Model`; None: it trains only
    trainer: str | None  # module defining `Trainer`; None: forward and decoding only
    decoder: str  # the backend whose Model decodes the weights this one trains (BLEU during training)
    framework: str | None  # the pip extra that installs its framework (None: NumPy only)


BACKENDS: dict[str, Backend] = {
    "numpy": Backend("numpy_ref.backend", None, "numpy", None),
    "torch": Backend("torch_impl.backend", "torch_impl.train", "torch", "torch"),
    "jax": Backend("jax_impl.backend", "jax_impl.train", "jax", "jax"),
    # torch.nn.Transformer trained with the torch recipe (peer_impl/train.py); our torch model
    # decodes its weights, so a BLEU difference is training alone.
    "peer": Backend(None, "peer_impl.train", "torch", "torch"),
}
MODEL_BACKENDS: tuple[str, ...] = tuple(name for name, b in BACKENDS.items() if b.model)
TRAINING_BACKENDS: tuple[str, ...] = tuple(name for name, b in BACKENDS.items() if b.trainer)


def install_hint(name: str) -> str:
    return f"pip install 'rosetta-transformer[{BACKENDS[name].framework}]'"


class BackendModel(ABC):
    """One model in one framework. Public methods take and return NumPy arrays and check
    their inputs; subclasses implement the underscored framework-specific parts."""

    name: ClassVar[str]
    dtypes: ClassVar[tuple[str, ...]]  # compute dtypes this backend offers; the first is default

    def __init__(self, cfg: ModelConfig, params: Mapping[str, np.ndarray], dtype: str | None = None):
        dtype = dtype or self.dtypes[0]
        if dtype not in self.dtypes:
            raise RosettaError(
                f"backend {self.name!r} has no dtype {dtype!r}; choose one of {', '.join(self.dtypes)}"
            )
        check_params(cfg, params)
        self.config, self.dtype = cfg, dtype
        self._build(params)

    @classmethod
    def load(cls, path: str | os.PathLike, dtype: str | None = None) -> BackendModel:
        ckpt = load_checkpoint(path)
        return cls(ckpt.config, ckpt.params, dtype)

    def save(self, path: str | os.PathLike, dtype: str = "float32") -> None:
        save_checkpoint(path, self.config, self.to_params(), dtype)

    # -- the public, checked API ---------------------------------------------------------
    def encode(self, src: object) -> np.ndarray:
        """memory [B, S, d] for source ids [B, S]."""
        return self._encode(check_src(self.config, src))

    def decode(self, tgt: object, memory: object, src: object) -> np.ndarray:
        """decoder output [B, T, d] for decoder input ids [B, T] (starting with the start token),
        the encoder's `memory` [B, S, d], and the source ids it came from."""
        src = check_src(self.config, src)
        tgt = check_tgt(self.config, tgt, src.shape[0])
        memory = np.asarray(memory)
        if memory.shape != (*src.shape, self.config.d_model):
            raise InputError(
                f"memory has shape {memory.shape}, expected {(*src.shape, self.config.d_model)}"
            )
        return self._decode(tgt, memory, src)

    def logits(self, src: object, tgt: object) -> np.ndarray:
        """logits [B, T, V] for source ids [B, S] and decoder input ids [B, T]."""
        src = check_src(self.config, src)
        return self._logits(src, check_tgt(self.config, tgt, src.shape[0]))

    def stages(self, src: object, tgt: object, fine: bool = False) -> dict[str, np.ndarray]:
        """Every intermediate the parity tests compare: src_embed, encoder.layers.{i},
        encoder, tgt_embed, decoder.layers.{i}, decoder, logits. With `fine`, each sublayer
        too (docs/diff.md): `{encoder,decoder}.layers.{i}.self_attn`, `decoder.layers.{i}.cross_attn`
        and `.ffn` (the sublayer's output before dropout and the residual add) and
        `....self_attn.weights` / `....cross_attn.weights` (the softmax probabilities [B, h, Tq, Tk])."""
        src = check_src(self.config, src)
        return self._stages(src, check_tgt(self.config, tgt, src.shape[0]), fine)

    def generate(self, src: object, beam_size: int = 1, alpha: float = 0.6,
                 max_len_margin: int = 50, length_rule: str = "wu", *, banned: Iterable[int] = (),
                 renormalize: bool = False, max_new_tokens: int | None = None,
                 forced_eos: bool = False, forced_first: int | None = None) -> Generation:
        """Translate source ids [B, S]: greedy search for beam_size 1, else beam search with
        the length penalty of Wu et al. 2016 (the paper: beam 4, alpha 0.6, margin 50), or with
        `length_rule="hf"` Hugging Face generate's rule (log P / n^alpha, rosetta/generation.py's
        LENGTH_RULES; PITFALLS 15), to compare beam outputs with Hugging Face's. Each
        sentence emits at most (its real length + max_len_margin) tokens, capped at max_len.
        The keywords are the search settings of Hugging Face's generation_config.json
        (rosetta.generation.Constraints, docs/decoding.md): `banned` target ids never emitted
        (`bad_words_ids`; pad never is), `renormalize` the log-probabilities over the tokens left
        (`renormalize_logits`), `max_new_tokens` a cap on each sentence's tokens, eos included
        (`max_length` - 1), `forced_eos` eos as the only choice at a sentence's last position
        (`forced_eos_token_id`), `forced_first` the only token at the first position, with
        log-probability 0 (`forced_bos_token_id`: M2M100's and NLLB's target language code; it is
        part of the returned tokens, as in generate's output). Identical algorithm in every backend
        (numpy_ref/decode.py).
        Numeric arguments follow rosetta/inputs.py's rule (NumPy scalars welcome, bools refused);
        the beam is at most the target vocabulary size, alpha at most
        rosetta.generation.ALPHA_MAX. A search whose scores are not finite (weights that overflow
        the compute dtype) is refused, not returned."""
        src = check_src(self.config, src)
        beam_size, alpha, max_len_margin, constraints = check_search(
            self.config, beam_size, alpha, max_len_margin, length_rule, banned=banned,
            renormalize=renormalize, max_new_tokens=max_new_tokens, forced_eos=forced_eos,
            forced_first=forced_first)
        return check_scores(self._generate(src, beam_size, alpha, max_len_margin, length_rule, constraints),
                            f"backend {self.name} at {self.dtype}")

    def step_logits(self, src: object, tgt: object) -> np.ndarray:
        """logits [B, T, V] computed the way generation does, one position at a time (with the
        key/value cache where the backend has one). Equals `logits` for pad-free targets."""
        src = check_src(self.config, src)
        return self._step_logits(src, check_tgt(self.config, tgt, src.shape[0]))

    # -- what a backend implements -----------------------------------------------------
    @abstractmethod
    def _build(self, params: Mapping[str, np.ndarray]) -> None: ...

    @abstractmethod
    def to_params(self) -> Params:
        """The weights as canonical NumPy arrays (names and layout of the checkpoint)."""

    @abstractmethod
    def _encode(self, src: np.ndarray) -> np.ndarray: ...

    @abstractmethod
    def _decode(self, tgt: np.ndarray, memory: np.ndarray, src: np.ndarray) -> np.ndarray: ...

    @abstractmethod
    def _logits(self, src: np.ndarray, tgt: np.ndarray) -> np.ndarray: ...

    @abstractmethod
    def _stages(self, src: np.ndarray, tgt: np.ndarray, fine: bool = False) -> dict[str, np.ndarray]: ...

    @abstractmethod
    def _generate(self, src: np.ndarray, beam_size: int, alpha: float, max_len_margin: int,
                  length_rule: str = "wu", constraints: Constraints = NO_CONSTRAINTS) -> Generation: ...

    @abstractmethod
    def _step_logits(self, src: np.ndarray, tgt: np.ndarray) -> np.ndarray: ...


def check_search(cfg: ModelConfig, beam_size: int = 1, alpha: float = 0.6, max_len_margin: int = 50,
                 length_rule: str = "wu", *, banned: Iterable[int] = (), renormalize: bool = False,
                 max_new_tokens: int | None = None, forced_eos: bool = False,
                 forced_first: int | None = None) -> tuple[int, float, int, Constraints]:
    """`BackendModel.generate`'s search arguments checked (its docstring's rules), before any search:
    (beam_size, alpha, max_len_margin, constraints), or an InputError naming the argument."""
    beam_size = check_int(beam_size, "beam_size", minimum=1)
    vocab = cfg.tgt_vocab_size
    if beam_size > vocab:
        # Each step scores beam_size x vocab candidates: an unbounded beam is an unbounded wait.
        raise InputError(f"beam_size {beam_size} is larger than the target vocabulary ({vocab} tokens); "
                         f"give at most {vocab}")
    alpha = check_alpha(alpha)
    max_len_margin = check_int(max_len_margin, "max_len_margin", minimum=0)
    if length_rule not in LENGTH_RULES:
        raise InputError(f"length_rule {length_rule!r}: one of {', '.join(LENGTH_RULES)}")
    constraints = check_constraints(cfg, banned, renormalize, max_new_tokens, forced_eos, forced_first)
    return beam_size, alpha, max_len_margin, constraints


def get_backend(name: str) -> type[BackendModel]:
    """The `Model` class of backend `name`, with a clear error if its framework is missing."""
    if name not in MODEL_BACKENDS:
        raise RosettaError(f"unknown backend {name!r}; choose one of {', '.join(MODEL_BACKENDS)}")
    try:
        module = importlib.import_module(BACKENDS[name].model)
    except ImportError as e:
        raise RosettaError(f"backend {name!r} is not installed ({e.name} missing): {install_hint(name)}") \
            from None
    return module.Model


def check_trainable(name: str) -> None:
    """Refuse a name that cannot train, without importing any framework."""
    if name == "numpy":
        raise RosettaError("backend 'numpy' is the forward-only reference and cannot train; "
                           "train with torch or jax (and translate with numpy)")
    if name not in TRAINING_BACKENDS:
        raise RosettaError(f"unknown training backend {name!r}; choose from {', '.join(TRAINING_BACKENDS)}")


def get_trainer(name: str) -> Any:
    """The `Trainer` class of backend `name` (imports its framework): a rosetta.training.Trainer,
    which names this module (its `backend_model`), so it is not imported here."""
    check_trainable(name)
    try:
        module = importlib.import_module(BACKENDS[name].trainer)
    except ImportError as e:
        raise RosettaError(f"backend {name!r} cannot train here ({e.name} is not installed): "
                           f"{install_hint(name)}") from None
    return module.Trainer


def installed(name: str) -> bool:
    """Whether model backend `name`'s framework imports here (it is imported to find out)."""
    try:
        get_backend(name)
    except RosettaError:
        return False
    return True


def available_backends() -> list[str]:
    """The model backends whose framework imports here, in `BACKENDS` order."""
    return [name for name in MODEL_BACKENDS if installed(name)]


# `translate`, `evaluate` and `generate` without --backend: a run's own decoder, else the first of
# these installed. torch decodes with a cache and compiles nothing before the first sentence; jax
# caches too but compiles each new shape first; numpy, the float64 reference, re-runs the decoder
# over the whole prefix at every step (no cache: seconds a sentence on a CPU), one flag away.
DECODING_ORDER = ("torch", "jax", "numpy")


def default_decoder(trained_by: str | None = None) -> tuple[str, str]:
    """(the backend to decode with when none is named, why): the decoder of the backend that
    trained the model (a run's `trained_by`, BACKENDS' `decoder`) if installed, else the first
    installed backend of DECODING_ORDER. Only the frameworks it tries are imported: a process that
    decodes with PyTorch does not pay for importing JAX (most of a second of CPU: docs/evaluate.md)."""
    if trained_by in BACKENDS and installed(BACKENDS[trained_by].decoder):
        return BACKENDS[trained_by].decoder, f"the run's own, trained by {trained_by}"
    name = next(name for name in DECODING_ORDER if installed(name))
    return name, ("the fastest installed, with a cache" if name != "numpy"
                  else "no framework installed: the float64 reference, without a cache")


def load(path: str | os.PathLike, backend: str = "numpy", dtype: str | None = None) -> BackendModel:
    """Load a checkpoint file into `backend`."""
    return get_backend(backend).load(path, dtype)


def from_params(
    cfg: ModelConfig, params: Mapping[str, np.ndarray], backend: str = "numpy",
    dtype: str | None = None,
) -> BackendModel:
    """Build `backend`'s model from canonical parameters (e.g. `rosetta.init_params(cfg)`)."""
    return get_backend(backend)(cfg, params, dtype)
