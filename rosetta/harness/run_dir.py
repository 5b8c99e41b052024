"""Training checkpoints as directories, written so that a crash (even SIGKILL) never leaves a
half-written one under its final name:

    checkpoints/
      step-00000500/      model.safetensors, trainer_state.safetensors, state.json, [tokenizer.json]
      step-00001000/
      latest              text file naming the newest complete directory ("step-00001000")

A checkpoint is written into a temporary directory `.tmp-step-…` beside the others, every file
fsynced, the directory fsynced, then renamed into place with `os.replace` (atomic on POSIX)
and the parent fsynced; only then is `latest` replaced (atomically, itself a temporary file
and a rename) and checkpoints beyond the newest `keep` deleted. Temporary directories left by
a killed writer are removed by `clean_temporaries`.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from rosetta.checkpoint import atomic_write_bytes
from rosetta.errors import CheckpointError

LATEST = "latest"
TEMP_PREFIX = ".tmp-"
_NAME = re.compile(r"^step-(\d{8,})$")


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """The complete checkpoint directories under `root`, oldest first, as (step, path)."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
    return sorted(found)


def clean_temporaries(root: Path) -> None:
    """Delete temporary directories a killed writer left behind (never a complete checkpoint)."""
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(TEMP_PREFIX) and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)


def latest_checkpoint(root: Path) -> Path | None:
    """The directory `latest` names; if the pointer is missing or stale (a crash between the
    rename and the pointer update), the newest complete directory; None if there is none."""
    pointer = root / LATEST
    if pointer.is_file():
        name = pointer.read_text(encoding="utf-8").strip()
        if _NAME.match(name) and (root / name).is_dir():
            newer = [p for step, p in list_checkpoints(root) if p.name > name]
            return newer[-1] if newer else root / name
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def save_checkpoint_dir(root: Path, step: int, write: Callable[[Path], None],
                        keep: int | None = None) -> Path:
    """Create checkpoint `step` under `root`: `write(tmp_dir)` writes the files (each fsynced,
    e.g. with atomic_write_bytes), then the directory is renamed into place, `latest` updated,
    and all but the newest `keep` checkpoints removed (None keeps all)."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    tmp = root / f"{TEMP_PREFIX}{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        write(tmp)
        _fsync_dir(tmp)
        if final.exists():  # a crash after this step's rename, before `latest` moved: replace it
            stale = root / f"{TEMP_PREFIX}stale-{final.name}-{os.getpid()}"
            os.replace(final, stale)
            shutil.rmtree(stale)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(root)
    atomic_write_bytes(root / LATEST, final.name.encode("utf-8"))
    if keep is not None:
        if keep < 1:
            raise CheckpointError(f"keep must be >= 1, got {keep}")
        for _, old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final
