"""Atomic file writes, sha256 of files, and what may be replaced.

Every file is written under a temporary name and renamed into place, so an interrupted or failed write (disk
full, Ctrl-C, an exception) leaves the previous file intact and no half-written file behind; a plain output the user
names may also be a device or a FIFO, written in place (`write_plain_output`). A full disk, a quota
or a read-only / forbidden folder becomes an `ArtifactError` that says so (`WriteError`).

`--force` replaces only an artifact of the kind the command writes (`refuse_existing`), never the current
directory or a folder holding what the command reads. Whole directories are staged and swapped into place by
swap.py.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Union

from seq2trt.core.errors import ArtifactError

# Failed writes the user can fix (space, quota, permissions), as opposed to bugs.
_WRITE_ERRNOS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
                 errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
                 errno.EPERM: "operation not permitted"}


def write_error(exc: BaseException, path: Path, kept: str = "nothing was changed",
                only_writes: bool = False) -> "WriteError | None":
    """The ArtifactError for a failed write the user can fix, or None for anything else. `only_writes`: the error
    may come from a read too, so only errors that a write alone can cause (space, quota, read-only) count."""
    why = _WRITE_ERRNOS.get(exc.errno) if isinstance(exc, OSError) else None
    if why is None or (only_writes and exc.errno in (errno.EACCES, errno.EPERM)):
        return None
    fix = "free some space" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "choose a folder you can write to"
    return WriteError(path, why, kept, fix)


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
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes it private; an artifact file is an ordinary one
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise_write_error(exc, path)
        raise


def raise_write_error(exc: BaseException, path: Path) -> None:
    """Raise the one-line WriteError for a failed replacement of the file `path` (saying whether the previous one
    is intact), when `exc` is a write the user can fix; return otherwise, for the caller to re-raise `exc`."""
    kept = f"the previous {path.name} is intact" if path.exists() else "nothing was written"
    error = write_error(exc, path, kept)
    if error is not None:
        raise error from exc


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def write_plain_output(path: Path, data: bytes, what: str) -> None:
    """Write a user-named output file (`what` is its flag, e.g. --output-ids).

    A regular file (or a new one) is replaced atomically. A device or a FIFO is opened and written in place: renaming
    a file onto it would replace it (as root, /dev/null with a regular file). A symlink is written through: it is
    resolved and its target is written as above (a regular target staged beside the target, not beside the link), so
    the link stays a link. A folder, or a write that fails, is one ArtifactError naming the path.
    """
    path = Path(path)
    try:
        mode = os.stat(path).st_mode  # through links, /proc's fd links (/dev/stdout) included
    except FileNotFoundError:  # a new file, or a link to one
        mode = None
    except OSError as exc:  # a link loop, a parent that is a file
        raise ArtifactError(f"cannot write {what} {path}: {exc.strerror}; give a file path") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise ArtifactError(f"{what} {path} is a directory; give a file path")
    if mode is None or stat.S_ISREG(mode):
        try:
            atomic_write_bytes(Path(os.path.realpath(path)), data)
        except OSError as exc:  # not a space, quota or permission problem (those are WriteErrors already)
            raise ArtifactError(f"cannot write {what} {path}: {exc.strerror or exc}; give a file path") from None
        return
    try:
        with open(path, "wb") as f:  # a device or a FIFO, opened where it is
            f.write(data)
    except OSError as exc:
        kept = "it is a device or a pipe, written in place, so part of the output may have reached it"
        error = write_error(exc, path, kept)
        raise error or ArtifactError(f"cannot write {path}: {(exc.strerror or str(exc)).lower()}; {kept}") from None


# A directory kind: the file name that marks it (manifest.json, build.json, ...) or a test of the directory.
Kind = Union[str, Callable[[Path], bool]]


def _is_kind(folder: Path, kind: Kind) -> bool:
    return kind(folder) if callable(kind) else (folder / kind).is_file()


def _within(path: Path, folder: Path) -> bool:
    """`path` is `folder` or lies inside it (both resolved)."""
    return path == folder or folder in path.parents


def refuse_existing(out: Path, force: bool = False, what: str = "output", kind: Kind | None = None,
                    protect: Iterable[Path] = ()) -> None:
    """Raise if `out` cannot be (re)placed; touches nothing.

    Refused always: a file; the current directory or a folder holding it; a folder that is or holds any `protect`
    path (the source a stage reads). A non-empty directory only with `force`, and then only when it is a seq2trt
    artifact of this `kind` (the file that marks it, e.g. manifest.json, or a test of the folder): `--force`
    replaces what this command wrote before, never an unrelated folder.
    """
    out = Path(out)
    resolved = out.resolve()
    cwd = _cwd()
    if cwd is not None and _within(cwd, resolved):
        raise ArtifactError(f"{what} path {out} is the current directory or holds it; replacing it would delete "
                            "the folder you are working in; choose a new folder for the output")
    for source in protect:
        if _within(Path(source).resolve(), resolved):
            raise ArtifactError(f"{what} path {out} holds {source}, which this command reads; writing there would "
                                "replace it; choose another folder for the output")
    if out.exists() and not out.is_dir():
        raise ArtifactError(f"{what} path {out} exists and is not a directory; choose another path")
    if not (out.is_dir() and any(out.iterdir())):
        return
    if not force:
        raise ArtifactError(f"{what} directory {out} already exists; pass --force to replace it")
    if kind is not None and not _is_kind(out, kind):
        marker = kind if isinstance(kind, str) else f"{what} files"
        names = sorted(p.name for p in out.iterdir())
        raise ArtifactError(f"{what} directory {out} is not a seq2trt {what} (no {marker} in it; it holds "
                            f"{_short(names)}); --force only replaces what seq2trt wrote there; choose another "
                            "folder, or remove this one yourself if it really should go")


def _cwd() -> Path | None:
    try:
        return Path.cwd().resolve()
    except FileNotFoundError:  # the working directory was deleted: it holds nothing to protect
        return None


def _short(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


class WriteError(ArtifactError):
    """A failed write the user can fix (space, quota, permissions), naming the path and what was kept."""

    def __init__(self, path: Path, why: str, kept: str, fix: str):
        self.path, self.why, self.fix = Path(path), why, fix
        super().__init__(f"cannot write {path}: {why}; {kept}; {fix} and run the command again")
