"""`seq2trt serve`'s start-up failures name their cause: what can be checked before the server starts (the backend's
graphs, a GPU for TensorRT) is, and a server that fails anyway is quoted from its own log."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from helpers.cli import invoke

from .conftest import free_ports, serve_error_line


def _serve(*args: str) -> subprocess.CompletedProcess:
    http, grpc, metrics = free_ports(3)
    return subprocess.run([sys.executable, "-m", "seq2trt.cli.main", "serve", *args, "--http-port", str(http),
                           "--grpc-port", str(grpc), "--metrics-port", str(metrics)],
                          capture_output=True, text=True, timeout=120)


def test_missing_int8_graphs_are_named_before_the_start(exported):
    line = serve_error_line(_serve(str(exported), "--backend", "ort-int8"), 2, "quantization.json not found",
                            f"seq2trt quantize {exported}")
    assert "tritonserver" not in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("backend", ["tensorrt", "tensorrt-rtx"])
def test_tensorrt_without_a_gpu_is_named_before_the_start(exported, backend):
    serve_error_line(_serve(str(exported), "--backend", backend), 2, "NVIDIA GPU", "use --backend ort")


def test_a_server_that_fails_is_quoted_from_its_log(exported, tmp_path):
    model = tmp_path / "repo" / "generate"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text("name: 'generate' backend: python {\n")
    line = serve_error_line(_serve(str(exported), "--repository", str(tmp_path / "repo")), 1,
                            "tritonserver exited with code 1 before it was ready: ",
                            f"failed to read text proto from {model / 'config.pbtxt'}", "pass --log FILE")
    assert "CudaDriverHelper" not in line  # the notice every start without a GPU logs is no cause
    log = tmp_path / "server.log"
    log.write_text("an earlier run's lines\nE1202 01:00:00.000000 1 server.cc:1] \"an old error\"\n")
    line = serve_error_line(_serve(str(exported), "--repository", str(tmp_path / "repo"), "--log", str(log)), 1,
                            "failed to read text proto", f"its whole log is in {log}")
    assert "an old error" not in line  # only what this run wrote


def test_a_model_that_fails_to_load_is_quoted_without_its_frames(exported, tmp_path):
    line = serve_error_line(_serve(str(exported), "--backend", "eager", "--checkpoint", str(tmp_path / "gone")), 1,
                            "before it was ready: ", f"CheckpointError: checkpoint {tmp_path / 'gone'} not found")
    assert "At:" not in line and ".py(" not in line


@pytest.mark.parametrize("flag, value, least", [("--threads", "0", 1), ("--instances", "-2", 1),
                                                ("--max-batch", "0", 1), ("--max-queue-delay-us", "-1", 0)])
def test_a_setting_out_of_range_is_named_with_its_value(exported, flag, value, least):
    result = invoke("serve", exported, flag, value)
    assert result.exit_code == 2 and result.output.strip() == f"error: {flag} must be >= {least}, got {value}", \
        result.output


def test_a_log_that_cannot_be_written_is_named_before_the_start(exported, tmp_path):
    serve_error_line(_serve(str(exported), "--log", str(tmp_path)), 2,
                     f"cannot write the server log --log {tmp_path}", "Is a directory")
    assert list(tmp_path.iterdir()) == []


def test_a_repository_without_models_is_refused(exported, tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    serve_error_line(_serve(str(exported), "--repository", str(tmp_path)), 2, f"--repository {tmp_path} holds no model")


@pytest.mark.parametrize("args, fragments", [
    (["--length-penalty", "nan"], ["--length-penalty must be a number, got nan"]),
    (["--max-batch", "1000"], ["--max-batch 1000 is above the export's max_batch 16", "re-export"]),
    (["--threads", "100000"], ["--threads must be in [1, ", "got 100000"]),
    (["--max-request-mb", "0"], ["--max-request-mb must be a number > 0, got 0"]),
], ids=["length-penalty-nan", "max-batch-over-export", "threads", "max-request-mb"])
def test_every_flag_is_checked_before_triton_starts(exported, tmp_path, args, fragments):
    """Refused with one error line and exit 2 before tritonserver starts (its log stays empty)."""
    log = tmp_path / "server.log"
    serve_error_line(_serve(str(exported), *args, "--log", str(log)), 2, *fragments)
    assert not log.exists() or log.read_text() == ""
