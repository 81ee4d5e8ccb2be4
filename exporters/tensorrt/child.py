"""TensorRT's build in a child process, so that a native crash ends the child, not the caller.

TensorRT-RTX aborts its whole process (SIGABRT, `malloc_consolidate(): invalid chunk size`) on some damaged graphs
that still parse. `BuildChild` runs `build` jobs in a fresh Python started with `sys.executable`: one child
per `with` block, reused by every job inside it (`build_engines` builds both graphs in one child). Starting one
imports seq2trt's build path and TensorRT, not torch: 0.2–0.4 s (1.7 s when the plugin's definition still imported
torch). A child that dies — a signal, or an exit while a job is open — is a `BuildError` naming the graph, the
signal or exit code and TensorRT's last error lines.

Jobs go in and messages come back over two pipes (multiprocessing's framed pickles): TensorRT's log records,
re-logged here under their own logger names; build progress; then the result, or the exception the job raised
(Seq2TrtErrors stay what they were). The child's stdout and stderr go to a temporary file whose last lines (glibc's
abort message, a Python traceback) the BuildError quotes. The child ignores SIGINT (Ctrl-C at a terminal reaches
the whole process group): its parent decides, kills it when interrupted (`deferred_interrupt`'s event), and takes it
along when the parent itself dies (Linux's parent-death signal).
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Callable

from seq2trt.core.errors import ArtifactError, Seq2TrtError

logger = logging.getLogger(__name__)

# `-c` puts the working directory first on sys.path; the child imports what its parent does, not files lying there.
_ENTRY = "import sys; del sys.path[0]; from seq2trt.exporters.tensorrt.child import child_main; child_main()"
_POLL_S = 0.1  # how often the parent looks at its interrupt event while the child builds


class BuildError(ArtifactError):
    """TensorRT's build process died (killed by a signal, or exited) instead of failing with an error."""


class _RemoteTraceback(Exception):
    """The child's traceback, chained under the exception it raised (shown with --debug)."""


