"""`seq2trt serve`'s ports and host: out of range, shared by two endpoints, already in use or not this machine's are
refused by name before any server starts; readiness counts only the server this serve started."""

from __future__ import annotations

import http.server
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from .conftest import Server, free_ports, serve_error_line


def _serve(out, *args: str) -> subprocess.CompletedProcess:
    """serve in a subprocess: one that wrongly starts a server would block, and the timeout fails the test."""
    return subprocess.run([sys.executable, "-m", "seq2trt.cli.main", "serve", str(out), *args], capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("flag, port", [("--http-port", 0), ("--grpc-port", -1), ("--metrics-port", 70000)])
def test_a_port_out_of_range_is_named(exported, flag, port):
    http, grpc, metrics = free_ports(3)
    ports = {"--http-port": http, "--grpc-port": grpc, "--metrics-port": metrics, flag: port}
    line = serve_error_line(_serve(exported, *[str(a) for kv in ports.items() for a in kv]), 2,
                            f"{flag} must be a port number in [1, 65535], got {port}")
    assert port != 0 or "Triton would not say which it took" in line


def test_one_port_for_two_endpoints_is_refused(exported):
    http, metrics = free_ports(2)
    serve_error_line(_serve(exported, "--http-port", str(http), "--grpc-port", str(http),
                            "--metrics-port", str(metrics)), 2,
                     f"--http-port and --grpc-port are both {http}", "give each endpoint its own port")


def test_a_busy_port_is_named_and_nothing_starts(exported):
    http, grpc, metrics = free_ports(3)
    with socket.socket() as other:
        other.bind(("127.0.0.1", grpc))
        other.listen()
        start = time.monotonic()
        serve_error_line(_serve(exported, "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port",
                                str(metrics)), 2, f"port {grpc} on 127.0.0.1 is in use (--grpc-port)")
        assert time.monotonic() - start < 30


@pytest.mark.parametrize("host, fragment", [("no-such-host.invalid", "is not an address or a name that resolves"),
                                            ("192.0.2.1", "is not an address of this machine")])
def test_a_host_this_machine_cannot_listen_on_is_named(exported, host, fragment):
    ports = free_ports(3)
    serve_error_line(_serve(exported, "--host", host, "--http-port", str(ports[0]), "--grpc-port", str(ports[1]),
                            "--metrics-port", str(ports[2])), 2, f"--host {host}", fragment)


def test_readiness_counts_only_our_server(tmp_path):
    """Another server on the port answers ready for every model: that is not the server we started."""
    from seq2trt.serving.process import ServerError, wait_ready

    class Other(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = json.dumps({"name": "someone-else", "ready": True}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Other)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(ServerError, match="not ready within"):
            wait_ready(f"http://127.0.0.1:{other.server_port}", ours, 2, ["generate"], "seq2trt-serve-1-abcd")
    finally:
        ours.kill()
        ours.wait()
        other.shutdown()


def test_an_ipv6_only_host_is_refused(exported):
    ports = free_ports(3)
    serve_error_line(_serve(exported, "--host", "::1", "--http-port", str(ports[0]), "--grpc-port", str(ports[1]),
                            "--metrics-port", str(ports[2])), 2, "--host ::1 has no IPv4 address")


def test_a_host_name_is_served_on_its_address(exported, tmp_path):
    """Triton's HTTP endpoint given a name listens on 255.255.255.255 and is never ready: it gets the address."""
    server = Server(exported, tmp_path / "server.log", "--host", "localhost")
    try:
        printed = "".join(server.lines)
        assert f"http://127.0.0.1:{server.http}" in printed and f"grpc://127.0.0.1:{server.grpc}" in printed
        assert urllib.request.urlopen(f"http://127.0.0.1:{server.http}/v2/health/ready", timeout=10).status == 200
    finally:
        assert server.stop() == 0
