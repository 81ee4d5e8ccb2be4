"""`seq2trt serve`: the real Triton Inference Server that the `nvidia-pytriton` wheel bundles (2.51, Python backend),
started on a model repository of Python-backend models (`generate`, and `translate` when the checkpoint has a
tokenizer, whose code is `serving.triton_model.TritonPythonModel`; for a Whisper export `transcribe` alone,
`serving.triton_model.TranscribeModel`).

Two facts of the bundled server (measured; docs/serving.md): the Python-backend stub must be the one for the running
interpreter's version, and it loads `libpython3.X.so` through the dynamic loader — the running interpreter's
LIBDIR goes first on LD_LIBRARY_PATH, else a system copy of another patch level fails model loading.

HTTP requests reach Triton through serve's front (`serving.http_guard`, on --http-port; Triton's HTTP endpoint on a
private loopback port): the bundled 2.51 dies on some malformed requests and has no size limit (docs/serving-limits.md).

The server dies with `serve`, even when `serve` is killed outright (a parent-death signal, as nvidia-pytriton sets
for its own tritonserver), and its working folder `seq2trt-serve-<pid>-*` in the temporary directory names its owner,
so the next `serve` removes the folders of owners that are gone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from seq2trt.reference_model.decoding import GNMT_ALPHA
from seq2trt.reference_model.errors import DependencyError, InputError, Seq2TrtError

logger = logging.getLogger(__name__)


class ServerError(Seq2TrtError):
    """The server did not start, or stopped with an error."""

    exit_code = 1


@dataclass(frozen=True)
class ServeSettings:
    out: Path
    backend: str = "ort-fused"
    checkpoint: Path | None = None
    threads: int = 1
    max_batch: int | None = None  # requests per server batch; None: the export's max_batch
    max_queue_delay_us: int = 2000
    instances: int = 1
    alpha: float = GNMT_ALPHA
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    # The largest HTTP request body (MiB) serve's front takes (serving.http_guard): later Triton releases' own
    # --http-max-input-size default: 64 MiB of JSON floats (8-20 bytes each) is 3.5-9 min of 16 kHz samples, of a
    # 16-bit WAV file 35 min (docs/serving-limits.md).
    max_request_mb: float = 64.0

    def endpoints(self) -> dict[str, str]:
        return {"http": f"http://{self.host}:{self.http_port}", "grpc": f"grpc://{self.host}:{self.grpc_port}",
                "metrics": f"http://{self.host}:{self.metrics_port}/metrics"}


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
    from seq2trt.translator import check_decode_options

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


def _pbtxt_value(value) -> str:
    return json.dumps(value) if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)


def tensor_block(name: str, dtype: str, dims: list[int], **extra) -> str:
    fields = [f"name: {json.dumps(name)}", f"data_type: {dtype}", f"dims: [ {', '.join(map(str, dims))} ]"]
    fields += [f"{key}: {_pbtxt_value(value)}" for key, value in extra.items()]
    return "  {\n    " + "\n    ".join(fields) + "\n  }"


def model_config(name: str, inputs: list[str], outputs: list[str], max_batch: int, *, backend: str | None = None,
                 platform: str | None = None, delay_us: int | None = None, instances: int = 1, kind: str = "KIND_CPU",
                 parameters: dict[str, str] | None = None) -> str:
    """A config.pbtxt in Triton's text format (parsed by its model-config protobuf, `ModelConfig`)."""
    lines = [f"name: {json.dumps(name)}"]
    lines += [f"backend: {json.dumps(backend)}"] if backend else []
    lines += [f"platform: {json.dumps(platform)}"] if platform else []
    lines.append(f"max_batch_size: {max_batch}")
    lines.append("input [\n" + ",\n".join(inputs) + "\n]")
    lines.append("output [\n" + ",\n".join(outputs) + "\n]")
    if delay_us is not None:
        lines.append(f"dynamic_batching {{\n  max_queue_delay_microseconds: {delay_us}\n}}")
    lines.append(f"instance_group [\n  {{\n    count: {instances}\n    kind: {kind}\n  }}\n]")
    for key, value in (parameters or {}).items():
        lines.append(f"parameters {{\n  key: {json.dumps(key)}\n  value: {{ string_value: {json.dumps(value)} }}\n}}")
    return "\n".join(lines) + "\n"