class BuildChild:
    """A child process that runs build jobs: `with BuildChild() as child: child.run(...)`. Started by the first job."""

    def __init__(self):
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> "BuildChild":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def pid(self) -> int | None:
        """The running child's process id; None before its first job and once it has ended."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def start(self) -> None:
        """Start the child now (the first `run` does otherwise), e.g. to overlap its start with other work."""
        if self._proc is not None:
            if self._proc.poll() is None:
                return
            self._release()  # it ended between jobs
        jobs_read, jobs_write = os.pipe()
        out_read, out_write = os.pipe()
        self._output = tempfile.TemporaryFile()
        try:
            self._proc = subprocess.Popen([sys.executable, "-c", _ENTRY, str(jobs_read), str(out_write),
                                           str(os.getpid())], stdin=subprocess.DEVNULL, stdout=self._output,
                                          stderr=subprocess.STDOUT, pass_fds=(jobs_read, out_write))
        except BaseException:
            for fd in (jobs_write, out_read):
                os.close(fd)
            raise
        finally:
            for fd in (jobs_read, out_write):  # the child's ends: our copies would hide its exit from us
                os.close(fd)
        self._jobs, self._messages = Connection(jobs_write, readable=False), Connection(out_read, writable=False)

    def run(self, graph: Path, job: dict, progress: Callable[[str, int, int], None] | None,
            interrupted: threading.Event):
        """Send one job (`child_main` reads its keys) and relay the child's messages until the job's result, which
        is returned. Returns None once `interrupted` is set (the child is killed; the caller raises)."""
        self.start()
        errors: collections.deque[str] = collections.deque(maxlen=3)
        try:
            try:
                self._jobs.send({**job, "progress": progress is not None, "log_level": _log_level()})
            except OSError:  # the child is already gone
                raise self._died(graph, errors) from None
            while True:
                if interrupted.is_set():
                    self.kill()
                    return None
                if not self._messages.poll(_POLL_S):
                    continue
                try:
                    kind, *payload = self._messages.recv()
                except (EOFError, OSError):
                    raise self._died(graph, errors) from None
                if kind == "log":
                    name, level, text = payload
                    logging.getLogger(name).log(level, "%s", text)
                    if level >= logging.ERROR:
                        errors.append(text)
                elif kind == "progress":
                    if progress is not None:
                        progress(*payload)
                elif kind == "error":
                    exc, trace = payload
                    break
                else:
                    return payload[0]
        except BaseException:
            self.kill()  # dead, or the parent was interrupted: nothing of the child is to be kept
            raise
        raise exc from _RemoteTraceback(trace)  # the job failed; the child is well and takes the next one

    def kill(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            self._release()

    def close(self) -> None:
        """End the child: it exits when its job pipe closes; killed if it has not within a few seconds."""
        if self._proc is None:
            return
        self._jobs.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._release()

    def _release(self) -> None:
        for connection in (self._jobs, self._messages):
            connection.close()
        self._output.close()
        self._proc = None

    def _died(self, graph: Path, errors) -> BuildError:
        """The BuildError for a child that died during a job (its exit status, TensorRT's errors, its last words)."""
        try:
            code = self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # its message pipe broke but it lives on: not a state to build in
            self._proc.kill()
            code = self._proc.wait()
        if code < 0:
            how = f"killed by {signal.Signals(-code).name}, exit code {128 - code}"
        else:
            how = f"exit code {code}"
        self._output.seek(0, os.SEEK_END)
        self._output.seek(max(0, self._output.tell() - 4096))
        words = [line.strip() for line in self._output.read().decode(errors="replace").splitlines() if line.strip()]
        said = "".join(f"; TensorRT: {e}" for e in errors) + (f"; its last output: {words[-1][:300]}" if words else "")
        self.kill()
        return BuildError(f"TensorRT's build process crashed on {graph} ({how}){said}. The graph is damaged, or "
                          "TensorRT has a bug it meets: re-export (and re-fuse) it; if it still crashes, report "
                          "the graph with this message".replace("\n", " "))


def _log_level() -> int:
    """What the child forwards: records this process would log, and always the errors a BuildError quotes."""
    return min(logging.getLogger("seq2trt").getEffectiveLevel(), logging.ERROR)


class _Forward(logging.Handler):
    def __init__(self, messages: Connection):
        super().__init__()
        self.messages = messages

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.messages.send(("log", record.name, record.levelno, record.getMessage()))
        except OSError:  # the parent is gone: nothing to build for
            os._exit(1)


def _die_with_parent(parent: int) -> None:
    """Linux: SIGKILL to this process when the parent dies (prctl PR_SET_PDEATHSIG), e.g. killed by SIGKILL."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


def _sendable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling, else an exception of a class that does, with its message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return (ArtifactError if isinstance(exc, Seq2TrtError) else RuntimeError)(f"{type(exc).__name__}: {exc}")


def child_main() -> None:
    """The child: `python -c _ENTRY <job fd> <message fd> <parent pid>`; builds each job until its job pipe closes."""
    import traceback

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    jobs_fd, messages_fd, parent = (int(a) for a in sys.argv[1:4])
    _die_with_parent(parent)
    jobs, messages = Connection(jobs_fd, writable=False), Connection(messages_fd, readable=False)
    root = logging.getLogger()
    root.addHandler(_Forward(messages))
    import importlib

    while True:
        try:
            job = jobs.recv()
        except EOFError:
            return
        root.setLevel(job.pop("log_level"))
        send_progress = job.pop("progress")
        report = (lambda phase, done, total: messages.send(("progress", phase, done, total))) if send_progress else None
        module, _, name = job.pop("function").partition(":")  # the job names its function: no import back
        try:
            result = getattr(importlib.import_module(module), name)(**job, progress=report)
        except Exception as exc:
            messages.send(("error", _sendable(exc), traceback.format_exc()))
        else:
            messages.send(("result", result))
