"""Files a later run trusts: written whole or not at all, and one writer per run directory.

Written by hand: the standard library has the pieces (os.replace, fcntl.flock) but no helper that does both
the fsync of the data and of the directory entry.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import tempfile
import time
from pathlib import Path


@contextlib.contextmanager
def atomic_writer(path: str | Path):
    """A binary file object whose contents replace `path` only when the block ends without an error, so a reader
    (or a crash) sees the old file or the new one, never a torn one: a temporary file in the same directory,
    fsynced, renamed over `path`, then the directory fsynced."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; the file gets the mode a plain open() would give it
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_writer(path) as f:
        f.write(data)


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, read in 1 MiB pieces."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj, indent: int | None = 2) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent) + "\n")


class RunLock:
    """An exclusive lock on a run directory while a training runs in it (<run_dir>/.train.lock).

    flock belongs to the open file: the kernel drops it when the process dies, kill -9 included, so a crashed
    run never leaves a stale lock, and the file's contents (who holds it) are only a message for the refusal.
    """

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / ".train.lock"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a+")
        try:
            fcntl.flock(self._f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._f.seek(0)
            holder = self._f.read().strip() or "another process"
            self._f.close()
            raise RuntimeError(
                f"{self.path.parent} is being trained by {holder}: two trainings in one run_dir would overwrite "
                "each other's checkpoints and metrics. Wait for it, stop it, or give this one another run_dir"
            ) from None
        self._f.seek(0)
        self._f.truncate()
        self._f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        self._f.flush()

    def release(self) -> None:
        if not self._f.closed:
            fcntl.flock(self._f.fileno(), fcntl.LOCK_UN)
            self._f.close()
