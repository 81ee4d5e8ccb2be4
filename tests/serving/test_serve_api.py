"""`seq2trt.serve`: the same Triton server as `seq2trt serve`, started from Python and returned ready; its answers
are `seq2trt translate`'s, it drains and stops at the block's end (exit 0, port free again), and bad settings are
refused before anything starts."""

from __future__ import annotations

import socket

import pytest

import seq2trt

from .conftest import free_ports, generate_inputs, translate_ids

SOURCES = [[4, 5, 6, 2], [3, 2], [7, 8, 9, 10, 11, 3, 4, 2]]


def test_serve_from_python_answers_as_translate_and_drains(exported, tmp_path):
    import tritonclient.http as http

    http_port, grpc_port, metrics_port = free_ports(3)
    with seq2trt.serve(exported, "ort-fused", http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                       log=tmp_path / "server.log") as server:
        assert server.models == ["generate", "translate"]
        assert server.endpoints["http"] == f"http://127.0.0.1:{http_port}"
        c = http.InferenceServerClient(f"127.0.0.1:{http_port}", network_timeout=120)
        assert c.is_server_ready() and c.is_model_ready("generate")
        got = [c.infer("generate", generate_inputs(s, beam_size=2)).as_numpy("output_ids")[0].tolist()
               for s in SOURCES]
        c.close()  # an open keep-alive connection holds Triton's drain until its exit timeout
    assert got == translate_ids(exported, SOURCES, "--beam-size", "2")
    assert server.stop() == 0 == server.code  # drained at the block's end; stop() again returns the same code
    with socket.socket() as s:  # nobody listens there any more (SO_REUSEADDR: the closed connections' TIME_WAIT)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", http_port))


def test_bad_settings_are_refused_before_anything_starts(exported, tmp_path):
    with pytest.raises(seq2trt.InputError, match="threads must be >= 1, got 0"):
        seq2trt.serve(exported, threads=0)
    with pytest.raises(seq2trt.InputError, match="unknown"):
        seq2trt.serve(exported, backend="nope")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(seq2trt.InputError, match=str(busy.getsockname()[1])):
            seq2trt.serve(exported, http_port=busy.getsockname()[1], grpc_port=free_ports(1)[0],
                          metrics_port=free_ports(1)[0])