def request_inputs(kind: str) -> list[str]:
    """The served models' inputs: generate takes ids, translate text; both take the optional search limits and
    search options (`decode_service.REQUEST_OPTIONS`: sampling, length floor, repetition rules, n_best, scores)."""
    from seq2trt.serving.decode_service import REQUEST_OPTIONS

    limits = [tensor_block("max_new_tokens", "TYPE_INT32", [1], optional=True),
              tensor_block("num_beams", "TYPE_INT32", [1], optional=True)]
    if kind == "transcribe":  # serving.transcribe_service: file bytes, or samples and their rate
        return [tensor_block("audio", "TYPE_STRING", [1], optional=True),
                tensor_block("samples", "TYPE_FP32", [-1], optional=True, allow_ragged_batch=True),
                tensor_block("sampling_rate", "TYPE_INT32", [1], optional=True),
                tensor_block("language", "TYPE_STRING", [1], optional=True),
                tensor_block("task", "TYPE_STRING", [1], optional=True),
                tensor_block("timestamps", "TYPE_BOOL", [1], optional=True),
                # transformers' long-form options (transcribe_service.SpeechJob); temperature: one, or the fallback list
                tensor_block("condition_on_prev_tokens", "TYPE_BOOL", [1], optional=True),
                tensor_block("temperature", "TYPE_FP32", [-1], optional=True, allow_ragged_batch=True),
                tensor_block("compression_ratio_threshold", "TYPE_FP32", [1], optional=True),
                tensor_block("logprob_threshold", "TYPE_FP32", [1], optional=True),
                tensor_block("seed", "TYPE_INT64", [1], optional=True)] + limits
    limits += [tensor_block(name, dtype, [1], optional=True) for name, (_, dtype) in REQUEST_OPTIONS.items()]
    if kind == "generate":
        return [tensor_block("input_ids", "TYPE_INT64", [-1], allow_ragged_batch=True)] + limits
    return [tensor_block("text", "TYPE_STRING", [1]), tensor_block("src_lang", "TYPE_STRING", [1], optional=True),
            tensor_block("tgt_lang", "TYPE_STRING", [1], optional=True)] + limits


def request_outputs(kind: str) -> list[str]:
    """The best hypothesis (ids or text); `hypotheses` (JSON) and `scores` when a request asks n_best or scores.
    transcribe: the text, its segments (JSON), the language and the token ids."""
    if kind == "transcribe":
        return [tensor_block("text", "TYPE_STRING", [1]), tensor_block("segments", "TYPE_STRING", [1]),
                tensor_block("language", "TYPE_STRING", [1]), tensor_block("tokens", "TYPE_INT64", [-1])]
    best = [tensor_block("output_ids", "TYPE_INT64", [-1])] if kind == "generate" else \
        [tensor_block("text", "TYPE_STRING", [1])]
    return best + [tensor_block("hypotheses", "TYPE_STRING", [1]), tensor_block("scores", "TYPE_FP32", [-1])]


def write_python_model(repository: Path, kind: str, max_batch: int, delay_us: int, instances: int,
                       parameters: dict[str, str], code: str) -> Path:
    folder = repository / kind
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(model_config(kind, request_inputs(kind), request_outputs(kind), max_batch,
                                                      backend="python", delay_us=delay_us, instances=instances,
                                                      parameters={"kind": kind, **parameters}))
    (folder / "1" / "model.py").write_text(code)
    return folder


def model_kinds(text: bool, audio: bool) -> list[str]:
    """The models served for an export: `transcribe` alone for a speech model (it reads audio, never ids), else
    `generate`, and `translate` when the checkpoint has a tokenizer."""
    if audio:
        return ["transcribe"]
    return ["generate", "translate"] if text else ["generate"]


_MODEL_CODE = {
    "transcribe": "from seq2trt.serving.triton_model import TranscribeModel as TritonPythonModel  # noqa: F401\n"}


def write_local_repository(repository: Path, settings: ServeSettings, max_batch: int, text: bool,
                           audio: bool = False) -> list[str]:
    """The Python-backend models `serve` runs; returns their names."""
    parameters = {"export": str(Path(settings.out).resolve()), "backend": settings.backend,
                  "checkpoint": str(settings.checkpoint.resolve()) if settings.checkpoint else "",
                  "threads": str(settings.threads), "alpha": repr(settings.alpha)}
    kinds = model_kinds(text, audio)
    for kind in kinds:
        code = '"""seq2trt serve: the decoding lives in the installed package."""\n' + _MODEL_CODE.get(
            kind, "from seq2trt.serving.triton_model import TritonPythonModel  # noqa: F401\n")
        write_python_model(repository, kind, max_batch, settings.max_queue_delay_us, settings.instances, parameters, code)
    return kinds


