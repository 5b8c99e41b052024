"""`rosetta train`'s settings: `RunConfig` (every flag, one field each, with its default and
help), the fields a resumed run must share with the run it continues, and `check_run`, which
refuses bad settings naming the flag before any data is read or framework imported. A leaf of
the harness: rosetta/harness/loop.py trains a RunConfig, rosetta/harness/commands.py generates
the flags from its fields and builds one from them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rosetta.backends import check_trainable
from rosetta.config import PRESETS, preset
from rosetta.device import CACHE_OFF, cache_dir, parse_device
from rosetta.errors import RosettaError
from rosetta.files import check_writable
from rosetta.generation import check_alpha
from rosetta.harness.tasks import check_task, parse_pair
from rosetta.training import DEFAULT_LOSS, LOSSES, TrainConfig

# What the peer has no counterpart of: (RunConfig field, value that is fine, why).
PEER_REFUSES: tuple[tuple[str, Any, str], ...] = (
    ("nproc", 1, "it trains in one process"),
    ("shard", False, "it trains in one process (no FSDP2 sharding)"),
    ("batching", "bucketed", "nn.Transformer takes no segment ids for packed rows"),
    ("loss", "plain", "nn.Transformer returns logits, not the decoder's output"),
    ("trace", None, "its parameters are nn.Transformer's, not canonical, until the end of the run"),
    ("compile", False, "nn.MultiheadAttention's mask checks depend on the data: no whole graph to compile"),
)
DEFAULT_STEPS = 1000
# The settings a resumed run must share with the run it continues (what fixes its batches,
# weights and schedule); the rest (steps, evaluation, checkpoint and logging cadence) may change.
IDENTITY_FIELDS: tuple[str, ...] = (
    "preset", "overrides", "task", "pair", "vocab_size", "train_size", "synthetic_max_len", "max_tokens",
    "buckets", "dtype", "warmup", "lr_factor", "label_smoothing", "clip_norm", "seed", "batching",
)
BATCHINGS = ("bucketed", "packed")  # --batching: by length buckets (§5.1), or packed rows (docs/packing.md)
# --batching's default by the kind of device the run trains on, written once: packed rows on a GPU, where
# padding is compute spent on nothing (docs/packing.md); bucketed on a CPU, where packed batches measured
# no faster (benchmarks/results/batches_small_float32_cpu_2026-11-27.md).
DEFAULT_BATCHING = {"gpu": "packed", "cpu": "bucketed"}
# What a run saved before a setting existed trained with (rosetta/harness/out_dir.py reads a missing
# identity key so): before --batching, every run was bucketed.
SAVED_BEFORE: dict[str, Any] = {"batching": "bucketed"}


# The flag groups of `rosetta train --help`, in order: (key, title); a field names its key.
FLAG_GROUPS: tuple[tuple[str, str], ...] = (
    ("", ""), ("data", "data"), ("length", "length: --steps or --epochs, not both"),
    ("optimizer", "optimizer (paper §5.3, §5.4)"), ("evaluation", "evaluation, checkpoints, logging"),
    ("devices", "many devices (docs/distributed.md)"),
)


def setting(default: Any, help: str, group: str = "", *, flag: str | None = None, metavar: str | None = None,
            path: bool = False) -> Any:
    """A RunConfig field and its `rosetta train` flag (rosetta/harness/commands.py: add_run_flags):
    `--<name with dashes>` unless `flag` names it otherwise; the type and how the value is read
    come from the field's annotation, `path`: a file or directory name (never empty)."""
    metadata = {"help": help, "group": group, "flag": flag, "metavar": metavar, "path": path}
    if isinstance(default, dict):
        return field(default_factory=dict, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class RunConfig:
    """Every setting of `rosetta train`, each field its flag, help and default (said once:
    `rosetta train --help` is generated from them). `steps` or `epochs` sets the length
    (neither: DEFAULT_STEPS); `eval_every` 0 means no evaluation (the last step's included),
    `checkpoint_every` 0 a checkpoint at the end only;
    `bleu_samples` None evaluates BLEU on the whole evaluation split."""

    backends: tuple[str, ...] = setting(
        ("torch",), "torch, jax and/or peer (torch.nn.Transformer, the torch recipe: docs/training.md); "
        "several train one after the other in OUT/<backend>/", flag="backend", metavar="NAME")
    out: str = setting("runs/train", "output directory", path=True)
    preset: str = setting("tiny", f"model preset: {', '.join(sorted(PRESETS))}")
    overrides: dict[str, Any] = setting(
        {}, "override a model config field (repeatable), e.g. --set dropout=0", flag="set",
        metavar="FIELD=VALUE")
    task: str = setting("copy", "copy, reverse (synthetic, no files) or multi30k", "data")
    pair: str = setting("de-en", "Multi30k language pair, source-target", "data")
    data_dir: str | None = setting(
        None, "Multi30k directory (default $ROSETTA_DATA_DIR, else the package's bundled copy)", "data",
        path=True)
    vocab_size: int = setting(8000, "joint BPE vocabulary size (Multi30k)", "data")
    train_size: int | None = setting(None, "first N training pairs (synthetic: N generated)", "data")
    eval_size: int | None = setting(None, "first N evaluation pairs (synthetic default 500)", "data")
    eval_split: str = setting("val", "Multi30k split for validation loss and BLEU", "data")
    synthetic_max_len: int = setting(16, "longest synthetic sequence", "data")
    max_tokens: int = setting(
        4096, "tokens per update, counted on each side: a batch's source and its target are each rows x "
        "bucket length <= this, padding included (the paper's §5.1 batches: ~25000 source and 25000 target "
        "tokens); the global batch, split over every device and --accumulate micro-batch, not per device",
        "data")
    buckets: tuple[int, ...] | None = setting(
        None, "bucket lengths, e.g. 16,32,64 (default 8,16,...,max_len)", "data")
    steps: int | None = setting(None, f"optimizer steps in all (default {DEFAULT_STEPS})", "length")
    epochs: int | None = setting(None, "or: passes over the training data", "length")
    eval_every: int = setting(500, "steps between evaluations, and one at the end (0: none at all)",
                              "evaluation")
    checkpoint_every: int = setting(500, "steps between checkpoints (0: end)", "evaluation")
    keep: int = setting(3, "checkpoints kept (the newest)", "evaluation")
    log_every: int = setting(1, "steps between log.jsonl records", "evaluation")
    resume: bool = setting(False, "continue the run in OUT from its latest checkpoint")
    overwrite: bool = setting(False, "delete an earlier run in OUT and start afresh")
    dtype: str = setting("float32", "compute dtype: float32 or bfloat16; float64 to compare training loops "
                         "exactly (--trace, docs/training_diff.md); each backend's table: docs/backends.md",
                         "optimizer")
    device: str | None = setting(
        None, "cpu, cuda or gpu (the same), cuda:N or gpu:N, in every backend (default: the framework's)",
        "optimizer")
    warmup: int = setting(4000, "warmup steps of eq. 3", "optimizer")
    lr_factor: float = setting(1.0, "factor on eq. 3's learning rate", "optimizer")
    label_smoothing: float = setting(0.1, "label smoothing (§5.4)", "optimizer")
    clip_norm: float | None = setting(None, "global gradient-norm clipping (default none)", "optimizer")
    seed: int = setting(0, "seeds initial weights, batch order, dropout, data")
    beam: int = setting(1, "beam size for BLEU; 1 = greedy", "evaluation")
    alpha: float = setting(0.6, "length penalty exponent (Wu et al. 2016)", "evaluation")
    max_len_margin: int = setting(
        50, "max output length = source length + margin", "evaluation", flag="margin")
    bleu_samples: int | None = setting(
        None, "BLEU on the first N evaluation pairs (default all)", "evaluation")
    peak_tflops: float | None = setting(
        None, "device peak TFLOP/s for MFU (default: known GPUs)", "evaluation")
    progress: bool | None = setting(None, "progress bar (default: when stderr is a terminal)", "evaluation")
    accumulate: int = setting(
        1, "sum the gradients of K micro-batches per update: the update of one K-times larger batch "
        "(--max-tokens is the whole update's budget)", "devices", metavar="K")
    shard: bool = setting(
        False, "shard parameters and Adam state over the workers (PyTorch: FSDP2 fully_shard; JAX: "
        "NamedSharding over the data axis)", "devices")
    devices: int | None = setting(
        None, "JAX: local devices in the data-parallel mesh (default: all of the platform)", "devices")
    nproc: int = setting(
        1, "launch N processes here with torchrun, one device each (PyTorch: DDP; JAX: jax.distributed); "
        "under torchrun leave it out", "devices")
    dist_timeout: float = setting(
        600.0, "a collective waiting this long for a peer ends the run with an error", "devices",
        metavar="SECONDS")
    baseline: str | None = setting(
        None, "a finished one-device run of the same settings: scaling efficiency against it", "devices",
        metavar="OUT", path=True)
    time_budget: float | None = setting(
        None, "stop cleanly once the training loop has run this long (across resumes): evaluation and "
        "checkpoint after the last step; --resume continues", "evaluation", metavar="MINUTES")
    target_bleu: float | None = setting(
        None, "stop at the first evaluation whose validation BLEU reaches this", "evaluation", metavar="BLEU")
    average_last: int | None = setting(
        None, "at the end, average the last N checkpoints (paper §6.1; --keep >= N) into "
        "averaged.safetensors and evaluate it", "evaluation", metavar="N")
    batching: str | None = setting(
        None, "bucketed (pairs of similar length per batch, §5.1) or packed (several pairs per row, rows "
        "as long as the longest pair rounded up to 16: docs/packing.md); default packed on a GPU, bucketed "
        "on a CPU", "data")
    loss: str = setting(
        DEFAULT_LOSS, "plain (logits, then the loss) or chunked (the output projection and the loss chunk by "
        "chunk: no [tokens, vocabulary] logits, docs/loss.md)", "optimizer")
    compile: bool = setting(
        False, "PyTorch: compile the forward pass, loss and backward with torch.compile, one graph per batch "
        "shape (JAX always compiles)", "optimizer")
    compile_cache: str | None = setting(
        None, "where JAX keeps compiled programs for the next run (default $ROSETTA_CACHE, else "
        "~/.cache/rosetta; off: none)", "optimizer", metavar="DIR|off", path=True)
    trace: int | None = setting(
        None, "write a training trace to OUT/<backend>/trace: every step's batch hash, loss, lr and "
        "per-tensor norms, and the first N steps whole (gradients, updated weights) for `rosetta diff` "
        "(docs/training_diff.md)", "evaluation", metavar="N")

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    def identity(self) -> dict[str, Any]:
        return {name: self.to_dict()[name] for name in IDENTITY_FIELDS}

    def compile_cache_dir(self) -> Path | None:
        """The persistent compilation cache's directory: --compile-cache, else rosetta/device.py's
        cache_dir(); None for `off`."""
        if self.compile_cache == CACHE_OFF:
            return None
        return Path(self.compile_cache) if self.compile_cache is not None else cache_dir()

    def train_config(self) -> TrainConfig:
        return TrainConfig(label_smoothing=self.label_smoothing, warmup_steps=self.warmup,
                           lr_factor=self.lr_factor, clip_norm=self.clip_norm, seed=self.seed)


def device_kind(device: str) -> str:
    """'gpu' for a device a trainer resolved to ('cuda:0', 'gpu:1'), else 'cpu' (also JAX's
    'default' under a launcher, whose devices are not known before the processes join)."""
    return "gpu" if device.startswith(("cuda", "gpu")) else "cpu"


def resolve_batching(batching: str | None, backends: tuple[str, ...], devices: list[str]) -> str:
    """--batching as given, else DEFAULT_BATCHING for the `devices` the backends train on (as their
    trainers resolve them): packed if one trains on a GPU (every backend of a run gets the same
    batches), bucketed with --backend peer (nn.Transformer takes no segment ids)."""
    if batching is not None:
        return batching
    if "peer" in backends:
        return "bucketed"
    return DEFAULT_BATCHING["gpu" if "gpu" in map(device_kind, devices) else "cpu"]


def batching_line(iterator: Any) -> str:
    """The run's first word on its batches (rosetta/harness/loop.py logs it): packed or not, the
    share of real target tokens in epoch 0's batches, and the flag that changes it."""
    share = f"{iterator.real_token_share():.0%} real target tokens in epoch 0"
    if iterator.pack_length is not None:
        return (f"packing: rows of {iterator.pack_length} tokens, {share}; --batching bucketed to turn off "
                "(docs/packing.md)")
    return f"bucketed: {len(iterator.shapes)} batch shapes, {share}; --batching packed to pack rows"


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
        check_trainable(name)
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
    if run.batching is not None and run.batching not in BATCHINGS:
        raise RosettaError(f"--batching must be one of {', '.join(BATCHINGS)}, got {run.batching!r}")
    if run.compile and (run.nproc > 1 or run.shard):
        raise RosettaError("--compile trains in one process for now (DDP's and FSDP2's hooks under "
                           "torch.compile are not tested here): leave out --nproc/--shard or --compile")
    if run.resume and run.overwrite:
        raise RosettaError("--resume continues a run and --overwrite discards it: give one of them")
    if run.peak_tflops is not None and not run.peak_tflops > 0:
        raise RosettaError(f"--peak-tflops must be positive, got {run.peak_tflops!r}")
    for name in ("accumulate", "nproc"):
        _positive(name, getattr(run, name))
    if run.device is not None:
        parse_device(run.device)  # the spelling here; the devices present in preflight.py, per backend
    _positive("devices", run.devices, optional=True)
    _positive("trace", run.trace, minimum=0, optional=True)
    if run.trace is not None and run.shard:
        raise RosettaError("--trace with --shard: trace a run without sharding (the updates are the same)")
    if run.trace is not None and run.resume:
        raise RosettaError("--trace starts a trace at step 1: trace a fresh run, not a --resume")
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
    if run.target_bleu is not None and not run.eval_every:
        raise RosettaError("--target-bleu stops at an evaluation: --eval-every 0 evaluates nothing")
    if run.baseline is not None and not (Path(run.baseline) / "summary.json").is_file():
        raise RosettaError(f"--baseline {run.baseline}: no summary.json there (give the out directory of a "
                           "finished run on one device)")
    if "peer" in run.backends:
        for flag, fine, why in PEER_REFUSES:
            value = getattr(run, flag)
            if value is not None and value != fine:  # None: the default, which the peer's run resolves
                given = f"--{flag.replace('_', '-')}" + ("" if isinstance(value, bool) else f" {value}")
                raise RosettaError(f"{given}: --backend peer does not support it ({why})")
    run.train_config()  # TrainConfig checks its own fields (ConfigError names the field)
    preset(run.preset, **run.overrides)  # the preset and --set (a text task sets the vocabulary later)
    check_compile_cache(run)


def check_compile_cache(run: RunConfig) -> None:
    """The JAX compilation cache's folder (jax_impl/compilation.py: configure makes `DIR/jax`) must
    resolve and be creatable, before any data is prepared: a symlink loop, a file in its place, /proc."""
    folder = run.compile_cache_dir()
    if folder is None or "jax" not in run.backends:
        return  # off, or no backend that uses it
    given = f"--compile-cache {run.compile_cache}" if run.compile_cache else f"the compile cache {folder}"
    try:
        wanted = (folder.expanduser() / "jax").resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError: Python 3.11's "Symlink loop from ..."
        raise RosettaError(f"{given}: cannot resolve it ({e}); give another folder or off") from None
    try:
        check_writable(wanted / "probe")
    except RosettaError as e:
        raise RosettaError(f"{given}: {e}; give another folder or off") from None
