"""The model configuration: one frozen dataclass, the paper's base model as defaults.

Every backend reads the same `ModelConfig`; it travels inside each checkpoint as JSON
(docs/checkpoint.md). Validation errors name the offending field.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rosetta import json_input
from rosetta.errors import ConfigError, RosettaError
from rosetta.json_input import JSONRefused

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")
POSITIONAL_ENCODINGS = ("sinusoidal_interleaved", "sinusoidal_concat", "sinusoidal_concat_t2t")
SHARE_EMBEDDINGS = ("none", "decoder", "src_tgt", "all")
REQUIRED_FIELDS = ("src_vocab_size", "tgt_vocab_size")

# Upper bounds on the size fields. A config travels inside checkpoint files, which may come from
# anywhere: without bounds a file of a few kilobytes could ask for a billion layers or a
# 10^8-row positional table and take every byte of memory before anything else is checked.
# Each bound admits every real encoder-decoder model with a wide margin:
LIMITS: dict[str, int] = {
    # 2^21 = 2,097,152 tokens: multilingual vocabularies reach 250k (mT5, NLLB); ~1M fits.
    "src_vocab_size": 2**21,
    "tgt_vocab_size": 2**21,
    # 16,384: the paper's big model and Marian's big models use 1,024; mT5-XXL and UL2 4,096.
    "d_model": 2**14,
    # 1,024 heads: T5-11B has 128, the paper's big model 16.
    "num_heads": 2**10,
    # 131,072: the widest known feed-forward block is T5-11B's 65,536.
    "d_ff": 2**17,
    # 1,024 layers per stack: the deepest trained encoder-decoder, DeepNet (Wang et al. 2022),
    # has 500 + 500; the paper and Marian use 6.
    "num_encoder_layers": 2**10,
    "num_decoder_layers": 2**10,
    # 2^20 = 1,048,576 positions: long-document models run 16k-64k; the paper's default is 1,024.
    "max_len": 2**20,
}
# layer_norm_eps: positive and small. Real values run from 1e-12 (BERT) to 1e-5 (the paper's
# frameworks); an eps below float32's smallest normal number would flush to zero in float32
# compute (a zero variance would then divide by zero), one above 0.1 is no longer a small guard.
LAYER_NORM_EPS_RANGE = (1.1754943508222875e-38, 0.1)
# logit_scale: positive and finite, and a normal float32 (float32 backends multiply by it in float32).
LOGIT_SCALE_RANGE = (1.1754943508222875e-38, 3.4028234663852886e38)


@dataclass(frozen=True)
class ModelConfig:
    """The fields of the model contract. Defaults are the base model of Vaswani et al. (2017),
    Table 3. `activation_dropout` and `final_norm` default to None, meaning "same as
    `dropout`" and "same as `norm_first`"; read them through the resolved properties."""

    src_vocab_size: int
    tgt_vocab_size: int
    d_model: int = 512
    num_heads: int = 8
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    d_ff: int = 2048
    dropout: float = 0.1
    activation_dropout: float | None = None
    attention_dropout: float = 0.0
    activation: str = "relu"
    norm_first: bool = False
    final_norm: bool | None = None
    layer_norm_eps: float = 1e-5
    attention_bias: bool = True
    ffn_bias: bool = True
    scale_embeddings: bool = True
    positional_encoding: str = "sinusoidal_interleaved"
    position_offset: int = 0
    share_embeddings: str = "all"
    output_bias: bool = False
    logit_scale: float = 1.0
    max_len: int = 1024
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2

    def __post_init__(self) -> None:
        _validate(self)

    # -- resolved defaults -------------------------------------------------------------
    @property
    def activation_dropout_rate(self) -> float:
        return self.dropout if self.activation_dropout is None else self.activation_dropout

    @property
    def has_final_norm(self) -> bool:
        return self.norm_first if self.final_norm is None else self.final_norm

    @property
    def d_head(self) -> int:
        return self.d_model // self.num_heads

    # -- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The fields as plain data. `logit_scale` is left out at 1.0 and `position_offset` at 0
        (SPEC §2): a config written before the fields existed, and its checkpoint's bytes, stay
        exactly what they were (and read back with those defaults)."""
        data = dataclasses.asdict(self)
        if data["logit_scale"] == 1.0:
            del data["logit_scale"]
        if data["position_offset"] == 0:
            del data["position_offset"]
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        return strict_from_dict(cls, data, "config", REQUIRED_FIELDS)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        return cls.from_dict(parse_json(text, "config"))

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def strict_json_loads(text: str) -> Any:
    """json.loads within the bounds of rosetta/json_input.py (depth, integer digits, finite numbers,
    no duplicate keys, no NaN or Infinity). Raises ValueError (JSONRefused or JSONDecodeError)."""
    return json_input.loads(text)


def parse_json(text: str, what: str) -> Any:
    try:
        return strict_json_loads(text)
    except JSONRefused as e:
        raise ConfigError(f"{what} JSON refused: {e}") from None
    except ValueError as e:  # JSONDecodeError
        raise ConfigError(f"{what} is not valid JSON: {e}") from None


def read_json_object(path: Path, what: str, error: type[RosettaError] = ConfigError, *,
                     limit: int = json_input.DEFAULT_LIMIT) -> dict[str, Any]:
    """The JSON object in the file `path` (`what` it is, for the message), at most `limit` bytes, or
    `error` naming the file (rosetta/json_input.py: read_json, with a schema where one is needed)."""
    return json_input.read_json(path, what, limit=limit, error=error)


def strict_from_dict(cls: type, data: Any, what: str, required: tuple[str, ...] = ()) -> Any:
    """`cls(**data)` for a config dataclass, refusing non-objects, unknown and missing fields."""
    if not isinstance(data, dict):
        raise ConfigError(f"{what} must be a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise ConfigError(f"unknown {what} field(s): {', '.join(unknown)}")
    missing = [name for name in required if name not in data]
    if missing:
        raise ConfigError(f"missing required {what} field(s): {', '.join(missing)}")
    return cls(**data)


# Named presets. `base` and `big` are Table 3 of the paper with its 37,000-token shared
# BPE vocabulary (§5.1); `tiny` is for tests and the CPU demo.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        src_vocab_size=64, tgt_vocab_size=64, d_model=32, num_heads=4, num_encoder_layers=2,
        num_decoder_layers=2, d_ff=64, max_len=128,
    ),
    "small": dict(
        src_vocab_size=8000, tgt_vocab_size=8000, d_model=256, num_heads=4,
        num_encoder_layers=3, num_decoder_layers=3, d_ff=1024, max_len=256,
    ),
    "base": dict(src_vocab_size=37000, tgt_vocab_size=37000),
    "big": dict(
        src_vocab_size=37000, tgt_vocab_size=37000, d_model=1024, num_heads=16, d_ff=4096,
        dropout=0.3,
    ),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """The named preset, with any field overridden (e.g. `preset("base", dropout=0.0)`)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return ModelConfig.from_dict({**PRESETS[name], **overrides})


