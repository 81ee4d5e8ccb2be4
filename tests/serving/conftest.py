"""A tiny trained-by-nobody export (numbers task vocabularies, so `translate` has text) served by the real Triton
server on free loopback ports, once for the folder; helpers to start more servers and to call them."""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from helpers.artifacts import checkpoint_and_export, numbers_model
from helpers.cli import invoke
from helpers.ports import free_ports

HAS_SERVE = all(importlib.util.find_spec(name) is not None for name in ("pytriton", "tritonclient"))


def pytest_collection_modifyitems(config, items):
    if not HAS_SERVE:
        skip = pytest.mark.skip(reason="the serve extra is not installed: pip install 'seq2trt[serve]'")
        for item in items:
            if Path(str(item.fspath)).parent == Path(__file__).parent:
                item.add_marker(skip)

MAX_BATCH, MAX_LEN = 16, 24


class Server:
    """`seq2trt serve` in a subprocess; `stop()` sends SIGTERM and returns the exit code."""

    def __init__(self, out: Path, log: Path, *extra: str, timeout_s: float = 120):
        self.http, self.grpc, self.metrics = free_ports(3)
        command = [sys.executable, "-m", "seq2trt.cli.main", "serve", str(out), "--http-port", str(self.http),
                   "--grpc-port", str(self.grpc), "--metrics-port", str(self.metrics), "--log", str(log), *extra]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        ready = threading.Event()

        def read():
            for line in self.process.stdout:
                self.lines.append(line)
                if line.startswith("ready"):
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(timeout_s) or self.process.poll() is not None:
            self.process.kill()
            raise RuntimeError(f"server did not start: {''.join(self.lines)}\n{log.read_text() if log.exists() else ''}")
        self.url = f"127.0.0.1:{self.http}"

    def stop(self, timeout_s: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout_s)


@pytest.fixture(scope="package")
def exported(make_model, tmp_path_factory) -> Path:
    """The package's export (fused for ONNX Runtime), its checkpoint beside it in ../ckpt: its own, since the
    served model's lengths (MAX_LEN) and batch (MAX_BATCH) are what these tests load and split."""
    model, task = numbers_model(make_model, seed=7, max_src_len=MAX_LEN, max_tgt_len=MAX_LEN)
    return checkpoint_and_export(tmp_path_factory.mktemp("serving"), model, task, max_batch=MAX_BATCH,
                                 fuse=("ort",))[1]


@pytest.fixture(scope="package")
def served(exported):
    """(export dir, a running Server) for the package's tests."""
    server = Server(exported, exported.parent / "server.log", "--max-queue-delay-us", "5000")
    yield exported, server
    assert server.stop() == 0, "".join(server.lines)


def serve_error_line(result: subprocess.CompletedProcess, code: int, *fragments: str) -> str:
    """`seq2trt serve` run as a subprocess stopped before serving: exit `code`, no traceback, no `ready`, exactly one
    `error:` line holding every fragment; returns that line."""
    output = result.stdout + result.stderr
    assert result.returncode == code and "Traceback" not in output and "ready" not in result.stdout, output
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and all(f in lines[0] for f in fragments), output
    return lines[0]


def translate_ids(out: Path, sources: list[list[int]], *args: str) -> list[list[int]]:
    """What `seq2trt translate OUT --backend ort-fused --ids-file` gives for `sources` (the independent reference)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        ids_file, out_file = Path(tmp) / "ids.jsonl", Path(tmp) / "out.jsonl"
        ids_file.write_text("".join(json.dumps(s) + "\n" for s in sources))
        result = invoke("translate", out, "--backend", "ort-fused", "--ids-file", ids_file, "--output-ids", out_file,
                        *args)
        assert result.exit_code == 0, result.output
        return [json.loads(line) for line in out_file.read_text().splitlines()]


def generate_inputs(ids, max_new_tokens: int | None = None, beam_size: int | None = None, dtype=np.int64):
    import tritonclient.http as http

    array = np.asarray([ids], dtype=dtype)
    inputs = [http.InferInput("input_ids", list(array.shape), http.np_to_triton_dtype(array.dtype))]
    inputs[0].set_data_from_numpy(array)
    for name, value in (("max_new_tokens", max_new_tokens), ("beam_size", beam_size)):
        if value is not None:
            inputs.append(http.InferInput(name, [1, 1], "INT32"))
            inputs[-1].set_data_from_numpy(np.array([[value]], dtype=np.int32))
    return inputs


def text_inputs(text, **langs):
    import tritonclient.http as http

    inputs = []
    for name, value in (("text", text), *langs.items()):
        inputs.append(http.InferInput(name, [1, 1], "BYTES"))
        inputs[-1].set_data_from_numpy(np.array([[value]], dtype=np.object_))
    return inputs


WHISPER_MAX_BATCH = 8


@pytest.fixture(scope="package")
def whisper_exported(whisper_imported, tmp_path_factory) -> Path:
    """The speech tests' Whisper (tests/conftest.py's whisper_imported, as tests/cli/test_transcribe.py's model)
    exported (max_batch WHISPER_MAX_BATCH) and fused for ONNX Runtime by `seq2trt export` and `seq2trt fuse`."""
    _, ckpt = whisper_imported
    root = tmp_path_factory.mktemp("whisper")
    for args in (("export", ckpt, "-o", root / "out", "--max-batch", WHISPER_MAX_BATCH),
                 ("fuse", root / "out", "--target", "ort")):
        result = invoke(*args)
        assert result.exit_code == 0, result.output
    return root / "out"


@pytest.fixture(scope="package")
def whisper_served(whisper_exported):
    """(Whisper export dir, a running Server of it) for the package's tests."""
    server = Server(whisper_exported, whisper_exported.parent / "server.log", "--max-queue-delay-us", "20000")
    yield whisper_exported, server
    assert server.stop() == 0, "".join(server.lines)
