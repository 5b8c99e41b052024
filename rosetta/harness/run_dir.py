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

A checkpoint is trusted only if it is what its name says (`check_checkpoint_dir`): its files
lie inside the run directory (no symlink leads out of it) and the step recorded in its
`state.json` and model metadata is the step in its name.

`out_dir_lock` keeps a second process out of an output directory for a whole run.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import safetensors

from rosetta import json_input
from rosetta.errors import CheckpointError, RosettaError
from rosetta.files import atomic_write_bytes

LATEST = "latest"
TEMP_PREFIX = ".tmp-"
LOCK = ".rosetta.lock"
_NAME = re.compile(r"^step-(\d{8,})$")
STATE_LIMIT = 16 * 2**20  # bytes of a state.json read at most (a run writes a few kB)


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def is_checkpoint_name(name: str) -> bool:
    return _NAME.match(name) is not None


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


def foreign_checkpoint_entries(root: Path) -> list[Path]:
    """Entries of a checkpoints directory that are none of: a checkpoint, `latest`, a temporary."""
    if not root.is_dir():
        return []
    return [p for p in sorted(root.iterdir())
            if not (_NAME.match(p.name) or p.name == LATEST or (p.name.startswith(".") and ".tmp" in p.name))]


def clean_temporaries(root: Path) -> None:
    """Delete temporary directories a killed writer left behind (never a complete checkpoint)."""
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(TEMP_PREFIX) and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)


def latest_checkpoint(root: Path, check: bool = True) -> Path | None:
    """The directory `latest` names; if the pointer is missing or stale (a crash between the
    rename and the pointer update), the newest complete directory; None if there is none. The
    one chosen must pass `check_checkpoint_dir` (a CheckpointError otherwise) unless `check` is
    False (the caller checks it). A directory newer than the one `latest` names wins, so the
    way back to an earlier checkpoint is to move the newer ones out of `root`."""
    pointer = root / LATEST
    chosen = None
    if pointer.is_file():
        with open(pointer, "rb") as f:  # a checkpoint's name: 128 bytes bound it; garbage names nothing
            name = f.read(128).decode("utf-8", errors="replace").strip()
        if _NAME.match(name) and (root / name).is_dir():
            newer = [p for step, p in list_checkpoints(root) if p.name > name]
            chosen = newer[-1] if newer else root / name
    if chosen is None:
        found = list_checkpoints(root)
        chosen = found[-1][1] if found else None
    if chosen is not None and check:
        check_checkpoint_dir(chosen)
    return chosen


def _recorded_steps(ckpt_dir: Path) -> dict[str, object]:
    """The step each record of a checkpoint directory holds: state.json's `step`, the model
    file's metadata `step` (a string there). A record that is missing or unreadable is left out:
    reading it later gives its own error."""
    found: dict[str, object] = {}
    try:
        found["state.json"] = json_input.read_json(ckpt_dir / "state.json", "a checkpoint's state",
                                                   limit=STATE_LIMIT, nonfinite=True).get("step")
    except RosettaError:
        pass
    try:
        with safetensors.safe_open(str(ckpt_dir / "model.safetensors"), framework="numpy") as f:
            if "step" in (f.metadata() or {}):
                found["model.safetensors"] = f.metadata()["step"]
    except (OSError, safetensors.SafetensorError):
        pass
    return found


def check_checkpoint_dir(ckpt_dir: Path) -> None:
    """Refuse a checkpoint directory `<run>/checkpoints/step-N` that is not what its name says:
    one of its entries (or itself) a symlink leading out of the run directory, or a recorded
    step other than N. Resuming or translating from it would load another run's or another
    step's weights under this one's name."""
    run_dir = ckpt_dir.parent.parent
    inside = run_dir.resolve()
    for entry in (ckpt_dir, *sorted(ckpt_dir.iterdir())):
        target = entry.resolve()
        if not target.is_relative_to(inside):
            raise CheckpointError(f"{entry} is a symlink to {target}, outside the run directory {run_dir}: "
                                  f"refusing it")
    match = _NAME.match(ckpt_dir.name)
    if match is None:
        return  # a directory named by hand: no step to compare with
    step = int(match.group(1))
    for record, recorded in _recorded_steps(ckpt_dir).items():
        if str(recorded) != str(step):
            raise CheckpointError(f"{ckpt_dir}: its {record} records step {recorded}, not the step {step} "
                                  f"of its name: refusing it")


def _missing_dirs(path: Path) -> list[Path]:
    """`path` and those of its parents that do not exist, deepest first: what mkdir(parents=True)
    would create."""
    missing = []
    while not (path.exists() or path.is_symlink()) and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _undo_lock(out: Path, created: list[Path]) -> None:
    """After a refused run that created the lock file (and `created`: `out` and its parents, if
    it created those too): if `out` holds nothing but the lock file, remove it and then those
    directories, while empty. Nothing is left of the refused invocation; whatever it or anyone
    else wrote stays."""
    try:
        if [p.name for p in out.iterdir()] != [LOCK]:
            return
        (out / LOCK).unlink()
        for path in created:
            path.rmdir()  # OSError once one is not empty (another process wrote there): stop
    except OSError:
        return


@contextlib.contextmanager
def out_dir_lock(out: Path) -> Iterator[None]:
    """Hold an exclusive lock on the output directory `out` (created if missing) until the block
    ends: flock on `out/.rosetta.lock`, never waiting. A second process, whether it would train,
    resume or --overwrite, is refused with the pid the holder wrote in the lock file. The lock
    goes with the process (a killed holder frees it); the file stays, emptied, because deleting
    a lock file another process has just opened would let two processes hold two locks. The one
    exception: a block that fails having written nothing (a run refused after the lock) removes
    the lock file if this call created it, and `out` if it created that (_undo_lock). It does so
    still holding the lock, so a rival can only be caught out by opening the file in the instant
    between the removal and the release."""
    created = _missing_dirs(out)
    lock_created = not (out / LOCK).exists()
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            raise RosettaError(f"{out} is in use by another rosetta process (pid {holder}); wait for it to "
                               f"finish or choose another --out") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        try:
            yield
        except BaseException:
            if lock_created:
                _undo_lock(out, created)
            raise
        finally:
            os.ftruncate(fd, 0)  # no stale pid for the next holder's rivals to read
    finally:
        os.close(fd)  # releases the lock


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
