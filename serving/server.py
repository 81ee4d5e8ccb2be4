"""`seq2trt serve`: the real Triton Inference Server that the `nvidia-pytriton` wheel bundles (2.51, Python backend),
started on a model repository of Python-backend models (`generate`, and `translate` when the checkpoint has a
tokenizer, whose code is `serving.triton_model.TritonPythonModel`; for a Whisper export `transcribe` alone,
`serving.triton_model.TranscribeModel`).

The repository's configs are `serving.model_config`'s; the tritonserver process (binary, command line, readiness,
death with its parent, log errors) is `serving.process`'s; this module checks the settings and supervises a run.

HTTP requests reach Triton through serve's front (`serving.http_guard`, on --http-port; Triton's HTTP endpoint on a
private loopback port): the bundled 2.51 dies on some malformed requests and has no size limit (docs/serving-limits.md).

The server dies with `serve`, even when `serve` is killed outright (a parent-death signal, as nvidia-pytriton sets
for its own tritonserver), and its working folder `seq2trt-serve-<pid>-*` in the temporary directory names its owner,
so the next `serve` removes the folders of owners that are gone.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import signal
import socket
import subprocess
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from seq2trt.core.errors import InputError
from seq2trt.serving.model_config import write_local_repository
from seq2trt.serving.process import (_WORKDIR_PREFIX, ServerError, bundled_server, die_with, log_errors,
                                     remove_dead_workdirs, server_command, wait_ready)
from seq2trt.serving.settings import ServeSettings

logger = logging.getLogger(__name__)


_PORT_FLAGS = {"http_port": "--http-port", "grpc_port": "--grpc-port", "metrics_port": "--metrics-port"}


def check_counts(threads: int, instances: int, max_batch: int | None, max_queue_delay_us: int,
                 name=lambda field: field) -> None:
    """Refuse counts below their least value, each named by `name(field)` (the CLI's flags: --threads, ...)."""
    for field, value, least in (("threads", threads, 1), ("instances", instances, 1), ("max_batch", max_batch, 1),
                                ("max_queue_delay_us", max_queue_delay_us, 0)):
        if value is not None and value < least:
            raise InputError(f"{name(field)} must be >= {least}, got {value}")


def check_settings(settings: ServeSettings) -> None:
    """Refuse, before anything starts, a thread count the machine cannot give, a length penalty that is not a finite
    number and a request size limit that is not a positive number (named by serve's flags)."""
    from seq2trt.runtime.decode_jobs import check_threads
    from seq2trt.runtime.decode_jobs import check_decode_options

    check_threads(settings.threads)
    check_decode_options(settings.alpha, 1)
    if not 0 < settings.max_request_mb < float("inf"):
        raise InputError(f"--max-request-mb must be a number > 0, got {settings.max_request_mb}")


def check_listen(settings: ServeSettings) -> str:
    """Refuse, before anything starts, a port out of range or shared by two endpoints, a host this machine cannot
    listen on, and a port something else listens on (else the readiness poll would reach that other server).
    Returns the host's IPv4 address: Triton's HTTP and metrics endpoints take only that (given `localhost` they
    listen on 255.255.255.255)."""
    ports = {flag: getattr(settings, field) for field, flag in _PORT_FLAGS.items()}
    seen: dict[int, str] = {}
    for flag, port in ports.items():
        if not 1 <= port <= 65535:
            why = " (0, any free port, is not offered: Triton would not say which it took)" if port == 0 else ""
            raise InputError(f"{flag} must be a port number in [1, 65535], got {port}{why}; choose a free port")
        if port in seen:
            raise InputError(f"{seen[port]} and {flag} are both {port}; give each endpoint its own port")
        seen[port] = flag
    host = settings.host
    address = _ipv4_of(host)
    for flag, port in ports.items():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server does: TIME_WAIT is no owner
            try:
                probe.bind((address, port))
            except OSError as exc:
                raise _listen_error(exc, host, port, flag) from None
    return address


def _ipv4_of(host: str) -> str:
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][4][0]
    except (socket.gaierror, UnicodeError) as exc:
        try:
            socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError):
            raise InputError(f"--host {host} is not an address or a name that resolves ({exc.strerror or exc}); "
                             "give an address of this machine, such as 127.0.0.1 or 0.0.0.0") from None
        raise InputError(f"--host {host} has no IPv4 address, and Triton's HTTP endpoint listens on IPv4 only; give "
                         "an IPv4 address of this machine, such as 127.0.0.1 or 0.0.0.0") from None


def _listen_error(exc: OSError, host: str, port: int, flag: str) -> InputError:
    if exc.errno == errno.EADDRINUSE:
        return InputError(f"port {port} on {host} is in use ({flag}); stop what listens there or choose another port")
    if exc.errno == errno.EADDRNOTAVAIL:
        return InputError(f"--host {host} is not an address of this machine; give one of its addresses, such as "
                          "127.0.0.1 or 0.0.0.0")
    if exc.errno == errno.EACCES:
        return InputError(f"port {port} on {host} ({flag}) needs privileges; choose a port above 1023")
    return InputError(f"cannot listen on port {port} on {host} ({flag}): {exc.strerror}; choose another --host or port")


