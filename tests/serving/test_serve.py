"""`seq2trt serve` against the real Triton server (loopback, free ports): health, both models answering exactly what
`seq2trt translate` gives, every bad request refused by name while the server stays up, a dropped client, and a
load test whose every response is compared with translate's."""

from __future__ import annotations

import json
import random
import socket
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from helpers.cli import invoke
from helpers.sources import random_sources

from .conftest import MAX_LEN, generate_inputs, text_inputs, translate_ids

SOURCES = [[4, 5, 6, 2], [3, 2], [7, 8, 9, 10, 11, 3, 4, 2], [12, 12, 5, 2], [6] * 20 + [2], [9, 3, 2]]


def client(server, concurrency: int = 1):
    import tritonclient.http as http

    return http.InferenceServerClient(server.url, concurrency=concurrency, network_timeout=120)


def generate(c, ids, **kw) -> list[int]:
    return c.infer("generate", generate_inputs(ids, **kw)).as_numpy("output_ids")[0].tolist()


def test_health_ready_and_endpoints(served):
    _, server = served
    c = client(server)
    assert c.is_server_live() and c.is_server_ready()
    assert c.is_model_ready("generate") and c.is_model_ready("translate")
    printed = "".join(server.lines)
    assert f"http://127.0.0.1:{server.http}" in printed and f"grpc://127.0.0.1:{server.grpc}" in printed
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics}/metrics", timeout=10).read().decode()
    assert "nv_inference_request_success" in metrics


@pytest.mark.parametrize("beam", [1, 4])
def test_generate_is_translate(served, beam):
    out, server = served
    c = client(server)
    want = translate_ids(out, SOURCES, "--beam-size", str(beam))
    assert [generate(c, s, beam_size=beam) for s in SOURCES] == want
    assert len({tuple(w) for w in want}) > 1
    short = translate_ids(out, SOURCES, "--beam-size", str(beam), "--max-new-tokens", "3")
    assert [generate(c, s, beam_size=beam, max_new_tokens=3) for s in SOURCES] == short


def test_translate_text_is_translate(served):
    out, server = served
    texts = ["40213", "7", "999999", "120"]
    result = invoke("translate", out, *texts, "--backend", "ort-fused")
    assert result.exit_code == 0, result.output
    c = client(server)
    got = [c.infer("translate", text_inputs(t)).as_numpy("text")[0, 0].decode() for t in texts]
    assert got == result.output.splitlines()


def _refused(call) -> str:
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as info:
        call()
    return str(info.value)


def test_bad_requests_are_named_and_the_server_stays_up(served):
    out, server = served
    c = client(server)
    cases = {
        "input 'input_ids' is INT64, not INT32": lambda: c.infer("generate", generate_inputs([4, 2], dtype=np.int32)),
        "is empty": lambda: c.infer("generate", generate_inputs([])),
        "outside the source vocabulary": lambda: c.infer("generate", generate_inputs([4, 999, 2])),
        f"over the export's max_src_len {MAX_LEN}": lambda: c.infer("generate", generate_inputs([4] * (MAX_LEN + 1))),
        "max_new_tokens must be an integer in [1, ": lambda: c.infer("generate", generate_inputs([4, 2], max_new_tokens=0)),
        "beam_size must be in [1, ": lambda: c.infer("generate", generate_inputs([4, 2], beam_size=99)),
        "not UTF-8": lambda: c.infer("translate", text_inputs(b"\xff\xfe12")),
        "outside the vocabulary": lambda: c.infer("translate", text_inputs("twelve")),
        "empty source text": lambda: c.infer("translate", text_inputs("  ")),
        "no language codes (a seq2trt vocabulary); drop src_lang/tgt_lang":
            lambda: c.infer("translate", text_inputs("12", tgt_lang="de")),
    }
    for expected, call in cases.items():
        message = _refused(call)
        assert expected in message and "--" not in message, (expected, message)  # request inputs, not flags
        assert generate(c, SOURCES[0]) == translate_ids(out, SOURCES[:1])[0]  # the next request succeeds
    import tritonclient.http as http

    shape = http.InferInput("input_ids", [1, 2, 2], "INT64")
    shape.set_data_from_numpy(np.ones((1, 2, 2), dtype=np.int64))
    assert "shape" in _refused(lambda: c.infer("generate", [shape])).lower()


