"""A run's output directory before training touches it: what may be overwritten (only what the
harness wrote: docs/training.md), what --resume needs, and file-system errors as one line naming
the path. rosetta/harness/loop.py calls `check_out_dirs` under the directory's lock.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from rosetta.errors import RosettaError
from rosetta.harness.report import RUN_SCHEMA, check_overwritable, read_json, written_by_rosetta
from rosetta.harness.run_config import SAVED_BEFORE
from rosetta.harness.run_dir import foreign_checkpoint_entries

if TYPE_CHECKING:
    from rosetta.harness.run_config import RunConfig


def run_dir_state(run_dir: Path) -> str:
    """'none', 'run' (a rosetta run: run.json) or 'foreign' (something else, non-empty)."""
    if (run_dir / "run.json").is_file():
        return "run"
    if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        return "foreign"
    return "none"


@contextlib.contextmanager
def os_errors(path: Path, action: str | None = None) -> Iterator[None]:
    """An OSError in the block (a read-only directory, a full disk, a file where a directory
    should be) becomes one line: "cannot <action> <path>: <reason>" naming `path`, the thing
    being written; without an action, the error's own file if it names one."""
    try:
        yield
    except OSError as e:
        reason = e.strerror or str(e)
        if action:
            raise RosettaError(f"cannot {action} {path}: {reason}") from None
        raise RosettaError(f"{e.filename or path}: {reason}") from None


# What a run directory holds besides hidden temporaries (names with ".tmp": atomic writes,
# checkpoints being written); --overwrite deletes a run directory whole, so anything else in
# it is someone else's.
RUN_ENTRIES = {"run.json", "log.jsonl", "result.json", "plot.png", "tokenizer.json", "checkpoints", "trace"}


def foreign_entries(run_dir: Path) -> list[Path]:
    """What in `run_dir` the harness did not write: unknown names, result.json or plot.png
    without rosetta's tag, unknown entries of checkpoints/."""
    foreign = []
    for entry in sorted(run_dir.iterdir()):
        if entry.name.startswith(".") and ".tmp" in entry.name:
            continue
        if entry.name not in RUN_ENTRIES or (entry.name in ("result.json", "plot.png")
                                             and not written_by_rosetta(entry)):
            foreign.append(entry)
    return foreign + foreign_checkpoint_entries(run_dir / "checkpoints")


def check_out_dirs(run: RunConfig) -> list[Path]:
    """Refuse to clobber: a fresh run needs empty backend directories (or --overwrite, which
    deletes only what the harness wrote); --resume needs the run to be there, started with the
    same settings; the summary files in OUT, and a resumed run's result.json and plot.png, must
    be rosetta's to be rewritten. Returns the earlier runs that --overwrite will delete (once the
    new run's data has loaded)."""
    out, doomed = Path(run.out), []
    for name in ("summary.md", "summary.json", "plot.png"):
        check_overwritable(out / name)
    for backend in run.backends:
        run_dir = out / backend
        state = run_dir_state(run_dir)
        if state == "foreign":
            raise RosettaError(f"{run_dir} exists and is not a rosetta training run; choose another --out")
        if run.resume:
            if state != "run":
                found = sorted(p.parent.name for p in out.glob("*/run.json"))
                raise RosettaError(f"--resume: {run_dir} holds no run to resume (runs in {out}: "
                                   f"{', '.join(found) or 'none'})")
            saved = read_json(run_dir / "run.json", RUN_SCHEMA)
            if saved.get("backend") != backend:
                raise RosettaError(f"--resume: {run_dir} was trained with backend {saved.get('backend')!r}, "
                                   f"not {backend!r}")
            # A setting added after a run was started reads as what such runs did (SAVED_BEFORE), else
            # as its default.
            defaults = type(run)().identity() | SAVED_BEFORE
            identity = defaults | saved.get("identity", {})
            diffs = [f"{k}={identity.get(k)!r} (now {v!r})" for k, v in run.identity().items()
                     if identity.get(k) != v]
            if diffs:
                raise RosettaError(f"cannot resume {run_dir} with different settings: it was started with "
                                   f"{'; '.join(diffs)}; use the same settings, a new --out, or --overwrite")
            for name in ("result.json", "plot.png"):
                check_overwritable(run_dir / name)
        elif state == "run":
            if not run.overwrite:
                result = run_dir / "result.json"
                how = "a finished" if result.is_file() else "an unfinished"
                raise RosettaError(f"{run_dir} already holds {how} run; pass --resume to continue it or "
                                   f"--overwrite to replace it")
            foreign = foreign_entries(run_dir)
            if foreign:
                raise RosettaError(f"--overwrite deletes {run_dir} whole, but {foreign[0]} was not written "
                                   f"by rosetta train; move it away first")
            doomed.append(run_dir)
    return doomed
