"""Atomic file and directory writes, and sha256 of files.

Every artifact is written under a temporary name and renamed into place, so an interrupted or failed write
(disk full, Ctrl-C, an exception) leaves the previous artifact intact and no half-written file behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from .errors import ArtifactError


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


@contextlib.contextmanager
def staged_directory(out: Path, force: bool = False, what: str = "output") -> Iterator[Path]:
    """Yield a fresh temporary directory beside `out`; on success it replaces `out` in one rename.

    An existing non-empty `out` is refused unless `force`; on any failure the temporary directory is removed
    and `out` is left exactly as it was.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ArtifactError(f"{what} path {out} exists and is not a directory; choose another path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ArtifactError(f"{what} directory {out} already exists; pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        yield tmp
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.{os.getpid()}.old"
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
