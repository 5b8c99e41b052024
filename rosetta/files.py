"""Atomic file writes, for every file rosetta writes (checkpoints, logs, reports, plots): the
bytes go to a temporary file beside the target, are fsynced, and only then renamed over it, so a
crash never leaves a half-written file; a path that cannot be a file is refused first, naming it.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from rosetta.errors import RosettaError

# A temporary file is `.{target name}.{host}.{pid}.{random}.tmp`, beside the target. Each save
# first removes the stale temporaries of its own target, those whose writer can no longer
# rename them into place:
# - written on this host (the temporary's name carries the host name): the writer's pid is no
#   longer running. A live pid keeps the file, our own included (another thread may be saving
#   the same target); a reused pid can only keep a stale file longer, never remove a live
#   writer's.
# - written on another host (a shared file system), or named the old way (`.{name}.XXXXXXXX.tmp`,
#   no pid): untouched for STALE_AFTER_S. A writer that is alive writes or renames long before.
STALE_AFTER_S = 24 * 3600
_HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:64] or "host"


def _temporary_pattern(name: str) -> re.Pattern[str]:
    """Matches this target's temporaries: group 1 the host and group 2 the pid of ours, both
    None for tempfile.mkstemp's old names."""
    ours = r"([A-Za-z0-9-]+)\.(\d{1,10})\.[0-9a-f]{8}"
    old = r"[a-z0-9_]{8}"
    return re.compile(rf"\.{re.escape(name)}\.(?:{ours}|{old})\.tmp")


def _pid_alive(pid: int) -> bool:
    if not 0 < pid < 2**31:  # 0 and -1 would address process groups, not one writer
        return False
    try:
        os.kill(pid, 0)  # signal 0: the existence check, nothing is sent
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _is_stale(entry: Path, host: str | None, pid: str | None) -> bool:
    if host == _HOST and pid is not None:
        return not _pid_alive(int(pid))
    return time.time() - entry.lstat().st_mtime > STALE_AFTER_S


def remove_stale_temporaries(path: Path) -> None:
    """Remove the temporaries that killed saves of `path` left behind (rule above)."""
    pattern = _temporary_pattern(path.name)
    try:
        entries = list(path.parent.iterdir())
    except OSError:
        return
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        try:
            if match and _is_stale(entry, match.group(1), match.group(2)):
                entry.unlink()
        except OSError:  # gone already, or not ours to remove: never fail a save over it
            continue


# Any target's temporary, for a folder's listing: the host and pid fields have no dots, so the
# target's name is what comes before them.
_ANY_OURS = re.compile(r"\.(.+)\.([A-Za-z0-9-]+)\.(\d{1,10})\.[0-9a-f]{8}\.tmp")
_ANY_OLD = re.compile(r"\.(.+)\.[a-z0-9_]{8}\.tmp")


def leftover_temporary(entry: Path) -> tuple[bool, str] | None:
    """For a file named as atomic_write's temporaries (of any target): whether it is stale (its
    writer can no longer rename it: the rule above), and who left it, in words ("left by process
    N, which no longer exists"); None for any other entry. Lets a command writing into a folder
    tell a write of ours killed part-way (kill -9 leaves the hidden temporary) from someone's files."""
    if not entry.is_file() or entry.is_symlink():
        return None
    hours = f"{STALE_AFTER_S // 3600} hours"
    match = _ANY_OURS.fullmatch(entry.name)
    if match and match.group(2) == _HOST:
        pid = match.group(3)
        stale = _is_stale(entry, _HOST, pid)
        return stale, (f"left by process {pid}, which no longer exists" if stale
                       else f"being written by process {pid}, which is still running")
    writer = f"process {match.group(3)} on host {match.group(2)}" if match else "an earlier rosetta version"
    if not (match or _ANY_OLD.fullmatch(entry.name)):
        return None
    stale = _is_stale(entry, None, None)
    return stale, (f"left by {writer}, untouched for over {hours}" if stale
                   else f"written by {writer} less than {hours} ago (it may still be writing)")


def _create_temporary(path: Path) -> tuple[int, Path]:
    """A new temporary file beside `path`, created as open() creates files: mode 0666 less
    the umask (tempfile.mkstemp would force 0600)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    while True:
        tmp = path.parent / f".{path.name}.{_HOST}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue


def check_writable(path: str | os.PathLike) -> Path:
    """`path` as a file that can be written, or a RosettaError naming it: an empty name, a
    directory in its place, a file where one of its parent directories should be (the
    IsADirectoryError, FileExistsError or NotADirectoryError a write would end in), or a nearest
    existing folder in which no file can be created (/proc, /sys, a read-only mount)."""
    if not str(path):
        raise RosettaError("cannot write a file with an empty name")
    path = Path(path)
    if path.is_dir():
        raise RosettaError(f"cannot write {path}: it is a directory")
    for parent in path.parents:  # the nearest one that exists must be a directory
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                what = "a file" if parent.exists() else "a broken symlink"
                raise RosettaError(f"cannot write {path}: {parent} is {what}, not a directory")
            _probe(parent, path)
            break
    return path


def _probe(folder: Path, path: Path) -> None:
    """Create and remove in `folder` the temporary a write of `path` would create: the one test that
    holds (os.access says yes to root on /proc and /sys); a probe left by a crash is a stale temporary."""
    try:
        fd, tmp = _create_temporary(folder / path.name)
    except OSError as e:
        raise RosettaError(f"cannot write {path}: a file cannot be created in {folder} "
                           f"({e.strerror or type(e).__name__})") from None
    os.close(fd)
    tmp.unlink(missing_ok=True)


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> None:
    """Call `write(f)` on a temporary file beside `path`, fsync, then rename over `path`. A
    new file gets the umask's mode, a replaced one keeps its mode. A path that cannot be a
    file is refused first (check_writable)."""
    path = check_writable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    try:
        keep_mode: int | None = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        keep_mode = None
    fd, tmp = _create_temporary(path)
    try:
        with os.fdopen(fd, "wb") as f:
            if keep_mode is not None:
                os.fchmod(f.fileno(), keep_mode)
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` atomically (see atomic_write)."""
    atomic_write(path, lambda f: f.write(data))
