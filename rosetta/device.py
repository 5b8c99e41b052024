"""Facts about the machine a trainer runs on, framework-free: the one parser of device names
(`--device`: every backend's trainer and model, and the CLI, read a name through `check_device`, so
what one framework refuses all refuse, in the same line), the CPU's name, the process's peak memory
(GPU trainers ask their framework instead), where compiled programs persist, and how often the
process collects Python's cyclic garbage."""

from __future__ import annotations

import gc
import os
import platform
import re
import resource
import sys
from dataclasses import dataclass
from pathlib import Path

from rosetta.errors import RosettaError

# The names --device takes: torch's spelling of a GPU (cuda) and JAX's (gpu) are one kind, so either
# works in every backend; an index picks a device of that kind (six digits at most: no 10^4300 ints).
DEVICE_NAMES = "cpu, cuda or gpu (the same), cuda:N or gpu:N (GPU N, from 0)"
_DEVICE = re.compile(r"(cpu|cuda|gpu)(?::([0-9]{1,6}))?")


@dataclass(frozen=True)
class Device:
    """A device name, parsed: its kind ("cpu" or "gpu"), its index (None: the kind's first, or
    under a launcher this process's own GPU) and the name as given (for messages)."""

    kind: str
    index: int | None
    name: str

    @property
    def torch(self) -> str:
        """torch.device's spelling: 'cpu', 'cuda', 'cuda:1'."""
        base = "cuda" if self.kind == "gpu" else "cpu"
        return base if self.index is None else f"{base}:{self.index}"

    @property
    def platform(self) -> str:
        """JAX's platform name: 'cpu' or 'gpu'."""
        return self.kind


def parse_device(name: object) -> Device:
    """`name` ('cpu', 'cuda', 'gpu:1', ...) as a Device; anything else ('', 'meta', 'CPU', 'cuda:x')
    is refused in one line naming --device, before any framework sees it."""
    match = _DEVICE.fullmatch(name) if isinstance(name, str) else None
    if match is None:
        shown = name if isinstance(name, str) and re.fullmatch(r"[!-~]+", name) else repr(name)
        raise RosettaError(f"--device {shown}: not a device name; give {DEVICE_NAMES}")
    kind = "cpu" if match[1] == "cpu" else "gpu"
    return Device(kind, None if match[2] is None else int(match[2]), name)


def check_device(name: str | None, gpus: int, cpus: int = 1) -> Device | None:
    """`parse_device(name)` checked against the devices a framework sees here: `gpus` GPUs and
    `cpus` CPU devices (1 but for JAX's host devices); None: no name given (the framework's
    default). The same refusal, word for word, from every backend that sees the same devices."""
    if name is None:
        return None
    device = parse_device(name)
    present = gpus if device.kind == "gpu" else cpus
    if (device.index or 0) < present:
        return device
    if present == 0:
        raise RosettaError(f"--device {name}: no GPU here")
    prefix, what = name.partition(":")[0], "GPU" if device.kind == "gpu" else "CPU device"
    listed = f"{prefix}:0" + (f" to {prefix}:{present - 1}" if present > 1 else "")
    raise RosettaError(f"--device {name}: {present} {what}{'s' if present > 1 else ''} here ({listed})")


def max_rss_bytes() -> int:
    """The process's peak resident set size (ru_maxrss: kilobytes on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


# Python's cyclic garbage collector in every `rosetta` command, every benchmark (so they time the step
# `rosetta train` runs) and the suite: the youngest generation collected every 20,000 allocations, not
# 700, the older ones at 20 (not 10) of the younger's. With torch and JAX imported a process holds
# millions of objects, and the collections that walk them were a fifth of a short run's CPU (importing
# torch, JAX and flax: 2.2 s with the collector, 1.7 s without; `rosetta train --task copy --steps 4`
# 5.05 -> 4.35 s of CPU; docs/testing.md). Garbage in reference cycles is still collected, a little later.
GC_THRESHOLDS = (20_000, 20, 20)


def collect_less() -> None:
    """Python's collector at GC_THRESHOLDS for this process."""
    gc.set_threshold(*GC_THRESHOLDS)


def cpu_name() -> str:
    """A readable CPU name: "cpu: " and the model name of /proc/cpuinfo (or platform's)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return "cpu: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu: " + (platform.processor() or platform.machine() or "unknown")


# The persistent JAX cache's bound on disk (jax_impl/compilation.py): least recently used programs
# go first beyond it (JAX_COMPILATION_CACHE_MAX_SIZE, if set, instead). Every process sharing a cache
# must bound it alike: JAX writes each entry's access time beside it only where a bound is set, and a
# bounded writer fails on an entry that has none.
CACHE_MAX_BYTES = 4 * 2**30
# `--compile-cache off`, and a trainer's `compile_cache` for no persistent cache (None: JAX's own setting).
CACHE_OFF = "off"


def cache_dir() -> Path:
    """This user's cache of compiled programs (`rosetta train --compile-cache`'s default): $ROSETTA_CACHE,
    else $XDG_CACHE_HOME/rosetta, else ~/.cache/rosetta."""
    root = os.environ.get("ROSETTA_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "rosetta"
    return Path(root).expanduser()
