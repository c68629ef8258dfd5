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
import shutil
import socket
import sys
import tempfile
import threading
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
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        if e.filename is None and e.errno is not None:  # a failed write() names no file: name the one being replaced
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
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
    """An exclusive lock on a directory while one process writes there (<dir>/.train.lock for a training; other
    writers name their own file), taken before anything in it is read or written.

    flock belongs to the open file: the kernel drops it when the process dies, kill -9 included, so a crashed
    run never leaves a stale lock, and the file's contents (who holds it) are only a message for the refusal.
    `others`: locks taken with this one (a run's checkpoint.dir), released with it.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        key: str = "run_dir",
        name: str = ".train.lock",
        doing: str = "trained",
        wait: bool = False,
    ):
        directory = Path(run_dir)
        if directory.exists() and not directory.is_dir():
            raise ValueError(f"{key}={directory} is a file, not a directory: name a directory (or a new path)")
        self.path = directory / name
        self.others: list[RunLock] = []
        self.tidy = False  # set by claim_dir: a directory this lock made and nothing else wrote to goes on release
        self._made = [p for p in (directory, *directory.parents) if not p.exists()]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a+")
        try:
            fcntl.flock(self._f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._f.seek(0)
            holder = self._f.read().strip() or "another process"
            if wait:  # a shared cache: the second user waits for the first to finish building it, then reads it
                print(f"{self.path.parent} ({key}) is being {doing} by {holder}: waiting for it", file=sys.stderr)
                fcntl.flock(self._f.fileno(), fcntl.LOCK_EX)
                self._claim()
                return
            self._f.close()
            raise RuntimeError(
                f"{self.path.parent} is being {doing} by {holder}: two writers to one {key} would overwrite each "
                f"other's files. Wait for it, stop it, or give this one another {key}"
            ) from None
        self._claim()

    def _claim(self) -> None:
        self._f.seek(0)
        self._f.truncate()
        self._f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        self._f.flush()

    @property
    def held(self) -> bool:
        return not self._f.closed

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        for other in self.others:
            other.release()
        if not self._f.closed:
            if self.tidy and self._made and [p.name for p in self.path.parent.iterdir()] == [self.path.name]:
                self.path.unlink()  # a refused command leaves no empty output directory behind
                for made in self._made:
                    with contextlib.suppress(OSError):
                        made.rmdir()
            fcntl.flock(self._f.fileno(), fcntl.LOCK_UN)
            self._f.close()


def _refuse_a_file_at_or_above(directory: Path, flag: str, out: Path) -> None:
    for above in (directory, *directory.parents):
        if above.exists() and not above.is_dir():
            raise ValueError(f"{flag} {out}: {above} is a file, not a directory")


def check_out_file(path, flag: str) -> Path:
    """An output file's path, checked before any work: not a directory, its parent a directory (made now). Local
    paths only; returns it as a Path."""
    out = Path(path)
    if out.is_dir():
        raise ValueError(f"{flag} {out} is a directory: name the file to write")
    _refuse_a_file_at_or_above(out.parent, flag, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def check_out_dir(path, flag: str) -> Path:
    """An output directory's path, checked before any work: not a file, nor under one (made now)."""
    out = Path(path)
    _refuse_a_file_at_or_above(out, flag, out)
    out.mkdir(parents=True, exist_ok=True)
    return out


def claim_dir(path, *, key: str, doing: str, name: str, timeout_s: float | None = None) -> RunLock:
    """Before any work, the output directory `path` (flag or key `key`) made safe to write: a file there refused by
    name, a second local writer refused with the holder's pid, a URI's store probed within seconds (its local
    staging directory is what gets locked). The caller releases the lock."""
    lock = RunLock(local_dir(path), key=key, name=name, doing=doing)
    lock.tidy = True
    try:
        if is_uri(path):
            probe_uri(path, timeout_s, key=key)
    except BaseException:
        lock.release()
        raise
    return lock


def open_run_dir(run_dir, timeout_s: float | None = None, checkpoint_dir=None) -> RunLock:
    """Take a run directory's lock before anything in it is written (a second training is refused with every file
    as it was) and, for a URI, check that its store answers (`probe_uri`). A checkpoint.dir outside the run
    directory gets the same: two runs with their own run_dirs and one checkpoint.dir would otherwise end up with
    one run's checkpoints and resume the other from them. The caller releases the lock."""
    lock = claim_dir(run_dir, key="run_dir", doing="trained", name=".train.lock", timeout_s=timeout_s)
    try:
        if checkpoint_dir is not None and str(checkpoint_dir) != run_path(run_dir, "checkpoints"):
            if is_uri(checkpoint_dir):  # Orbax writes there directly: nothing local to lock
                probe_uri(checkpoint_dir, timeout_s, key="checkpoint.dir")
            else:
                lock.others.append(RunLock(checkpoint_dir, key="checkpoint.dir"))
    except BaseException:
        lock.release()
        raise
    return lock