def bundled_server(workdir: Path) -> tuple[Path, Path, dict[str, str]]:
    """(tritonserver binary, backend directory, environment) of the server the nvidia-pytriton wheel ships, with the
    Python-backend stub of this interpreter's version copied in."""
    try:
        import pytriton
    except ImportError:
        raise DependencyError("seq2trt serve needs Triton Inference Server: pip install 'seq2trt[serve]' "
                              "(nvidia-pytriton bundles the server; it needs numpy < 2)") from None
    package = Path(pytriton.__file__).parent
    dist = package / "tritonserver"
    stub = dist / "python_backend_stubs" / f"{sys.version_info[0]}.{sys.version_info[1]}" / "triton_python_backend_stub"
    if not stub.exists():
        raise DependencyError(f"nvidia-pytriton has no Python-backend stub for Python "
                              f"{sys.version_info[0]}.{sys.version_info[1]} ({stub} is missing)")
    backends = workdir / "backends"
    shutil.copytree(dist / "backends", backends, dirs_exist_ok=True)
    shutil.copy(stub, backends / "python" / "triton_python_backend_stub")
    env = dict(os.environ)
    libs = [sysconfig.get_config_var("LIBDIR") or "", str(package.parent / "nvidia_pytriton.libs"),
            env.get("LD_LIBRARY_PATH", "")]
    env["LD_LIBRARY_PATH"] = ":".join(p for p in libs if p)
    # The stub's embedded interpreter takes its prefix (and so this environment's packages) from PATH's python.
    env["PATH"] = f"{Path(sys.exec_prefix) / 'bin'}:{env.get('PATH', '')}"
    return dist / "bin" / "tritonserver", backends, env


def server_command(binary: Path, repository: Path, backends: Path, settings: ServeSettings, exit_timeout_s: int,
                   server_id: str, http_port: int) -> list[str]:
    """tritonserver's command line; its HTTP endpoint on the private loopback `http_port` behind serve's front."""
    return [str(binary), f"--id={server_id}", f"--model-repository={repository}", f"--backend-directory={backends}",
            "--http-address=127.0.0.1", f"--grpc-address={settings.host}", f"--metrics-address={settings.host}",
            f"--http-port={http_port}", f"--grpc-port={settings.grpc_port}",
            f"--metrics-port={settings.metrics_port}", "--allow-metrics=true", "--allow-gpu-metrics=false",
            "--allow-cpu-metrics=true", "--strict-readiness=true", f"--exit-timeout-secs={exit_timeout_s}",
            "--log-info=true", "--log-warning=true"]


def wait_ready(url: str, process: subprocess.Popen, timeout_s: float, models: list[str], server_id: str) -> None:
    """Poll until the server at `url` is ours (its metadata names `server_id`) and every model is loaded; raise if
    the process dies or time runs out. A server of someone else's on that port never counts as ready."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerError(f"tritonserver exited with code {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/v2", timeout=2) as answer:
                ours = json.loads(answer.read()).get("name") == server_id
            if ours and all(urllib.request.urlopen(f"{url}/v2/models/{m}/ready", timeout=2).status == 200
                            for m in models):
                return
        except (OSError, ValueError, AttributeError):
            pass
        time.sleep(0.2)
    raise ServerError(f"tritonserver was not ready within {timeout_s:.0f} s")


_WORKDIR_PREFIX = "seq2trt-serve-"


def die_with(parent_pid: int):
    """A preexec_fn: the child gets SIGTERM (Triton's drain; it exits within its exit timeout) when `parent_pid`
    dies, however it dies. Linux only; elsewhere the child outlives a killed parent."""
    def preexec() -> None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
            libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
        if os.getppid() != parent_pid:  # the parent died before prctl: no signal will come
            os._exit(1)
    return preexec


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_dead_workdirs(root: Path | None = None) -> list[Path]:
    """Remove the working folders of `serve` processes that are gone (killed before they could clean up)."""
    removed = []
    for folder in Path(root or tempfile.gettempdir()).glob(f"{_WORKDIR_PREFIX}*"):
        match = re.fullmatch(rf"{_WORKDIR_PREFIX}(\d+)-.+", folder.name)
        if match and folder.is_dir() and not folder.is_symlink() and not _alive(int(match.group(1))):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    if removed:
        logger.info("removed %d working folder(s) of serve processes that are gone", len(removed))
    return removed


# What Triton's log says went wrong: its error lines, protobuf's parse errors, its last word; not the CUDA notice
# every start on a machine without a GPU logs.
_LOG_ERRORS = (re.compile(r"^E\d{4} \S+ +\d+ [^\]]+\] (.*)"), re.compile(r"^\[libprotobuf ERROR [^\]]*\] (.*)"),
               re.compile(r"^(error: .*)"))
_LOG_NOISE = ("CudaDriverHelper has not been initialized",)


def log_errors(path: Path, start: int = 0, n: int = 3) -> list[str]:
    """The last `n` error lines of the server log `path` written after byte `start`, each shortened to one line."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(start, size - (1 << 20)))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        match = next((m for m in (p.match(line) for p in _LOG_ERRORS) if m), None)
        if match and not any(noise in line for noise in _LOG_NOISE):
            message = match.group(1).strip().strip('"').split("\\n")[0]  # a Python error's frames follow
            found.append(message if len(message) <= 300 else message[:297] + "...")
    return found[-n:]


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
    from seq2trt.serving.http_guard import HttpGuard, model_inputs

    binary, backends, env = bundled_server(tmp)
    if served is not None:
        repository = tmp / "models"
        models = write_local_repository(repository, settings, settings.max_batch or served[0], served[1], served[2])
        inputs = {m: model_inputs((repository / m / "config.pbtxt").read_text()) for m in models}
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
