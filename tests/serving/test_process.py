"""`seq2trt serve` owns its tritonserver: killed outright (SIGKILL, no chance to clean up), its server stops and frees
the ports within seconds, and the next `serve` removes the working folder it left."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

from .conftest import Server


def _processes() -> dict[int, list[str]]:
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                found[int(entry.name)] = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
    return found


def _server_of(port: int) -> tuple[int, Path]:
    """(pid of the tritonserver listening on gRPC `port`, the serve working folder its repository lies in); its HTTP
    port is a private one behind serve's front."""
    for pid, argv in _processes().items():
        if f"--grpc-port={port}" in argv:
            repository = next(a.split("=", 1)[1] for a in argv if a.startswith("--model-repository="))
            return pid, Path(repository).parent
    raise AssertionError(f"no tritonserver on port {port}")


def _port_free(port: int) -> bool:
    """Nothing listens on `port` (connections of the dead server in TIME_WAIT do not count, as for any server)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def test_sigkill_of_serve_stops_its_server_and_the_next_serve_cleans_up(exported, tmp_path):
    server = Server(exported, tmp_path / "killed.log")
    pid, workdir = _server_of(server.grpc)
    assert workdir.is_dir() and workdir.name.startswith(f"seq2trt-serve-{server.process.pid}-")
    os.kill(server.process.pid, signal.SIGKILL)
    server.process.wait(10)
    try:
        assert _until(lambda: pid not in _processes(), 15), "tritonserver outlived its serve"
        assert _until(lambda: not any(str(workdir) in " ".join(a) for a in _processes().values()), 10), \
            "a Python-backend stub outlived its server"
        assert all(_until(lambda p=p: _port_free(p), 5) for p in (server.http, server.grpc, server.metrics))
    finally:
        if pid in _processes():
            os.kill(pid, signal.SIGKILL)
    assert workdir.is_dir()  # nobody removed it: SIGKILL left it behind
    second = Server(exported, tmp_path / "second.log")
    try:
        assert not workdir.exists()
        assert _server_of(second.grpc)[1].is_dir()  # a live serve's folder stays
    finally:
        assert second.stop() == 0