def _check_int(cfg: ModelConfig, name: str, minimum: int) -> None:
    value = getattr(cfg, name)
    # bool is a subclass of int: `num_heads=True` is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    if name in LIMITS and value > LIMITS[name]:
        raise ConfigError(
            f"{name} must be <= {LIMITS[name]:,} (a bound that keeps untrusted files from "
            f"exhausting memory; real models stay far below it), got {value:,}"
        )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_rate(cfg: ModelConfig, name: str) -> None:
    value = getattr(cfg, name)
    if value is None and name == "activation_dropout":
        return
    # NaN fails the range test too; infinity is outside it.
    if not _is_number(value) or not 0.0 <= value < 1.0:
        raise ConfigError(f"{name} must be a number in [0, 1), got {value!r}")


def _check_eps(cfg: ModelConfig) -> None:
    eps, (low, high) = cfg.layer_norm_eps, LAYER_NORM_EPS_RANGE
    if not _is_number(eps) or not low <= eps <= high:  # NaN and infinity fail the range test
        raise ConfigError(
            f"layer_norm_eps must be a positive number in [{low:.3g}, {high:g}] (a finite, "
            f"small guard that float32 can hold), got {eps!r}"
        )


def _check_logit_scale(cfg: ModelConfig) -> None:
    value, (low, high) = cfg.logit_scale, LOGIT_SCALE_RANGE
    if not _is_number(value) or not low <= value <= high:  # NaN, infinity, 10**400 fail the test
        raise ConfigError(f"logit_scale must be a positive finite number in [{low:.3g}, {high:.3g}] "
                          f"(one float32 holds), got {value!r:.40}")


