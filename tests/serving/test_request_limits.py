"""What `seq2trt serve` takes over HTTP (its front, serving.http_guard, before the bundled tritonserver 2.51): the
requests that killed that server (a JSON body nested deep: SIGSEGV; a shape claiming more values than it sends:
SIGABRT) and the ones it answered 500 (malformed JSON, data of the wrong JSON type, a negative dimension) are each a
4xx with a one-line reason, the server alive and answering after every one; long, odd and concurrent transcribe
requests (the issue's 40 s of JSON samples among them) get what `seq2trt transcribe` gives. Both package servers are
used (no server of its own)."""

from __future__ import annotations

import gzip
import http.client
import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from helpers.audio import synthetic

from .conftest import translate_ids

GOOD = {"inputs": [{"name": "input_ids", "shape": [1, 4], "datatype": "INT64", "data": [4, 5, 6, 2]}]}


def post(server, model: str, body: bytes, headers: dict | None = None, timeout: float = 300) -> tuple[int, dict]:
    """(HTTP status, the JSON answer) of a raw POST to the model's infer endpoint."""
    connection = http.client.HTTPConnection("127.0.0.1", server.http, timeout=timeout)
    try:
        connection.request("POST", f"/v2/models/{model}/infer", body=body,
                           headers={"Content-Type": "application/json", **(headers or {})})
        answer = connection.getresponse()
        return answer.status, json.loads(answer.read() or b"{}")
    finally:
        connection.close()


def _inputs(*tensors) -> bytes:
    return json.dumps({"inputs": [dict(zip(("name", "shape", "datatype", "data"), t)) for t in tensors]}).encode()


_BINARY_HEAD = json.dumps({"inputs": [{"name": "input_ids", "shape": [1, 1000000], "datatype": "INT64",
                                       "parameters": {"binary_data_size": 16}}]}).encode()
BAD_BODIES = {  # what was sent -> (status, a fragment of the reason)
    "nested 200000 deep (SIGSEGV before)": (b"[" * 200000 + b"]" * 200000, 400, "nests deeper than"),
    "data nested deep": (b'{"inputs":[{"name":"input_ids","shape":[1,1],"datatype":"INT64","data":'
                         + b"[" * 5000 + b"4" + b"]" * 5000 + b"}]}", 400, "nests deeper than"),
    "shape of 2**40 values (SIGABRT before)": (_inputs(("input_ids", [1, 2 ** 40], "INT64", [4])), 413,
                                               "more than a request may carry"),
    "negative dimension (500 before)": (_inputs(("input_ids", [1, -5], "INT64", [4])), 400, "shape must be"),
    "malformed JSON (500 before)": (b"{not json", 400, "is not valid JSON"),
    "NaN in JSON": (b'{"inputs":[{"name":"input_ids","shape":[1,1],"datatype":"INT64","data":[NaN]}]}', 400,
                    "holds NaN"),
    "strings as INT64 (500 before)": (_inputs(("input_ids", [1, 2], "INT64", ["a", "b"])), 400,
                                      "its data must be whole numbers"),
    "too few values for the shape": (_inputs(("input_ids", [1, 5], "INT64", [4, 2])), 400, "its data 2"),
    "unknown datatype": (_inputs(("input_ids", [1, 1], "INT128", [4])), 400, "has datatype 'INT128'"),
    "unknown input": (_inputs(("input_ids", [1, 1], "INT64", [4]), ("beams", [1, 1], "INT32", [2])), 400,
                      "unknown input 'beams'"),
    "not an object": (b"[1, 2]", 400, 'whose "inputs" lists the tensors'),
    "not UTF-8": (b'{"inputs": "\xff"}', 400, "not UTF-8"),
    "an input sent as a request parameter (ignored before)": (json.dumps({**GOOD, "parameters": {"num_beams": 4}})
                                                              .encode(), 400, "num_beams is an input of this model"),
    "data a scalar, not a list (500 before)": (json.dumps({"inputs": [{**GOOD["inputs"][0], "shape": [1, 1],
                                                                        "data": 4}]}).encode(), 400,
                                                "data must be a list"),
    "int64 out of range": (_inputs(("input_ids", [1, 1], "INT64", [2 ** 70])), 400, "whole numbers in"),
}


def test_requests_that_killed_or_500d_the_server_are_4xx_and_it_goes_on(served):
    out, server = served
    want = translate_ids(out, [GOOD["inputs"][0]["data"]])[0]
    for what, (body, status, fragment) in BAD_BODIES.items():
        got, answer = post(server, "generate", body)
        assert (got, server.process.poll()) == (status, None), (what, got, answer)
        assert fragment in answer["error"] and "\n" not in answer["error"], (what, answer)
        ok, answer = post(server, "generate", json.dumps(GOOD).encode())  # the server goes on
        assert ok == 200 and answer["outputs"][0]["data"] == want, (what, answer)


