"""`seq2trt bench` on a Whisper export (validation/bench/speech.py): our step-model backends, transformers'
generate, Optimum's ORTModelForSpeechSeq2Seq and CTranslate2's Whisper on the same features and prompt, exactly N
tokens a clip. A tiny random transformers Whisper, imported through the CLI; no downloads, no speed assertions.

The judge is transformers' own `generate(input_features, language, task)` on the source directory, with
WhisperFeatureExtractor's features of the same clips: the bench's backends must decode its tokens.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra is not installed")
pytest.importorskip("ctranslate2")

from seq2trt.exporters.manifest import verify  # noqa: E402
from seq2trt.reference_model.eager import EagerStepModel  # noqa: E402
from seq2trt.reference_model.checkpoint import load_checkpoint  # noqa: E402
from seq2trt.runtime import registry  # noqa: E402
from seq2trt.validation.bench import speech  # noqa: E402

from helpers.artifacts import import_and_export  # noqa: E402
from helpers.audio import whisper_source  # noqa: E402
from helpers.cli import invoke, invoke_ok, one_error_line  # noqa: E402
from helpers.hf_models import WHISPER_IDS  # noqa: E402

NEW_TOKENS = 6
BACKENDS = "eager,ort,ort-fused,ort-int8,hf,optimum,ct2"
# optimum-onnx pins transformers<4.58: under transformers 5 the bench measures the rest and says why (CI's second
# pass, under 4.57, installs it and measures it).
OPTIMUM_WHY = registry.unavailable(("optimum",)).get("optimum")


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    """A random transformers Whisper (timestamps suppressed: generate re-seeks at any it emits) imported, exported
    (max batch 4, 32 positions), fused for ORT and quantized."""
    root = tmp_path_factory.mktemp("bench_speech")
    src = whisper_source(root / "src", suppress_timestamps=True)
    import_and_export(src, root, "--max-batch", 4, "--max-tgt-len", 32)
    invoke_ok("quantize", root / "out")
    return dict(src=src, root=root, out=root / "out")


def judge_tokens(src, clips, beams: int = 1) -> list[list[int]]:
    """transformers' transcription of `clips` as its users run it, exactly NEW_TOKENS a clip after the prompt."""
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

    fe = WhisperFeatureExtractor.from_pretrained(str(src))
    model = WhisperForConditionalGeneration.from_pretrained(str(src)).eval()
    features = torch.as_tensor(fe(list(clips), sampling_rate=16000, return_tensors="np")["input_features"])
    with torch.inference_mode():
        out = model.generate(input_features=features, language="en", task="transcribe", num_beams=beams,
                             min_new_tokens=NEW_TOKENS, max_new_tokens=NEW_TOKENS, return_dict_in_generate=True)
    return out.sequences[:, 4:].tolist()  # start, <|en|>, <|transcribe|>, <|notimestamps|>


def test_every_backend_decodes_what_transformers_generates(whisper):
    """On the features features.onnx makes of the bench's clips, the bench's eager backend returns transformers' own
    tokens for those clips, greedy and beam 2, and CTranslate2's greedy ones too (its beam search is its own: a
    forced-length beam of 2 differs from Hugging Face's on one clip here, which the bench reports), exactly
    NEW_TOKENS each."""
    from seq2trt.exporters.whisper_features import INPUT, OUTPUT, pad_clips

    import onnxruntime as ort

    clips = [speech.synthetic_clip(seconds, seed) for seconds, seed in ((2.0, 0), (10.0, 1))]
    session = ort.InferenceSession(str(verify(whisper["out"], ["features.onnx"]).path("features.onnx")),
                                   providers=["CPUExecutionProvider"])
    features = session.run([OUTPUT], {INPUT: pad_clips(clips)})[0]
    ids = WHISPER_IDS
    work = speech.Work(ids["sot"], ids["eot"], (ids["languages"]["en"], ids["transcribe"], ids["no_timestamps"]),
                       "en", "transcribe", NEW_TOKENS, 2, 1.0)
    model, _ = load_checkpoint(whisper["root"] / "ckpt")
    generation = json.loads((whisper["root"] / "ckpt" / "generation.json").read_text())
    ours = speech.OursBackend("eager", EagerStepModel(model), model.cfg, generation, 1)
    ct2_dir = whisper["root"] / "ct2"
    from ctranslate2.converters import TransformersConverter

    TransformersConverter(str(whisper["src"])).convert(str(ct2_dir), force=True)
    ct2 = speech.Ct2WhisperBackend("ct2", ct2_dir, 1, "float32")
    for beams in (1, 2):
        want = judge_tokens(whisper["src"], clips, beams)
        assert {len(t) for t in want} == {NEW_TOKENS}
        assert ours.decode(features, work, beams)[1] == want
        got = ct2.decode(features, work, beams)[1]
        assert {len(t) for t in got} == {NEW_TOKENS} and (beams > 1 or got == want)


