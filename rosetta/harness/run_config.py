"""`rosetta train`'s settings: `RunConfig` (every flag, one field each, with its default), the
fields a resumed run must share with the run it continues, and `check_run`, which refuses bad
settings naming the flag before any data is read or framework imported. A leaf of the harness:
rosetta/harness/loop.py trains a RunConfig, rosetta/cli.py builds one from the flags.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rosetta.config import preset
from rosetta.errors import RosettaError
from rosetta.generation import check_alpha
from rosetta.harness.tasks import check_task, parse_pair
from rosetta.training import LOSSES, TrainConfig

# "peer": torch.nn.Transformer trained with the torch backend's recipe (torch_impl/peer_train.py).
TRAINERS: dict[str, str] = {"torch": "torch_impl.train", "jax": "jax_impl.train",
                             "peer": "torch_impl.peer_train"}
# What the peer has no counterpart of: (RunConfig field, value that is fine, why).
PEER_REFUSES: tuple[tuple[str, Any, str], ...] = (
    ("nproc", 1, "it trains in one process"),
    ("shard", False, "it trains in one process (no FSDP2 sharding)"),
    ("batching", "bucketed", "nn.Transformer takes no segment ids for packed rows"),
    ("loss", "plain", "nn.Transformer returns logits, not the decoder's output"),
)
DEFAULT_STEPS = 1000
# The settings a resumed run must share with the run it continues (what fixes its batches,
# weights and schedule); the rest (steps, evaluation, checkpoint and logging cadence) may change.
IDENTITY_FIELDS: tuple[str, ...] = (
    "preset", "overrides", "task", "pair", "vocab_size", "train_size", "synthetic_max_len", "max_tokens",
    "buckets", "dtype", "warmup", "lr_factor", "label_smoothing", "clip_norm", "seed", "batching",
)
BATCHINGS = ("bucketed", "packed")  # --batching: by length buckets (§5.1), or packed rows (docs/packing.md)


@dataclass(frozen=True)
class RunConfig:
    """Every setting of `rosetta train` (the CLI flags, one to one). `steps` or `epochs` sets
    the length (neither: DEFAULT_STEPS); `eval_every` / `checkpoint_every` 0 means at the end
    only; `bleu_samples` None evaluates BLEU on the whole evaluation split."""

    backends: tuple[str, ...] = ("torch",)
    out: str = "runs/train"
    preset: str = "tiny"
    overrides: dict[str, Any] = field(default_factory=dict)
    task: str = "copy"
    pair: str = "de-en"
    data_dir: str | None = None
    vocab_size: int = 8000
    train_size: int | None = None
    eval_size: int | None = None
    eval_split: str = "val"
    synthetic_max_len: int = 16
    max_tokens: int = 4096
    buckets: tuple[int, ...] | None = None
    steps: int | None = None
    epochs: int | None = None
    eval_every: int = 500
    checkpoint_every: int = 500
    keep: int = 3
    log_every: int = 1
    resume: bool = False
    overwrite: bool = False
    dtype: str = "float32"
    device: str | None = None
    warmup: int = 4000
    lr_factor: float = 1.0
    label_smoothing: float = 0.1
    clip_norm: float | None = None
    seed: int = 0
    beam: int = 1
    alpha: float = 0.6
    max_len_margin: int = 50
    bleu_samples: int | None = None
    peak_tflops: float | None = None
    progress: bool | None = None
    accumulate: int = 1
    shard: bool = False
    devices: int | None = None
    nproc: int = 1
    dist_timeout: float = 600.0
    baseline: str | None = None
    time_budget: float | None = None
    target_bleu: float | None = None
    average_last: int | None = None
    batching: str = "bucketed"
    loss: str = "plain"

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    def identity(self) -> dict[str, Any]:
        return {name: self.to_dict()[name] for name in IDENTITY_FIELDS}

    def train_config(self) -> TrainConfig:
        return TrainConfig(label_smoothing=self.label_smoothing, warmup_steps=self.warmup,
                           lr_factor=self.lr_factor, clip_norm=self.clip_norm, seed=self.seed)


# -- Checks that run before any data is read or framework imported --------------------------------

def _positive(name: str, value: Any, minimum: int = 1, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise RosettaError(f"--{name.replace('_', '-')} must be an integer >= {minimum}, got {value!r}")


def check_run(run: RunConfig) -> None:
    """Refuse bad settings with a message that names the flag."""
    if not run.backends:
        raise RosettaError("give at least one --backend (torch, jax)")
    if len(set(run.backends)) != len(run.backends):
        raise RosettaError(f"--backend lists a backend twice: {' '.join(run.backends)}")
    for name in run.backends:
        if name == "numpy":
            raise RosettaError("backend 'numpy' is the forward-only reference and cannot train; "
                               "train with torch or jax (and translate with numpy)")
        if name not in TRAINERS:
            raise RosettaError(f"unknown training backend {name!r}; choose from {', '.join(TRAINERS)}")
    check_task(run.task)
    if run.task == "multi30k":
        parse_pair(run.pair)
    if run.steps is not None and run.epochs is not None:
        raise RosettaError("give --steps or --epochs, not both")
    for name in ("steps", "epochs", "train_size", "eval_size", "bleu_samples"):
        _positive(name, getattr(run, name), optional=True)
    for name in ("max_tokens", "keep", "log_every", "synthetic_max_len", "beam", "vocab_size"):
        _positive(name, getattr(run, name))
    check_alpha(run.alpha, "--alpha")  # the rule model.generate applies at evaluation
    for name in ("eval_every", "checkpoint_every", "max_len_margin"):
        _positive(name, getattr(run, name), minimum=0)
    if run.loss not in LOSSES:
        raise RosettaError(f"--loss must be one of {', '.join(LOSSES)}, got {run.loss!r}")
    if run.batching not in BATCHINGS:
        raise RosettaError(f"--batching must be one of {', '.join(BATCHINGS)}, got {run.batching!r}")
    if run.dtype not in ("float32", "bfloat16"):
        raise RosettaError(f"--dtype must be float32 or bfloat16, got {run.dtype!r}")
    if run.resume and run.overwrite:
        raise RosettaError("--resume continues a run and --overwrite discards it: give one of them")
    if run.peak_tflops is not None and not run.peak_tflops > 0:
        raise RosettaError(f"--peak-tflops must be positive, got {run.peak_tflops!r}")
    for name in ("accumulate", "nproc"):
        _positive(name, getattr(run, name))
    _positive("devices", run.devices, optional=True)
    _positive("average_last", run.average_last, minimum=2, optional=True)
    if run.average_last is not None and run.average_last > run.keep:
        raise RosettaError(f"--average-last {run.average_last} needs that many checkpoints kept: give --keep "
                           f">= {run.average_last} (now {run.keep})")
    if not run.dist_timeout > 0:
        raise RosettaError(f"--dist-timeout must be a positive number of seconds, got {run.dist_timeout!r}")
    if run.time_budget is not None and not (run.time_budget > 0 and math.isfinite(run.time_budget)):
        raise RosettaError(f"--time-budget must be a positive number of minutes, got {run.time_budget!r}")
    if run.target_bleu is not None and not 0 < run.target_bleu <= 100:
        raise RosettaError(f"--target-bleu must be a BLEU score in (0, 100], got {run.target_bleu!r}")
    if run.baseline is not None and not (Path(run.baseline) / "summary.json").is_file():
        raise RosettaError(f"--baseline {run.baseline}: no summary.json there (give the out directory of a "
                           "finished run on one device)")
    if "peer" in run.backends:
        for flag, fine, why in PEER_REFUSES:
            value = getattr(run, flag)
            if value != fine:
                given = f"--{flag.replace('_', '-')}" + ("" if isinstance(value, bool) else f" {value}")
                raise RosettaError(f"{given}: --backend peer does not support it ({why})")
    run.train_config()  # TrainConfig checks its own fields (ConfigError names the field)
    preset(run.preset, **run.overrides)  # the preset and --set (a text task sets the vocabulary later)
