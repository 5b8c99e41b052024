"""Facts about the machine a trainer runs on, framework-free: the CPU's name and the process's
peak memory (GPU trainers ask their framework instead)."""

from __future__ import annotations

import platform
import resource
import sys


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
