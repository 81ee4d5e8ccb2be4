"""Directories replaced whole: staged beside their place, then swapped in under a lock, with a journal.

`staged_directory(out)` yields a fresh hidden folder beside `out` and, when the block succeeds, replaces `out` by
two renames (the old folder set aside, the new one moved in) under a lock, with a journal beside it: a process
killed between them leaves a state that `recover` (called by the next run of any verb on that directory) finishes,
and staging folders or lock files of processes that are gone are removed. `locked(path)` is the advisory
inter-process lock (flock) those swaps take turns on, and stages that must not run twice at once on the same output
use too; `replacements_paused(out)` holds off swaps while a reader writes into `out`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

from seq2trt.core.errors import ArtifactError, raise_if_signalled
from seq2trt.core.atomic_files import Kind, WriteError, atomic_write_text, current_umask, refuse_existing, write_error

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def staged_directory(out: Path, force: bool = False, what: str = "output", kind: Kind | None = None,
                     protect: Iterable[Path] = ()) -> Iterator[Path]:
    """Yield a fresh temporary directory beside `out`; on success it replaces `out` in one rename.

    `out` must pass `refuse_existing(out, force, what, kind, protect)`. On any failure the temporary directory
    is removed and `out` is left exactly as it was; a replacement that a killed process left half done, and
    staging folders of processes that are gone, are repaired first (`recover`).
    """
    out = Path(out)
    with replacements_paused(out):  # a replacement racing this check would hide `out`'s marker from it
        refuse_existing(out, force, what, kind, protect)
    recover(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.{_owner_tag(os.getpid())}.", suffix=".partial",
                                    dir=out.parent))
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes it private; an artifact directory is an ordinary one
    except OSError as exc:
        raise (write_error(exc, out) or exc) from exc
    try:
        yield tmp
        raise_if_signalled()  # a signal whose interrupt a library swallowed still stops the write here
        _swap_into_place(tmp, out, force)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        kept = f"the previous {what} in {out} is intact" if out.exists() else f"nothing was written to {out}"
        if isinstance(exc, WriteError):  # name the file as the user knows it, not the hidden staging path
            inside = _relative_to(exc.path, tmp)
            if inside is not None:
                raise WriteError(out / inside, exc.why, kept, exc.fix) from exc.__cause__
        error = write_error(exc, out, kept, only_writes=True)
        if error is not None:
            raise error from exc
        raise


def _relative_to(path: Path, folder: Path) -> Path | None:
    try:
        return path.relative_to(folder)
    except ValueError:
        return None


def _journal(out: Path) -> Path:
    """The record of a replacement in progress: which staged folder replaces `out` and where the old one went."""
    return out.parent / f".{out.name}.swap"


def _swap_lock(out: Path) -> Path:
    return out.parent / f".{out.name}.swap.lock"


def _swap_into_place(tmp: Path, out: Path, force: bool = True) -> None:
    """Rename `tmp` to `out`; an existing `out` is set aside first and put back if the second rename fails.

    Replacements of one `out` take turns (a lock beside it), and each writes a journal first, so that a process
    killed between the two renames leaves a state the next run repairs (`recover`). What came in the meantime is
    checked again under the lock: a folder another process put at `out` is replaced only as `force` allows.
    """
    with locked(_swap_lock(out), str(out)):
        _recover_locked(out)
        old = None
        if out.exists():
            if out.is_dir() and any(out.iterdir()) and not force:
                raise ArtifactError(f"{out} was written by another seq2trt process meanwhile; pass --force to "
                                    "replace it")
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
            atomic_write_text(_journal(out), json.dumps({"new": tmp.name, "old": old.name, "pid": os.getpid()}))
            os.replace(out, old)  # onto the empty directory mkdtemp made
        try:
            os.replace(tmp, out)
        except BaseException:
            if old is not None and not out.exists():
                os.replace(old, out)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_journal(out))
            raise
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_journal(out))
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def replacements_paused(out: Path) -> Iterator[None]:
    """Hold off any replacement of the directory `out` (the lock `staged_directory` swaps under) while a reader
    checks that `out` is still what it read and writes into it. Where the lock cannot be made (a folder we may
    only read), nothing can replace `out` through seq2trt either, so the reader goes on without it."""
    try:
        lock = locked(_swap_lock(Path(out)), str(out))
        lock.__enter__()
    except ArtifactError:
        yield
        return
    try:
        yield
    finally:
        lock.__exit__(None, None, None)


def _leftovers(out: Path) -> dict[str, list[Path]]:
    """Hidden folders and files beside `out` that its writers leave while they run."""
    name = re.escape(out.name)
    patterns = {"partial": rf"\.{name}\.(\d+-\d+)\.[a-z0-9_]{{8}}\.partial", "old": rf"\.{name}\.[a-z0-9_]{{8}}\.old",
                "journal": rf"\.{name}\.swap", "lock": rf"\.{name}\.(swap\.)?lock"}
    found: dict[str, list[Path]] = {k: [] for k in patterns}
    try:
        entries = list(out.parent.iterdir()) if out.name else []
    except OSError:
        return found
    for entry in entries:
        for key, pattern in patterns.items():
            if re.fullmatch(pattern, entry.name):
                found[key].append(entry)
    return found


def recover(out: Path) -> None:
    """Repair what a killed writer of `out` left: finish a replacement stopped between its two renames (the new
    folder was complete), put back an old folder set aside, remove staging folders whose process is gone and
    lock files nobody holds. Every verb calls it on the directories it reads or writes; cheap when all is well."""
    out = Path(out)
    if _swap_lock(out).absolute() in _held:  # this process is replacing `out` or writing into it: nothing to repair
        return
    found = _leftovers(out)
    stale_partials = [p for p in found["partial"] if not _owner_alive(p)]
    if not (found["journal"] or found["old"] or stale_partials or found["lock"]):
        return
    try:
        with locked(_swap_lock(out), str(out)):
            _recover_locked(out)
    except (ArtifactError, PermissionError) as exc:  # a folder we may only read: leave it to its owner
        logger.debug("cannot repair %s: %s", out, exc)


_HIDDEN_WORK = re.compile(r"\.(.+?)(\.\d+-\d+\.[a-z0-9_]{8}\.partial|\.[a-z0-9_]{8}\.old|\.swap)")


def recover_tree(root: Path, depth: int = 3) -> None:
    """`recover` every directory under `root` (itself included, `depth` levels down) that a killed writer left
    work beside: an artifact directory's readers call it, so a half-done replacement of any of its folders (fused
    graphs, engines, ...) is repaired by the next verb that reads it."""
    root = Path(root)
    recover(root)
    folders = [root]
    for _ in range(depth):
        found = []
        for folder in folders:
            try:
                entries = list(folder.iterdir())
            except OSError:
                continue
            for name in {m.group(1) for e in entries if (m := _HIDDEN_WORK.fullmatch(e.name))}:
                recover(folder / name)
            found += [e for e in entries if e.is_dir() and not e.name.startswith(".")]
        folders = found


def _recover_locked(out: Path) -> None:
    """`recover`'s work, with the swap lock held (so no replacement of `out` is in progress)."""
    found = _leftovers(out)
    journal = _journal(out)
    if journal.exists():  # its writer held the lock we hold now: it died between its renames
        try:
            record = json.loads(journal.read_text())
            new, old = out.parent / record["new"], out.parent / record["old"]
        except (OSError, ValueError, KeyError, TypeError):
            new = old = None
        if new is not None and not out.exists() and new.is_dir():
            os.replace(new, out)
            logger.warning("finished replacing %s, which an interrupted run left half done", out)
        os.unlink(journal)
    for old in _leftovers(out)["old"]:
        if not out.exists():
            os.replace(old, out)
            logger.warning("restored %s, which an interrupted run had set aside", out)
        else:
            shutil.rmtree(old, ignore_errors=True)
    for partial in found["partial"]:
        if partial.exists() and not _owner_alive(partial):
            shutil.rmtree(partial, ignore_errors=True)
            logger.info("removed %s, left by a run that is gone", partial.name)
    for lock in found["lock"]:
        if lock.name != _swap_lock(out).name:
            _remove_if_unheld(lock)