def test_a_dropped_client_does_not_disturb_others(served):
    out, server = served
    body = json.dumps({"inputs": [{"name": "input_ids", "shape": [1, 4], "datatype": "INT64", "data": SOURCES[0]},
                                  {"name": "num_beams", "shape": [1, 1], "datatype": "INT32", "data": [4]}]}).encode()
    head = (f"POST /v2/models/generate/infer HTTP/1.1\r\nHost: {server.url}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    for _ in range(8):  # send a request and hang up before the answer
        with socket.create_connection(("127.0.0.1", server.http), timeout=10) as s:
            s.sendall(head + body)
    want = translate_ids(out, SOURCES, "--beam-size", "4")
    with ThreadPoolExecutor(8) as pool:  # a client per thread: tritonclient's are not thread-safe
        got = list(pool.map(lambda s: generate(client(server), s, beam_size=4), SOURCES))
    assert got == want


def _stats_batches(server) -> dict[int, int]:
    stats = json.loads(urllib.request.urlopen(f"http://{server.url}/v2/models/generate/stats", timeout=10).read())
    return {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in stats["model_stats"][0]["batch_stats"]}


def test_load_64_clients_every_response_is_translate(served):
    """64 concurrent clients x 20 requests: mixed source lengths, greedy and beam 4, two max_new_tokens."""
    import tritonclient.http as http

    from seq2trt.exporters.manifest import read_manifest

    out, server = served
    sources = random_sources(read_manifest(out).config, 24, seed=0, max_len=MAX_LEN - 1)
    variants = [(1, None), (4, None), (1, 5), (4, 5)]
    want = {}
    for beam, new in variants:
        extra = ["--beam-size", str(beam)] + (["--max-new-tokens", str(new)] if new else [])
        for s, w in zip(sources, translate_ids(out, sources, *extra)):
            want[(tuple(s), beam, new)] = w
    before = _stats_batches(server)

    def one_client(seed: int) -> list[bool]:
        local = random.Random(seed)
        c = http.InferenceServerClient(server.url, network_timeout=120)
        results = []
        for _ in range(20):
            s, (beam, new) = local.choice(sources), local.choice(variants)
            results.append(generate(c, s, beam_size=beam, max_new_tokens=new) == want[(tuple(s), beam, new)])
        c.close()
        return results

    with ThreadPoolExecutor(64) as pool:
        results = [r for rs in pool.map(one_client, range(64)) for r in rs]
    assert len(results) == 64 * 20 and all(results), f"{results.count(False)} of {len(results)} responses differ"
    after = _stats_batches(server)
    batched = {size: after.get(size, 0) - before.get(size, 0) for size in after}
    assert sum(size * n for size, n in batched.items()) == 64 * 20  # every request ran once, none twice
    assert max(size for size, n in batched.items() if n) > 1  # the server did batch


@pytest.mark.parametrize("model, inputs, missing", [
    ("generate", [{"name": "num_beams", "shape": [1, 1], "datatype": "INT32", "data": [2]}], "input_ids"),
    ("translate", [{"name": "tgt_lang", "shape": [1, 1], "datatype": "BYTES", "data": ["de"]}], "text"),
])
def test_a_missing_input_is_a_400_naming_it(served, model, inputs, missing):
    import urllib.error

    out, server = served
    request = urllib.request.Request(f"http://{server.url}/v2/models/{model}/infer",
                                     data=json.dumps({"inputs": inputs}).encode(),
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=60)
    body = info.value.read().decode()
    assert info.value.code == 400, body
    assert f"input '{missing}' is missing" in body and "Traceback" not in body and 'File "' not in body, body
    assert generate(client(server), SOURCES[0]) == translate_ids(out, SOURCES[:1])[0]  # and the server goes on
