"""The tritonserver process `seq2trt serve` supervises: the bundled binary and its environment, its command line,
readiness, its death with its parent, the working folders of owners that are gone, and the errors its log names.

Two facts of the bundled server (measured; docs/serving.md): the Python-backend stub must be the one for the running
interpreter's version, and it loads `libpython3.X.so` through the dynamic loader — the running interpreter's
LIBDIR goes first on LD_LIBRARY_PATH, else a system copy of another patch level fails model loading.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from pathlib import Path

from seq2trt.core.errors import DependencyError, Seq2TrtError
from seq2trt.serving.settings import ServeSettings

logger = logging.getLogger(__name__)


class ServerError(Seq2TrtError):
    """The server did not start, or stopped with an error."""

    exit_code = 1


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
