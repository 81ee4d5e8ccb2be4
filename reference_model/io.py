"""Atomic file and directory writes, and sha256 of files.

Every artifact is written under a temporary name and renamed into place, so an interrupted or failed write
(disk full, Ctrl-C, an exception) leaves the previous artifact intact and no half-written file behind. A full
disk, a quota or a read-only / forbidden folder becomes an `ArtifactError` that says so. `locked(path)` is an
advisory inter-process lock (flock) for stages that must not run twice at once on the same output.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from .errors import ArtifactError

logger = logging.getLogger(__name__)

# Failed writes the user can fix (space, quota, permissions), as opposed to bugs.
_WRITE_ERRNOS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
                 errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
                 errno.EPERM: "operation not permitted"}


def write_error(exc: BaseException, path: Path, kept: str = "nothing was changed",
                only_writes: bool = False) -> ArtifactError | None:
    """The ArtifactError for a failed write the user can fix, or None for anything else. `only_writes`: the error
    may come from a read too, so only errors that a write alone can cause (space, quota, read-only) count."""
    why = _WRITE_ERRNOS.get(exc.errno) if isinstance(exc, OSError) else None
    if why is None or (only_writes and exc.errno in (errno.EACCES, errno.EPERM)):
        return None
    fix = "free some space" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "choose a folder you can write to"
    return ArtifactError(f"cannot write {path}: {why}; {kept}; {fix} and run the command again")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise (write_error(exc, path) or exc) from exc
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it private; an artifact file is an ordinary one
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        kept = f"the previous {path.name} is intact" if path.exists() else "nothing was written"
        error = write_error(exc, path, kept)
        if error is not None:
            raise error from exc
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def refuse_existing(out: Path, force: bool = False, what: str = "output") -> None:
    """Raise if `out` cannot be (re)placed: a file, or a non-empty directory without `force`. Touches nothing."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ArtifactError(f"{what} path {out} exists and is not a directory; choose another path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ArtifactError(f"{what} directory {out} already exists; pass --force to replace it")


@contextlib.contextmanager
def staged_directory(out: Path, force: bool = False, what: str = "output") -> Iterator[Path]:
    """Yield a fresh temporary directory beside `out`; on success it replaces `out` in one rename.

    An existing non-empty `out` is refused unless `force`; on any failure the temporary directory is removed
    and `out` is left exactly as it was.
    """
    out = Path(out)
    refuse_existing(out, force, what)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private; an artifact directory is an ordinary one
    except OSError as exc:
        raise (write_error(exc, out) or exc) from exc
    try:
        yield tmp
        _swap_into_place(tmp, out)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        kept = f"the previous {out.name} is intact" if out.exists() else "nothing was written"
        error = write_error(exc, out, kept, only_writes=True)
        if error is not None:
            raise error from exc
        raise


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Rename `tmp` to `out`; an existing `out` is set aside first and put back if the second rename fails."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
        os.replace(out, old)  # onto the empty directory mkdtemp made
    try:
        os.replace(tmp, out)
    except BaseException:
        if old is not None and not out.exists():
            os.replace(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def locked(path: Path, what: str = "output") -> Iterator[None]:
    """Hold an exclusive flock on the lock file `path` (created, and removed on release); waits for another holder.

    After locking, the file must still be the one at `path`: a holder that removed it on release makes a waiter
    retry on the new file, so two processes never both believe they hold the lock.
    """
    path = Path(path)
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise (write_error(exc, path) or exc) from exc
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                logger.info("waiting for another seq2trt process writing %s (lock %s)", what, path)
                fcntl.flock(fd, fcntl.LOCK_EX)
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)
