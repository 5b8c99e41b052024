"""Facts about the machine a trainer runs on, framework-free: the CPU's name, the process's
peak memory (GPU trainers ask their framework instead) and where compiled programs persist."""

from __future__ import annotations

import os
import platform
import resource
import sys
from pathlib import Path


def max_rss_bytes() -> int:
    """The process's peak resident set size (ru_maxrss: kilobytes on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


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


def cache_dir() -> Path:
    """This user's cache of compiled programs (`rosetta train --compile-cache`'s default): $ROSETTA_CACHE,
    else $XDG_CACHE_HOME/rosetta, else ~/.cache/rosetta."""
    root = os.environ.get("ROSETTA_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "rosetta"
    return Path(root).expanduser()
