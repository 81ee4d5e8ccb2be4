"""The one exception tree of seq2trt.

Every error a user can cause is a `Seq2TrtError`; the CLI prints its message as one line and exits with
`exit_code`: 2 for bad input (a file, a flag, a text), 1 for a check that ran and failed.
"""

from __future__ import annotations


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


class CheckFailed(Seq2TrtError):
    """A check ran to the end and failed (parity, fusion audit, accuracy target)."""

    exit_code = 1


def first_line(exc: BaseException) -> str:
    """The first line of an exception from a library (protobuf, onnx, ONNX Runtime), for a one-line error; its type
    name when it says nothing."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