def check_backend(out: Path, backend: str, manifest) -> None:
    """What the served models will load, checked before the server starts (the backend kind's `check`: the graphs
    of an ONNX Runtime backend, a GPU and the engines of a TensorRT one; eager loads the checkpoint in the server)."""
    from seq2trt.runtime.registry import check_export

    check_export(out, backend, manifest)


def served_models(settings: ServeSettings) -> tuple[int, bool, bool]:
    """(the export's max_batch, whether its checkpoint has a tokenizer, whether it is a speech model), read from the
    verified manifest, once the backend's graphs are checked (and, for a speech model, that the backend can
    transcribe)."""
    from seq2trt.exporters import spec
    from seq2trt.exporters.manifest import verify

    from seq2trt.runtime.decode_jobs import checkpoint_folder, has_tokenizer

    manifest = verify(Path(settings.out), [kind.filename for kind in spec.GraphKind])
    audio = bool(getattr(manifest.config, "audio", False))
    if audio:
        from seq2trt.runtime.transcription import TRANSCRIBE_BACKENDS

        if settings.backend not in TRANSCRIBE_BACKENDS:
            raise InputError(f"--backend {settings.backend} cannot serve a speech model (transcribe runs seq2trt's "
                             f"search over a step model); choose one of {', '.join(TRANSCRIBE_BACKENDS)}")
    if settings.max_batch is not None and settings.max_batch > manifest.limits.max_batch:
        raise InputError(f"--max-batch {settings.max_batch} is above the export's max_batch "
                         f"{manifest.limits.max_batch} (its graphs take no larger batch); give at most "
                         f"{manifest.limits.max_batch}, or re-export with --max-batch {settings.max_batch}")
    check_backend(Path(settings.out), settings.backend, manifest)
    return (manifest.limits.max_batch, has_tokenizer(checkpoint_folder(settings.out, manifest, settings.checkpoint)),
            audio)


def _prepare(settings: ServeSettings, log: Path | None, repository: Path | None) -> tuple[ServeSettings, Any]:
    """What can be checked before a start (ports, host, the log, the graphs or the repository): (the settings with
    the host resolved, what `served_models` says, or None for a repository of --write-repository)."""
    check_settings(settings)
    settings = replace(settings, host=check_listen(settings))
    if log is not None:
        try:
            open(log, "ab").close()
        except OSError as exc:
            raise InputError(f"cannot write the server log --log {log}: {exc.strerror}; give a file in a folder you "
                             "can write to") from None
    served = served_models(settings) if repository is None else None
    if repository is not None and not any(Path(repository).glob("*/config.pbtxt")):
        raise InputError(f"--repository {repository} holds no model (no */config.pbtxt); write one with "
                         "`seq2trt serve OUT --write-repository DIR --repository-backend python`")
    remove_dead_workdirs()
    return settings, served


