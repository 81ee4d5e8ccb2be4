"""The one exception tree of seq2trt.

Every error a user can cause is a `Seq2TrtError`; the CLI prints its message as one line and exits with
`exit_code`: 2 for bad input (a file, a flag, a text), 1 for a check that ran and failed.
"""

from __future__ import annotations

import signal


class Seq2TrtError(Exception):
    """Base class. The message names what was expected, what came, and what to do."""

    exit_code = 2


class ConfigError(Seq2TrtError, ValueError):
    """A model or run configuration holds an invalid value."""


class CheckpointError(Seq2TrtError):
    """A checkpoint is missing, corrupt, unsafe, or does not match its config."""


class InputError(Seq2TrtError, ValueError):
    """An input (text, token ids, shapes, a path) the user gave cannot be used."""


class ArtifactError(Seq2TrtError):
    """An artifact directory is missing, tampered with, or would be overwritten."""


class DependencyError(Seq2TrtError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is (the CLI's handler) so that it unwinds like Ctrl-C: staged output is
    removed and the previous artifacts stay. A KeyboardInterrupt, so every Ctrl-C path handles it too."""

    exit_code = 143  # 128 + SIGTERM, as a shell reports a process killed by it


# Signals that reached a running command: the CLI's handlers append here before raising. A library can swallow what a
# handler raised (twice in about 35 runs of the SIGTERM-mid-export test, torch.onnx.export went on to the end and the
# command exited 0: most likely a torch callback run from C++), so a staged write checks this list before it commits
# (`raise_if_signalled`).
SIGNALS: list[int] = []


def raise_if_signalled() -> None:
    """Raise the interrupt a signal received earlier asked for (Terminated for SIGTERM, else KeyboardInterrupt)."""
    if SIGNALS:
        raise Terminated() if signal.SIGTERM in SIGNALS else KeyboardInterrupt()


class CheckFailed(Seq2TrtError):
    """A check ran to the end and failed (parity, fusion audit, accuracy target)."""

    exit_code = 1


def first_line(exc: BaseException) -> str:
    """The first line of an exception from a library (protobuf, onnx, ONNX Runtime), for a one-line error; its type
    name when it says nothing."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
