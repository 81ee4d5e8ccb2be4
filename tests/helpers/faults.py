"""Stand-ins that make a call fail, for monkeypatch: the faults a write meets (a full disk, Ctrl-C, a refused
permission) injected where the code under test makes the call."""

from __future__ import annotations

import errno
import os
from typing import Callable

DISK_FULL = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def permission_denied() -> PermissionError:
    return PermissionError(errno.EACCES, os.strerror(errno.EACCES))


def raising(exc: BaseException) -> Callable:
    """A stand-in that raises `exc` whenever it is called, whatever its arguments."""
    def stand_in(*args, **kwargs):
        raise exc

    return stand_in


def fail_on_call(n: int, exc: BaseException, real: Callable) -> Callable:
    """A stand-in for `real` that raises `exc` on its n-th call (1-based): a write that stops midway."""
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise exc
        return real(*args, **kwargs)

    return wrapper