def _check_choice(cfg: ModelConfig, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(cfg, name)
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _check_bool(cfg: ModelConfig, name: str, optional: bool = False) -> None:
    value = getattr(cfg, name)
    if not (isinstance(value, bool) or (optional and value is None)):
        raise ConfigError(f"{name} must be true or false, got {value!r}")


def _validate(cfg: ModelConfig) -> None:
    for name in ("src_vocab_size", "tgt_vocab_size", "d_model", "num_heads",
                 "num_encoder_layers", "num_decoder_layers", "d_ff", "max_len"):
        _check_int(cfg, name, 1)
    for name in ("pad_id", "bos_id", "eos_id", "position_offset"):
        _check_int(cfg, name, 0)
    # The tables cover positions position_offset .. position_offset + max_len - 1 (SPEC §2): the
    # same bound as max_len's keeps a hostile offset from asking for rows past it.
    if cfg.max_len + cfg.position_offset > LIMITS["max_len"]:
        raise ConfigError(
            f"max_len + position_offset must be <= {LIMITS['max_len']:,} (the positional table's "
            f"bound), got {cfg.max_len:,} + {cfg.position_offset:,}"
        )
    for name in ("dropout", "activation_dropout", "attention_dropout"):
        _check_rate(cfg, name)
    for name in ("norm_first", "attention_bias", "ffn_bias", "scale_embeddings", "output_bias"):
        _check_bool(cfg, name)
    _check_bool(cfg, "final_norm", optional=True)
    _check_choice(cfg, "activation", ACTIVATIONS)
    _check_choice(cfg, "positional_encoding", POSITIONAL_ENCODINGS)
    _check_choice(cfg, "share_embeddings", SHARE_EMBEDDINGS)
    _check_eps(cfg)
    _check_logit_scale(cfg)
    # Sinusoidal tables pair one sine with one cosine per frequency (paper §3.5).
    if cfg.d_model % 2:
        raise ConfigError(f"d_model must be even, got {cfg.d_model}")
    if cfg.d_model % cfg.num_heads:
        raise ConfigError(
            f"d_model ({cfg.d_model}) must be divisible by num_heads ({cfg.num_heads})"
        )
    if cfg.pad_id >= min(cfg.src_vocab_size, cfg.tgt_vocab_size):
        raise ConfigError(
            f"pad_id {cfg.pad_id} is outside the vocabularies (src {cfg.src_vocab_size}, "
            f"tgt {cfg.tgt_vocab_size})"
        )
    for name in ("bos_id", "eos_id"):
        if getattr(cfg, name) >= cfg.tgt_vocab_size:
            raise ConfigError(
                f"{name} {getattr(cfg, name)} is outside the target vocabulary "
                f"(tgt_vocab_size {cfg.tgt_vocab_size})"
            )
    if cfg.share_embeddings in ("src_tgt", "all") and cfg.src_vocab_size != cfg.tgt_vocab_size:
        raise ConfigError(
            f"share_embeddings={cfg.share_embeddings!r} needs equal vocab sizes; got "
            f"src_vocab_size {cfg.src_vocab_size} and tgt_vocab_size {cfg.tgt_vocab_size}"
        )