def test_the_bench_times_every_backend_on_the_tiny_whisper(whisper):
    out = whisper["out"]
    output = invoke_ok("bench", out, "--backends", BACKENDS, "--batch-sizes", "1,2", "--repeats", 2, "--warmup", 0,
                       "--new-tokens", NEW_TOKENS, "--clip-seconds", "2,10")
    doc = json.loads((out / "reports" / "latency.json").read_text())
    assert doc["kind"] == "speech" and doc["settings"]["new_tokens"] == NEW_TOKENS
    assert doc["prompt"]["ids"] == [101, 102, 106, 107]  # start, <|en|>, <|transcribe|>, <|notimestamps|>
    assert doc["not_measured"] == ({"optimum": OPTIMUM_WHY} if OPTIMUM_WHY else {})
    assert (f"not measured: optimum: {OPTIMUM_WHY}" in output) == bool(OPTIMUM_WHY)
    names = [n for n in BACKENDS.split(",") if n != "optimum" or not OPTIMUM_WHY]
    rows = {(r["backend"], r["clip_seconds"], r["batch"]): r for r in doc["rows"]}
    assert set(rows) == {(n, c, b) for n in names for c in (2.0, 10.0) for b in (1, 2)}
    for (name, clip, batch), r in rows.items():
        assert r["repeats"] == 2 and r["tokens_per_s"] > 0 and r["search"] == "greedy"
        assert r["tokens_per_s"] == pytest.approx(batch * NEW_TOKENS / (r["decode_ms_p50"] / 1e3), rel=1e-3)
        assert r["rtf"] == pytest.approx(r["decode_ms_p50"] / 1e3 / (batch * clip), rel=1e-2)
        assert r["rtf_with_front_end"] > r["rtf"]
        assert r["front_end"] == ("extractor" if name in speech.BASELINES else "features.onnx")
        assert (r.get("vs_optimum") is None) == (name == "optimum" or bool(OPTIMUM_WHY))
    for name in (n for n in ("hf", "optimum", "ct2", "ort", "ort-fused") if n in names):  # float32: token for token (no near-tie here)
        assert all(e["identical"] == e["sequences"] == 2 for e in doc["checks"][name]), doc["checks"][name]
    for clip in ("2.0", "10.0"):
        front = doc["front_end"][clip]
        assert front["max_abs_diff_vs_extractor"] < 1e-3  # features.onnx computes the extractor's features
        assert set(front["1"]) == {"1", "2"} and front["1"]["2"]["extractor_ms_per_clip"]["p50"] > 0
    assert "ort-fused" in output and "RTF" in output
    assert "| ort-fused | 10 | 2 | greedy |" in (out / "reports" / "latency.md").read_text()
    invoke_ok("report", out)  # the report shows the speech bench's table, not a "malformed" latency.json
    report = (out / "reports" / "report.md").read_text()
    assert "| ort-fused | 10 | 2 | greedy |" in report and "malformed" not in report