def _private_port() -> int:
    """A free loopback port for Triton's HTTP endpoint behind serve's front."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class _Launched:
    process: subprocess.Popen
    models: list[str]
    log_file: Path
    start: int  # where this start's lines begin in log_file
    guard: Any  # serving.http_guard.HttpGuard, the HTTP front
    upstream: str  # Triton's own HTTP URL (private loopback)

    def close(self) -> None:
        self.guard.stop()


def _launch(settings: ServeSettings, served, tmp: Path, log: Path | None, repository: Path | None,
            exit_timeout_s: int, server_id: str) -> _Launched:
    """Start serve's HTTP front on the user's port, then tritonserver from the working folder `tmp` behind it."""
    from seq2trt.serving.http_guard import HttpGuard
    from seq2trt.serving.model_config import input_specs

    binary, backends, env = bundled_server(tmp)
    if served is not None:
        repository = tmp / "models"
        models = write_local_repository(repository, settings, settings.max_batch or served[0], served[1], served[2])
        inputs = {m: input_specs(m) for m in models}  # a served model is named by its kind
    else:  # a repository written by --write-repository: its configs are not ours to read, the JSON is still checked
        models = sorted(p.parent.name for p in Path(repository).glob("*/config.pbtxt"))
        inputs = None
    port = _private_port()
    try:
        guard = HttpGuard((settings.host, settings.http_port), port, int(settings.max_request_mb * (1 << 20)),
                          inputs).start()
    except OSError as exc:  # taken since check_listen probed it
        raise _listen_error(exc, settings.host, settings.http_port, "--http-port") from None
    command = server_command(binary, Path(repository).resolve(), backends, settings, exit_timeout_s, server_id, port)
    logger.debug("starting %s", " ".join(command))
    log_file = Path(log) if log else tmp / "server.log"  # kept to quote its errors
    try:
        with open(log_file, "ab") as sink:
            start = sink.tell()
            # Its own session: a terminal's Ctrl-C reaches only us, and we pass one SIGTERM on.
            process = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                       start_new_session=True, preexec_fn=die_with(os.getpid()))
    except BaseException:
        guard.stop()
        raise
    return _Launched(process, models, log_file, start, guard, f"http://127.0.0.1:{port}")


def _with_log(exc: ServerError, log_file: Path, start: int, log: Path | None) -> ServerError:
    errors = log_errors(log_file, start)
    said = f": {' | '.join(errors)}" if errors else ""
    where = f"its whole log is in {log}" if log else "pass --log FILE to keep its whole log"
    return ServerError(f"{exc}{said}; {where}")


def serve(settings: ServeSettings, on_ready, ready_timeout_s: float = 300, exit_timeout_s: int = 60,
          log: Path | None = None, repository: Path | None = None) -> int:
    """Run Triton on `settings` until SIGINT/SIGTERM, then drain it: Triton refuses new requests, answers the ones in
    flight (up to `exit_timeout_s`) and exits. Calls on_ready(models, endpoints) once every model is ready. Returns
    the server's exit code (0 after a clean drain). What can be checked before the start is (ports, host, graphs)."""
    settings, served = _prepare(settings, log, repository)
    server_id = f"{_WORKDIR_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    with tempfile.TemporaryDirectory(prefix=f"{_WORKDIR_PREFIX}{os.getpid()}-") as tmp:
        launched = _launch(settings, served, Path(tmp), log, repository, exit_timeout_s, server_id)
        try:
            code, stopped = _supervise(launched, settings, server_id, on_ready, ready_timeout_s)
            if not stopped:
                raise ServerError(f"tritonserver stopped by itself with code {code}")
        except ServerError as exc:
            raise _with_log(exc, launched.log_file, launched.start, log) from None
        finally:
            launched.close()
    return code


class RunningServer:
    """Triton serving an export in the background, ready once constructed (what `seq2trt.serve` returns): its
    `models`, `endpoints` (URLs by protocol) and `process`; `stop()` drains it (Triton refuses new requests,
    answers the ones in flight within `exit_timeout_s`, exits) and returns its exit code. A context manager: the
    block's end stops it. The server dies with this process however it dies, as `seq2trt serve`'s does."""

    def __init__(self, settings: ServeSettings, ready_timeout_s: float = 300, exit_timeout_s: int = 60,
                 log: Path | None = None):
        self.settings, served = _prepare(settings, log, None)
        self.exit_timeout_s, self.code = exit_timeout_s, None
        server_id = f"{_WORKDIR_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        self._tmp = tempfile.TemporaryDirectory(prefix=f"{_WORKDIR_PREFIX}{os.getpid()}-")
        try:
            self._launched = _launch(self.settings, served, Path(self._tmp.name), log, None, exit_timeout_s,
                                     server_id)
            self.process, self.models = self._launched.process, self._launched.models
            try:
                wait_ready(self._launched.upstream, self.process, ready_timeout_s, self.models, server_id)
            except ServerError as exc:
                raise _with_log(exc, self._launched.log_file, self._launched.start, log) from None
        except BaseException:
            if getattr(self, "process", None) is not None and self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            if getattr(self, "_launched", None) is not None:
                self._launched.close()
            self._tmp.cleanup()
            raise

    @property
    def endpoints(self) -> dict[str, str]:
        return self.settings.endpoints()

    def stop(self) -> int:
        """Drain and stop the server (once; later calls return the same code)."""
        if self.code is None:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGTERM)
            try:
                self.code = self.process.wait(self.exit_timeout_s + 30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.code = self.process.wait()
            self._launched.close()
            self._tmp.cleanup()
        return self.code

    def __enter__(self) -> "RunningServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _supervise(launched: _Launched, settings: ServeSettings, server_id: str, on_ready,
               ready_timeout_s: float) -> tuple[int, bool]:
    """Wait for the started server to be ready, announce it, pass SIGINT/SIGTERM on as one SIGTERM and wait for its
    exit: (its exit code, whether a signal stopped it). Killed if anything else ends the wait."""
    process, models = launched.process, launched.models
    stop = {"signal": None}

    def forward(signum, _frame):
        stop["signal"] = signum
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            wait_ready(launched.upstream, process, ready_timeout_s, models, server_id)
            ready = True
        except ServerError:
            if stop["signal"] is None:
                raise
            ready = False  # stopped while loading
        if ready and stop["signal"] is None:
            on_ready(models, settings.endpoints())
        return process.wait(), stop["signal"] is not None
    except BaseException:
        if process.poll() is None:
            process.kill()
            process.wait()
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