def _remove_if_unheld(lock: Path) -> None:
    """Remove a lock file no process holds (its holder was killed); `locked` waiters then retry on a new one."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with contextlib.suppress(FileNotFoundError):
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                os.unlink(lock)
    except OSError:
        pass  # held: its owner is alive
    finally:
        os.close(fd)


def _owner_tag(pid: int) -> str:
    """`<pid>-<start>`: the process and its start time in clock ticks since boot (Linux /proc; 0 elsewhere), so that
    a later process given the same pid is not taken for the owner. Ticks since boot, not the wall clock: a clock
    set back or forward does not make a running owner look dead."""
    return f"{pid}-{_process_start_ticks(pid) or 0}"


def _owner_alive(partial: Path) -> bool:
    """The process that made a staging folder (its name says which: `_owner_tag`) is still running."""
    pid, start = (int(n) for n in partial.name.rsplit(".", 3)[-3].split("-"))
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    now = _process_start_ticks(pid)
    return not (start and now) or now == start


def _process_start_ticks(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (field 22 of /proc/<pid>/stat), or None where unreadable."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


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
    _held.add(path.absolute())
    try:
        yield
    finally:
        _held.discard(path.absolute())
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)


# Lock files this process holds (`locked`): a second flock on one of them from the same thread would wait forever.
_held: set[Path] = set()