def test_headers_and_encodings_are_checked(served):
    out, server = served
    cases = [
        (_BINARY_HEAD + bytes(16), {"Inference-Header-Content-Length": str(len(_BINARY_HEAD))}, 400,
         "takes 8000000 bytes, its binary part has 16"),
        (b'{"inputs":[]}', {"Inference-Header-Content-Length": "99999999999999"}, 400,
         "Inference-Header-Content-Length must be"),
        (b"\x1f\x8b" + bytes(30), {"Content-Encoding": "gzip"}, 400, "not valid gzip data"),
        (gzip.compress(b" " * (65 << 20)), {"Content-Encoding": "gzip"}, 413, "inflates past"),
        (b"{}", {"Content-Encoding": "br"}, 400, "Content-Encoding 'br' is not offered"),
    ]
    for body, headers, status, fragment in cases:
        got, answer = post(server, "generate", body, headers)
        assert (got, server.process.poll()) == (status, None) and fragment in answer["error"], (headers, answer)
    # a compressed request that passes is forwarded whole, and answered
    got, answer = post(server, "generate", gzip.compress(json.dumps(GOOD).encode()), {"Content-Encoding": "gzip"})
    assert got == 200 and answer["outputs"][0]["data"] == translate_ids(out, [[4, 5, 6, 2]])[0]


def test_a_body_over_the_limit_is_refused_before_it_is_read(served):
    _, server = served
    connection = http.client.HTTPConnection("127.0.0.1", server.http, timeout=60)
    try:  # only the headers are sent: the answer cannot wait for 2 GiB
        connection.putrequest("POST", "/v2/models/generate/infer")
        connection.putheader("Content-Length", str(2 << 30))
        connection.endheaders()
        answer = connection.getresponse()
        assert answer.status == 413 and "more than a request may carry" in json.loads(answer.read())["error"]
    finally:
        connection.close()
    assert server.process.poll() is None


def _samples_request(clip: np.ndarray, rate: int, **extra) -> bytes:
    tensors = [("samples", [1, len(clip)], "FP32", [round(float(v), 5) for v in clip]),
               ("sampling_rate", [1, 1], "INT32", [rate]), ("max_new_tokens", [1, 1], "INT32", [6])]
    tensors += [(name, [1, 1], dtype, [value]) for name, (dtype, value) in extra.items()]
    return _inputs(*tensors)


def test_long_odd_and_concurrent_transcribe_requests(whisper_served):
    """The issue's request (about 40 s of raw samples as a JSON body, 5 MB) and 45 s, sent at once with short,
    silent, 8 kHz and odd ones: each long or ordinary one gets what runtime.transcription gives for its clip, each
    odd one its 4xx, and the server stays up."""
    from seq2trt.reference_model.audio import prepare_audio
    from seq2trt.runtime.transcription import open_transcriber

    out, server = whisper_served
    rng = np.random.RandomState(5)
    clips = {"40 s": (np.round(0.1 * rng.randn(40 * 16000), 5).astype(np.float32), 16000),
             "45 s": (np.round(synthetic("tone", seconds=45.0) + 0.05 * rng.randn(45 * 16000), 5).astype(np.float32),
                      16000),
             "1 s at 8 kHz": (np.round(synthetic("tone", rate=8000, seconds=1.0), 5), 8000),
             "silence": (synthetic("silence", seconds=0.5), 16000)}
    odd = {"negative rate": (_samples_request(synthetic("tone"), -8000), 400, "sampling_rate must be a positive"),
           "zero samples": (_inputs(("samples", [1, 0], "FP32", []), ("sampling_rate", [1, 1], "INT32", [16000])),
                            400, "holds no samples"),
           "two rows": (_inputs(("samples", [2, 2], "FP32", [0.1, 0.2, 0.3, 0.4]),
                                ("sampling_rate", [2, 1], "INT32", [16000, 16000])), 400, "one value per request")}
    bodies = {name: _samples_request(clip, rate) for name, (clip, rate) in clips.items()}
    assert len(bodies["40 s"]) > 4 << 20  # the body size (5.4 MB)
    jobs = [(name, body) for name, body in bodies.items()] + [(name, body) for name, (body, _, _) in odd.items()]
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = dict(zip([n for n, _ in jobs], pool.map(lambda job: post(whisper_served[1], "transcribe", job[1]),
                                                          jobs)))
    assert server.process.poll() is None
    with open_transcriber(out, "ort-fused") as reference:
        for name, (clip, rate) in clips.items():
            status, answer = answers[name]
            assert status == 200, (name, answer)
            got = {o["name"]: o["data"] for o in answer["outputs"]}
            want = next(reference.transcribe([prepare_audio(np.asarray(clip, np.float32), rate)], max_new_tokens=6))
            assert got["tokens"] == want.tokens and got["language"] == [want.language], name
            segments = json.loads(got["segments"][0])
            assert [s["tokens"] for s in segments] == [s.tokens for s in want.segments], name
            if name in ("40 s", "45 s"):  # long-form: every window's audio decoded, none dropped
                assert segments[-1]["end"] == pytest.approx(float(name.split()[0]), abs=1e-3), (name, segments)
    for name, (_, status, fragment) in odd.items():
        got, answer = answers[name]
        assert got == status and fragment in answer.get("error", ""), (name, got, answer)
