"""swap.locked: an inter-process lock that leaves no file behind and never lets two holders in at once."""

from __future__ import annotations

import os
import threading
import time

import pytest

from seq2trt.core.errors import ArtifactError
from seq2trt.core.swap import locked

from helpers.faults import permission_denied, raising


def test_lock_turns_and_cleanup(tmp_path):
    """Holders in threads (each its own open file, as processes have): never two inside, the file removed after."""
    path, inside, overlaps, order = tmp_path / ".x.lock", [], [], []

    def hold(name: str) -> None:
        with locked(path, "x"):
            inside.append(name)
            overlaps.append(len(inside))
            order.append(name)
            time.sleep(0.05)
            inside.remove(name)

    threads = [threading.Thread(target=hold, args=(str(i),)) for i in range(4)]
    for t in threads:  # staggered: some wait on the first holder's file, later ones find it removed
        t.start()
        time.sleep(0.03)
    for t in threads:
        t.join(timeout=30)
    assert sorted(order) == ["0", "1", "2", "3"] and max(overlaps) == 1
    assert not path.exists()


def test_lock_released_on_error(tmp_path):
    path = tmp_path / ".x.lock"
    try:
        with locked(path):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    with locked(path):  # would block forever if the first holder had kept it
        assert path.exists()
    assert not path.exists()


def test_lock_in_a_folder_that_cannot_be_written_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "open", raising(permission_denied()))  # chmod cannot show it: tests may run as root
    with pytest.raises(ArtifactError, match="permission denied; nothing was changed; choose a folder you can write"):
        with locked(tmp_path / ".x.lock"):
            pass


def test_written_files_and_directories_follow_the_umask(tmp_path):
    """mkstemp/mkdtemp make private files; artifacts are ordinary ones, readable by whoever the umask allows."""
    from seq2trt.core.atomic_files import atomic_write_text
    from seq2trt.core.swap import staged_directory

    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "a.json", "{}")
        with staged_directory(tmp_path / "stage") as tmp:
            atomic_write_text(tmp / "b.json", "{}")
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "stage").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "stage" / "b.json").stat().st_mode & 0o777 == 0o644
