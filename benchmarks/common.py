"""What every benchmark records: the machine, the commit, the versions; and one timer."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from rosetta.files import atomic_write_bytes

RESULTS = Path(__file__).parent / "results"


def environment() -> dict:
    """Machine, commit and library versions, stored in every results file."""
    info = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.node(), "platform": platform.platform(),
        "processor": _cpu_model() or platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    if os.environ.get("ROSETTA_COMMIT"):  # a machine whose checkout has no (or a stale) .git
        info["commit"] = os.environ["ROSETTA_COMMIT"] + " (from ROSETTA_COMMIT)"
        return _versions(info)
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True, cwd=Path(__file__).parent, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
        info["commit"] += "+dirty" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        info["commit"] = "unknown"
    return _versions(info)


def _cpu_model() -> str | None:
    """The CPU's model name on Linux (/proc/cpuinfo), e.g. "AMD EPYC 7B13"; None elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _versions(info: dict) -> dict:
    """Add the library versions (and the devices they see) to `info`."""
    import numpy
    info["numpy"] = numpy.__version__
    try:
        import torch
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    try:
        import flax
        import jax
        info["jax"], info["flax"] = jax.__version__, flax.__version__
        info["jax_devices"] = [str(d) for d in jax.devices()]
    except ImportError:
        pass
    return info


def time_it(fn: Callable[[], object], repeats: int = 3, warmup: int = 1) -> dict:
    """Median and spread of wall-clock seconds over `repeats` calls, after `warmup` calls
    (compilation stays out of the numbers). `fn` must block until its result is ready."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "repeats": repeats}


def write_results(name: str, payload: dict, markdown: str, out_dir: Path | None = None) -> tuple[Path, Path]:
    """<out_dir or benchmarks/results>/<name>.json and .md, written atomically."""
    out_dir = out_dir or RESULTS
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    atomic_write_bytes(json_path, (json.dumps(payload, indent=2) + "\n").encode())
    atomic_write_bytes(md_path, markdown.encode())
    return json_path, md_path


def replace_block(page: Path, begin: str, end: str, block: str) -> None:
    """Rewrite the part of `page` from marker `begin` to marker `end` (both kept in `block`)."""
    text = page.read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"{page} has no {begin} ... {end} block")
    start, stop = text.index(begin), text.index(end) + len(end)
    atomic_write_bytes(page, (text[:start] + block + text[stop:]).encode())
