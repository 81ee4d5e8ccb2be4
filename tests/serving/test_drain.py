"""SIGTERM drains `seq2trt serve`: requests already sent are answered (and right), later ones are refused, exit 0."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from .conftest import Server, generate_inputs, translate_ids

SOURCE = [4, 5, 6, 7, 8, 9, 2]


def test_sigterm_answers_requests_in_flight_then_exits_0(served, tmp_path):
    import tritonclient.http as http

    out, _ = served
    want = translate_ids(out, [SOURCE], "--beam-size", "4")[0]
    server = Server(out, tmp_path / "server.log", "--max-batch", "2", "--max-queue-delay-us", "0")
    sent, results = threading.Event(), []

    def call(_):
        c = http.InferenceServerClient(server.url, network_timeout=60)
        sent.set()
        try:
            results.append(c.infer("generate", generate_inputs(SOURCE, beam_size=4)).as_numpy("output_ids")[0].tolist())
        except Exception as exc:  # noqa: BLE001 - recorded and checked below
            results.append(exc)

    with ThreadPoolExecutor(24) as pool:
        futures = [pool.submit(call, n) for n in range(24)]
        sent.wait(10)
        time.sleep(0.3)  # every request is in the server's queue: two run at a time, the others wait
        assert server.process.poll() is None
        code = server.stop()
        for f in futures:
            f.result()
    assert code == 0, "".join(server.lines)
    assert "drained and stopped" in "".join(server.lines)
    assert results == [want] * 24, [r for r in results if r != want][:3]
    refused = http.InferenceServerClient(server.url, network_timeout=5)
    try:
        refused.infer("generate", generate_inputs(SOURCE))
        raise AssertionError("a request after the drain was answered")
    except Exception as exc:  # noqa: BLE001 - connection refused once the server has exited
        assert "refused" in str(exc).lower() or "connect" in str(exc).lower(), exc