# -- Run directories on object storage (gs://, s3://, ...) --------------------------------------------------------
# A run directory may be a URI. Orbax reads and writes checkpoints there itself (tensorstore); every other file of
# the run (config.yml, metrics.jsonl, export/, eval/, profile/, tb/) is written to a local staging directory, whose
# files `push` mirrors to the URI through etils.epath (object stores have no append, no rename and no flock, which
# metrics.jsonl, the atomic writes and the run lock need), and from which `pull` restores them on a fresh host.

# features: a local memmap cache; the locks: held by this host's writer only
STAGING_SKIP = ("checkpoints", "features", ".train.lock", ".eval.lock", ".features.lock", ".pushed.json")


def is_uri(path) -> bool:
    return "://" in str(path)


def cache_root() -> Path:
    # Read at call time so tests and scripts can point DFLASH_CACHE elsewhere after import.
    return Path(os.environ.get("DFLASH_CACHE") or Path.home() / ".cache" / "dflash-jax")


def run_path(run_dir, name: str) -> str:
    """`name` inside run_dir, a local path or a URI (pathlib would turn gs://b into gs:/b)."""
    return f"{str(run_dir).rstrip('/')}/{name}"


def local_dir(run_dir) -> Path:
    """Where this host writes a run directory's files: run_dir itself, or for a URI its staging directory."""
    if not is_uri(run_dir):
        return Path(run_dir)
    scheme, rest = str(run_dir).split("://", 1)
    return cache_root() / "staging" / scheme / rest.strip("/")


PROBE_TIMEOUT_S = 20.0  # a store that has not answered a listing and a small write by then is not reachable


def probe_uri(uri, timeout_s: float | None = None, key: str = "run_dir") -> None:
    """Refuse a URI run_dir whose store cannot be reached or written (no network, no credentials, no bucket) at
    start, naming the URI and the reason: list it, write and remove a small object in it, all within `timeout_s`
    (default PROBE_TIMEOUT_S), instead of a client library's traceback after its own retries (gcsfs: ~1 min)."""
    timeout_s = PROBE_TIMEOUT_S if timeout_s is None else timeout_s
    outcome: list[BaseException | None] = []

    def probe():
        from etils import epath

        try:
            root = epath.Path(str(uri))
            root.exists()
            marker = root / f".probe-{socket.gethostname()}-{os.getpid()}"
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_bytes(b"")
            marker.unlink()
            outcome.append(None)
        except BaseException as e:  # reported below, in the caller's thread
            outcome.append(e)

    worker = threading.Thread(target=probe, name=f"probe {uri}", daemon=True)  # a hung client cannot hold exit
    worker.start()
    worker.join(timeout_s)
    if not outcome:
        raise ValueError(
            f"{key}={uri}: its store did not answer within {timeout_s:g} s (no network, or a client waiting for "
            "credentials); check the URI, the network and the credentials (gcloud auth application-default login)"
        )
    if outcome[0] is not None:
        e = outcome[0]
        reason = (str(e).strip().splitlines() or [""])[0][:300]
        raise ValueError(f"{key}={uri}: cannot be reached or written: {type(e).__name__}: {reason}")


def _staged_files(local: Path):
    for p in sorted(local.rglob("*")):
        rel = p.relative_to(local)
        if p.is_file() and rel.parts[0] not in STAGING_SKIP:
            yield rel.as_posix(), p


def push(run_dir) -> int:
    """Copy the staging directory's new or changed files to the URI run_dir (a no-op for a local run_dir).
    Returns how many files were copied."""
    if not is_uri(run_dir):
        return 0
    from etils import epath

    local, remote = local_dir(run_dir), epath.Path(str(run_dir))
    manifest = local / ".pushed.json"
    done = json.loads(manifest.read_text()) if manifest.exists() else {}
    copied = 0
    for rel, p in _staged_files(local):
        st = p.stat()
        stamp = [st.st_size, st.st_mtime_ns]
        if done.get(rel) == stamp:
            continue
        dst = remote / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        with p.open("rb") as src, dst.open("wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
        done[rel], copied = stamp, copied + 1
    atomic_write_json(manifest, done)
    return copied


def pull(run_dir) -> int:
    """Copy the URI run_dir's files that the staging directory lacks into it (a fresh host resuming a run; a no-op
    for a local run_dir). Returns how many files were copied."""
    if not is_uri(run_dir):
        return 0
    from etils import epath

    local, remote = local_dir(run_dir), epath.Path(str(run_dir))
    if not remote.exists():
        return 0
    copied, todo = 0, [(remote, ())]
    while todo:  # by iterdir: epath refuses a recursive glob on object stores, and its walk drops the scheme
        folder, rel = todo.pop()
        for src in folder.iterdir():
            if not rel and src.name in STAGING_SKIP:
                continue
            if src.is_dir():
                todo.append((src, (*rel, src.name)))
            elif not local.joinpath(*rel, src.name).exists():
                atomic_write_bytes(local.joinpath(*rel, src.name), src.read_bytes())
                copied += 1
    return copied