def test_a_beam_bench_runs_beam_search_everywhere(whisper):
    out = whisper["out"]
    invoke_ok("bench", out, "--backends", "eager,ort-fused,hf,ct2", "--batch-sizes", "1,2", "--repeats", 1,
              "--warmup", 0, "--new-tokens", NEW_TOKENS, "--clip-seconds", "10", "--search", "beam", "--beam-size", 2)
    doc = json.loads((out / "reports" / "latency.json").read_text())
    assert {r["beam"] for r in doc["rows"]} == {2} and len(doc["rows"]) == 4 * 2
    for name in ("ort-fused", "hf"):
        assert all(e["beam"] == {"beam": 2, "identical": 2, "sequences": 2} for e in doc["checks"][name])
    assert all(e["beam"]["sequences"] == 2 for e in doc["checks"]["ct2"])  # reported: its beam search is its own


@pytest.mark.parametrize("flags, code, fragments", [
    (("--src-len", 8), 2, ("--src-len does not apply", "--clip-seconds")),
    (("--backends", "eager,nope"), 2, ("unknown backend", "nope")),
    (("--backends", "eager,ort-generate"), 2, ("ort-generate", "cannot bench a Whisper export")),
    (("--clip-seconds", "40"), 2, ("--clip-seconds", "(0, 30]")),
    (("--search", "sample"), 2, ("greedy and beam",)),
    (("--batch-sizes", "4", "--search", "beam", "--beam-size", 2), 2, ("max_batch 4",)),
])
def test_bad_requests_are_one_line(whisper, flags, code, fragments):
    one_error_line(invoke("bench", whisper["out"], "--repeats", 1, "--warmup", 0, *flags), code, *fragments)


def test_a_text_export_refuses_clip_seconds(numbers_export):
    root, _, _ = numbers_export  # read only: the refusal writes nothing
    one_error_line(invoke("bench", root / "out", "--backends", "eager", "--clip-seconds", "10"), 2, "--clip-seconds",
                   "Whisper")


def test_synthetic_clips_are_deterministic_and_of_their_length():
    a, b = speech.synthetic_clip(10.0, 3), speech.synthetic_clip(10.0, 3)
    assert a.dtype == np.float32 and a.shape == (160000,) and np.array_equal(a, b)
    assert not np.array_equal(a, speech.synthetic_clip(10.0, 4)) and 0.01 < np.abs(a).max() <= 1.0


def test_a_peer_that_cannot_convert_is_named_and_the_rest_is_measured(tmp_path, caplog):
    """A Whisper source without tokenizer files (its feature extractor alone): CTranslate2's converter needs a
    tokenizer and ended the bench in a TypeError from WhisperTokenizer. Now one line says ct2 cannot run, and the
    other backends are measured."""
    from transformers import WhisperFeatureExtractor

    from helpers.hf_models import whisper_model_dir

    src = whisper_model_dir(tmp_path / "src", config=dict(suppress_tokens=[1, 2]))
    WhisperFeatureExtractor(feature_size=80).save_pretrained(src)
    import_and_export(src, tmp_path, "--max-batch", 2, "--max-tgt-len", 32, fuse=None)
    with caplog.at_level("WARNING", logger="seq2trt"):
        output = invoke_ok("bench", tmp_path / "out", "--backends", "eager,ort,ct2", "--batch-sizes", "1",
                           "--repeats", 1, "--warmup", 0, "--new-tokens", 4, "--clip-seconds", "2")
    warned = [r.getMessage() for r in caplog.records if "cannot run" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("ct2 cannot run: CTranslate2's converter cannot convert")
    doc = json.loads((tmp_path / "out" / "reports" / "latency.json").read_text())
    assert {r["backend"] for r in doc["rows"]} == {"eager", "ort"}
    assert "tokenizer" in doc["unavailable"]["ct2"] and "Traceback" not in output
