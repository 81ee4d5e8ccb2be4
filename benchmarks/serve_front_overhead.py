"""What serve's HTTP front (serving.http_guard) adds to a request: the same requests sent, interleaved, to the front
and to Triton's private HTTP port of one `seq2trt serve` (the numbers-task model of the tests, greedy, 4 source ids;
and a transcribe request of 10 s of samples, as a JSON body and in the binary tensor extension, when --speech EXPORT
is given).

    python benchmarks/serve_front_overhead.py EXPORT [--speech WHISPER_EXPORT] [--n 200]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time
import http.client
from pathlib import Path


def _free() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _latencies(port_a: int, port_b: int, model: str, body: bytes, n: int,
               headers: dict) -> tuple[list[float], list[float]]:
    times = {port_a: [], port_b: []}
    connections = {p: http.client.HTTPConnection("127.0.0.1", p, timeout=300) for p in times}
    for i in range(n):
        for port in (port_a, port_b) if i % 2 else (port_b, port_a):
            start = time.perf_counter()
            connections[port].request("POST", f"/v2/models/{model}/infer", body=body,
                                      headers={"Content-Type": "application/json", **headers})
            answer = connections[port].getresponse()
            answer.read()
            assert answer.status == 200
            times[port].append(time.perf_counter() - start)
    return times[port_a], times[port_b]


def measure(out: Path, model: str, body: bytes, n: int, headers: dict | None = None, what: str = "JSON") -> None:
    import seq2trt

    with seq2trt.serve(out, "ort", http_port=_free(), grpc_port=_free(), metrics_port=_free()) as server:
        front = int(server.endpoints["http"].rsplit(":", 1)[1])
        private = int(server._launched.upstream.rsplit(":", 1)[1])
        via, direct = _latencies(front, private, model, body, n, headers or {})
    med_via, med_direct = statistics.median(via) * 1e3, statistics.median(direct) * 1e3
    print(f"{model}: {len(body)} B {what} body, median {med_direct:.2f} ms direct, {med_via:.2f} ms through the front "
          f"(+{med_via - med_direct:.2f} ms), n={n}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("export", type=Path)
    parser.add_argument("--speech", type=Path)
    parser.add_argument("--n", type=int, default=200)
    args = parser.parse_args()
    generate = {"inputs": [{"name": "input_ids", "shape": [1, 4], "datatype": "INT64", "data": [4, 5, 6, 2]}]}
    measure(args.export, "generate", json.dumps(generate).encode(), args.n)
    if args.speech:
        import numpy as np

        clip = np.round(0.1 * np.random.RandomState(0).randn(160000), 4).tolist()
        speech = {"inputs": [{"name": "samples", "shape": [1, len(clip)], "datatype": "FP32", "data": clip},
                             {"name": "sampling_rate", "shape": [1, 1], "datatype": "INT32", "data": [16000]},
                             {"name": "max_new_tokens", "shape": [1, 1], "datatype": "INT32", "data": [1]}]}
        measure(args.speech, "transcribe", json.dumps(speech).encode(), max(10, args.n // 10))
        samples = np.asarray(clip, np.float32).tobytes()
        speech["inputs"][0] = {"name": "samples", "shape": [1, len(clip)], "datatype": "FP32",
                               "parameters": {"binary_data_size": len(samples)}}
        head = json.dumps(speech).encode()
        measure(args.speech, "transcribe", head + samples, max(10, args.n // 10),
                {"Inference-Header-Content-Length": str(len(head))}, "binary")


if __name__ == "__main__":
    main()
