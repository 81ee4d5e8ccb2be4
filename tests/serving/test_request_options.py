"""`seq2trt serve`'s per-request search options (`decode_service.REQUEST_OPTIONS`): each request gets what the
`translate` flags of the same meaning give (translate is the reference), requests are grouped by their options, a
bad option is that request's own error naming the parameter, seeded sampling does not depend on the batch, n-best
and scores come back; one end-to-end pass through the real server."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers.cli import invoke
from seq2trt.reference_model.decoding import Hypothesis
from seq2trt.core.errors import InputError
from seq2trt.serving import decode_service
from seq2trt.serving.decode_service import DecodeService, Job, option_value

from .conftest import MAX_BATCH, translate_ids

SOURCES = [[4, 5, 6, 2], [3, 2], [7, 8, 9, 10, 11, 3, 4, 2], [12, 12, 5, 2], [6] * 20 + [2], [9, 3, 2]]
SAMPLE = dict(do_sample=True, temperature=1.5, top_k=0)  # a hot, untruncated distribution: samples vary


@pytest.fixture(scope="module")
def service(exported):
    s = DecodeService(exported, "ort-fused")
    yield s
    s.close()


def _plain(out):
    return [h.tokens for h in out] if out and isinstance(out[0], Hypothesis) else out


def test_seeded_sampling_is_translate_whatever_the_batch(exported, service, monkeypatch):
    seeds = [11, 11, 11, 12, 12, 13]  # requests alike but for their sources still decode alone
    want = [translate_ids(exported, [s], "--sample", "--seed", str(seed), "--temperature", "1.5", "--top-k", "0")[0]
            for s, seed in zip(SOURCES, seeds)]
    greedy = translate_ids(exported, SOURCES)
    assert want != greedy, "sampling gave the greedy outputs: the test could not tell them apart"
    seeded = [Job(tuple(s), options=dict(SAMPLE, seed=seed)) for s, seed in zip(SOURCES, seeds)]
    calls = []
    real = decode_service.decode_batches
    monkeypatch.setattr(decode_service, "decode_batches",
                        lambda model, sources, *a: calls.append(len(sources)) or real(model, sources, *a))
    # mixed with greedy and unseeded sampling requests, then alone and in reverse order: the same samples
    mixed = [Job(tuple(s)) for s in SOURCES] + seeded + [Job(tuple(s), options=SAMPLE) for s in SOURCES]
    got = service.run(mixed)
    assert got[:6] == greedy and got[6:12] == want
    assert sorted(calls) == [1] * 6 + [6, 6]  # each seeded request alone; greedy and unseeded sampling batched
    assert service.run(seeded[::-1]) == want[::-1]
    assert service.run(seeded[2:3]) == want[2:3]
    other = service.run([Job(tuple(s), options=dict(SAMPLE, seed=seed + 100)) for s, seed in zip(SOURCES, seeds)])
    assert other != want  # the seed is what the samples follow


@pytest.mark.parametrize("job, flags", [
    (dict(beam_size=4, options=dict(num_return_sequences=3, output_scores=True)),
     ["--beam-size", "4", "--n-best", "3", "--scores"]),
    (dict(options=dict(output_scores=True)), ["--scores"]),
    (dict(options=dict(no_repeat_ngram_size=1)), ["--no-repeat-ngram-size", "1"]),
    (dict(beam_size=2, options=dict(repetition_penalty=3.0)), ["--beam-size", "2", "--repetition-penalty", "3.0"]),
    (dict(max_new_tokens=12, options=dict(min_new_tokens=10)), ["--max-new-tokens", "12", "--min-new-tokens", "10"]),
    (dict(options=dict(do_sample=True, seed=3, num_return_sequences=4, output_scores=True, top_p=0.9)),
     ["--sample", "--seed", "3", "--n-best", "4", "--scores", "--top-p", "0.9"]),
    (dict(beam_size=3, options=dict(num_return_sequences=2, output_token_logprobs=True)),
     ["--beam-size", "3", "--n-best", "2", "--token-logprobs"]),
], ids=["beam-n-best-scores", "greedy-scores", "no-repeat", "repetition-penalty", "min-new-tokens", "sample-n-best",
        "token-logprobs"])
def test_each_option_is_translates_flag_in_a_mixed_batch(exported, service, monkeypatch, job, flags):
    sources = SOURCES if "--seed" not in flags else SOURCES[:1]  # translate samples its sources in one stream
    want = translate_ids(exported, sources, *flags)
    seen = []
    real = decode_service.decode_batches
    monkeypatch.setattr(decode_service, "decode_batches",
                        lambda model, srcs, pad, decode, settings, rows: seen.append(settings) or
                        real(model, srcs, pad, decode, settings, rows))
    got = service.run([Job(tuple(s)) for s in SOURCES] + [Job(tuple(s), **job) for s in sources])
    assert len(seen) == 2 and all(getattr(seen[1], k) == v for k, v in job["options"].items())  # two groups
    assert got[:len(SOURCES)] == translate_ids(exported, SOURCES)  # the others keep the model's settings
    got = got[len(SOURCES):]
    if isinstance(want[0], dict):  # n-best or scores: translate's JSON lines
        assert all(isinstance(h, Hypothesis) for out in got for h in out)
        assert [[h.tokens for h in out] for out in got] == [w["ids"] for w in want]
        assert [[h.score for h in out] for out in got] == [pytest.approx(w["scores"], rel=1e-6) for w in want]
        if "token_logprobs" in want[0]:
            assert [[list(h.token_logprobs) for h in out] for out in got] == [
                [pytest.approx(lp, rel=1e-6) for lp in w["token_logprobs"]] for w in want]
        if len(want[0]["ids"]) > 1:
            assert any(len({json.dumps(t) for t in w["ids"]}) > 1 for w in want)
    else:
        assert got == want
        plain = translate_ids(exported, sources, *flags[:2] if flags[0] in ("--beam-size", "--max-new-tokens") else ())
        if "--min-new-tokens" not in flags:  # this random model never ends before its limit: the floor is inert
            assert got != plain, f"{flags} changed nothing here: the test could not fail"


@pytest.mark.parametrize("options, beam_size, message", [
    (dict(do_sample=True, temperature=0.0), None, "temperature must be a number > 0 such as 0.7, got 0.0"),
    (dict(do_sample=True, top_p=1.5), None, "top_p must be a number in (0, 1] such as 0.9, got 1.5"),
    (dict(do_sample=True, top_k=-1), None, "top_k must be an integer >= 0"),
    (dict(do_sample=True, seed=-1), None, "seed must be an integer in [0, 2**64), got -1"),
    (dict(temperature=0.5), None, "temperature sets how sampling draws, and this decode does not sample; add sample"),
    (dict(do_sample=True), 4, "beam_size 4 with sampling"),
    (dict(num_return_sequences=3), 2, "n_best 3 is more than the 2 beams searched"),
    (dict(num_return_sequences=0), None, "n_best must be an integer >= 1, got 0"),
    (dict(do_sample=True, num_return_sequences=MAX_BATCH + 1), None, f"n_best with sample must be in [1, {MAX_BATCH}]"),
    (dict(repetition_penalty=0.0), None, "repetition_penalty must be a number > 0"),
    (dict(no_repeat_ngram_size=-1), None, "no_repeat_ngram_size must be an integer >= 0"),
    (dict(min_new_tokens=-2), None, "min_new_tokens must be an integer >= 0"),
])
def test_a_bad_option_is_its_requests_error_naming_the_parameter(exported, service, options, beam_size, message):
    bad = Job(tuple(SOURCES[0]), beam_size=beam_size, options=options)
    got = service.run([Job(tuple(SOURCES[1])), bad, Job(tuple(SOURCES[2]), beam_size=2)])
    assert isinstance(got[1], InputError) and message in str(got[1]), got[1]
    assert "--" not in str(got[1]).split(";")[0], got[1]  # named as the request's parameter, not translate's flag
    assert got[0] == translate_ids(exported, [SOURCES[1]])[0]
    assert got[2] == translate_ids(exported, [SOURCES[2]], "--beam-size", "2")[0]


def test_an_option_sent_by_its_deprecated_input_is_named_so(service):
    """A request that sent do_sample (the served spelling before `sample`) reads its own input in the error."""
    old = dict(spelled={"do_sample": "do_sample"})
    got = service.run([Job(tuple(SOURCES[0]), options=dict(do_sample=True, num_return_sequences=MAX_BATCH + 1), **old),
                       Job(tuple(SOURCES[0]), options=dict(temperature=0.5), **old),
                       Job(tuple(SOURCES[0]), options=dict(temperature=0.5))])
    assert f"n_best with do_sample must be in [1, {MAX_BATCH}]" in str(got[0]), got[0]
    assert str(got[1]).endswith("add do_sample, or drop temperature"), got[1]
    assert str(got[2]).endswith("add sample, or drop temperature"), got[2]


def test_option_values_as_triton_hands_them_over():
    assert option_value(np.array([[0.7]], np.float32), "temperature") == 0.7  # not 0.699999988
    assert option_value(np.array([[True]]), "do_sample") is True
    assert option_value(np.array([[2 ** 40]], np.int64), "seed") == 2 ** 40
    assert option_value(None, "seed") is None
    with pytest.raises(InputError, match="top_k must hold one value per request"):
        option_value(np.array([[1, 2]], np.int32), "top_k")


def test_the_served_models_declare_every_option_optional():
    from seq2trt.serving.model_config import request_inputs, request_outputs

    for kind in ("generate", "translate"):
        declared = "\n".join(request_inputs(kind))
        for name in decode_service.REQUEST_OPTIONS:
            block = declared.split(f'name: "{name}"')[1].split("}")[0]
            assert "optional: true" in block, (kind, name)
        assert 'name: "hypotheses"' in "\n".join(request_outputs(kind))


def _input(name, value, datatype):
    import tritonclient.http as http

    array = np.array([[value]], dtype={"INT32": np.int32, "INT64": np.int64, "FP32": np.float32, "BOOL": np.bool_,
                                       "BYTES": np.object_}[datatype])
    tensor = http.InferInput(name, [1, 1], datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def test_served_requests_take_the_options(served):
    import tritonclient.http as http

    out, server = served
    c = http.InferenceServerClient(server.url, network_timeout=120)
    try:
        _served_requests(c, out)
    finally:
        c.close()  # an open connection would hold the server's drain at the end


def _served_requests(c, out):
    from tritonclient.utils import InferenceServerException

    from .conftest import generate_inputs, text_inputs

    source = SOURCES[2]
    sampled = [_input("sample", True, "BOOL"), _input("seed", 5, "INT64"), _input("temperature", 0.7, "FP32"),
               _input("n_best", 2, "INT32"), _input("output_scores", True, "BOOL")]
    answer = c.infer("generate", generate_inputs(source) + sampled)
    want = translate_ids(out, [source], "--sample", "--seed", "5", "--temperature", "0.7", "--n-best", "2",
                         "--scores")[0]
    hypotheses = json.loads(answer.as_numpy("hypotheses")[0, 0])
    assert hypotheses["ids"] == want["ids"] and answer.as_numpy("output_ids")[0].tolist() == want["ids"][0]
    assert hypotheses["scores"] == pytest.approx(want["scores"], rel=1e-6)
    assert answer.as_numpy("scores")[0].tolist() == pytest.approx(want["scores"], rel=1e-5)
    plain = c.infer("generate", generate_inputs(source))  # without options: as before, no n-best outputs
    assert plain.as_numpy("output_ids")[0].tolist() == translate_ids(out, [source])[0]
    assert plain.as_numpy("hypotheses") is None
    beams = c.infer("translate", text_inputs("40213") + [_input("beam_size", 3, "INT32"), _input("n_best", 3, "INT32")])
    texts = json.loads(beams.as_numpy("hypotheses")[0, 0])["text"]
    result = invoke("translate", out, "40213", "--backend", "ort-fused", "--beam-size", "3", "--n-best", "3")
    assert result.exit_code == 0, result.output
    assert texts == result.output.splitlines() and texts[0] == beams.as_numpy("text")[0, 0].decode()
    with pytest.raises(InferenceServerException, match=r"top_p must be a number in \(0, 1\]"):
        c.infer("generate", generate_inputs(source) + [_input("do_sample", True, "BOOL"), _input("top_p", 2.0, "FP32")])
    assert c.infer("generate", generate_inputs(source)).as_numpy("output_ids")[0].tolist() == \
        plain.as_numpy("output_ids")[0].tolist()  # and the server goes on


@pytest.mark.parametrize("temperature", [1e-45, 1e-39], ids=["least-fp32", "subnormal"])
def test_a_subnormal_temperature_is_refused_naming_the_input(exported, service, temperature):
    """Issue 49 item 6: a subnormal temperature passes "> 0" and samples garbage (the logits over it overflow) where
    transformers refuses it; a served request must be refused as translate's --temperature is (decode_settings)."""
    value = float(str(np.float32(temperature)))  # what the FP32 request input reads as
    result = service.run([Job(tuple(SOURCES[0]), options=dict(do_sample=True, temperature=value)),
                          Job(tuple(SOURCES[0]))])
    assert isinstance(result[0], InputError) and "temperature" in str(result[0]), result[0]
    assert result[1] == translate_ids(exported, SOURCES[:1])[0]  # the batch's other request is answered
