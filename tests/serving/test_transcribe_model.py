"""`seq2trt serve` of a Whisper export: the `transcribe` model against the real Triton server (one server for the
file). Judged by `runtime.transcription` (what `seq2trt transcribe --backend ort-fused` gives for the same audio and
options, itself judged against transformers by tests/cli/test_transcribe.py) for requests sent together, so that the
dynamic batcher mixes them: file bytes (WAV, FLAC, OGG) and float samples at other rates, language given and
detected, beam 4, translate, max_new_tokens; one case directly against transformers' `generate`. Each bad request is
refused with its own 400 naming the parameter while the requests batched with it are answered. A Whisper export
offers `transcribe` alone, a text export never offers it.
"""

from __future__ import annotations

import io
import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")

from helpers.audio import generate_tokens, judge_clip, synthetic  # noqa: E402
from seq2trt.reference_model.audio import load_audio, prepare_audio  # noqa: E402
from seq2trt.core.errors import InputError  # noqa: E402

from .conftest import WHISPER_MAX_BATCH  # noqa: E402

MAX_NEW = 10


@pytest.fixture(scope="module")
def audio(speech_files) -> dict[str, Path]:
    """Speech at espeak-ng's 22.05 kHz (WAV), the same as FLAC, a tone at 8 kHz (OGG Vorbis), noise + tone at
    44.1 kHz stereo (FLAC)."""
    return {name: speech_files[name] for name in ("fox", "numbers", "numbers-flac", "tone-ogg", "stereo")}


@pytest.fixture(scope="module")
def reference(whisper_exported):
    """runtime.transcription on the export (the decoding of `seq2trt transcribe --backend ort-fused`)."""
    from seq2trt.runtime.transcription import open_transcriber

    with open_transcriber(whisper_exported, "ort-fused") as transcriber:
        yield transcriber


def client(server):
    import tritonclient.http as http

    return http.InferenceServerClient(server.url, network_timeout=120)


def request_inputs(audio: bytes | None = None, samples: np.ndarray | None = None, **params):
    """A transcribe request's inputs: file bytes or float samples, and scalar parameters (str, bool, int)."""
    import tritonclient.http as http

    arrays = {}
    if audio is not None:
        arrays["audio"] = np.array([[audio]], dtype=np.object_)
    if samples is not None:
        arrays["samples"] = np.asarray(samples)[None]
    for name, value in params.items():
        if isinstance(value, str):
            arrays[name] = np.array([[value.encode()]], dtype=np.object_)
        elif isinstance(value, bool):
            arrays[name] = np.array([[value]], dtype=np.bool_)
        elif isinstance(value, np.ndarray):
            arrays[name] = value
        else:
            arrays[name] = np.array([[value]], dtype=np.int32)
    inputs = []
    for name, array in arrays.items():
        inputs.append(http.InferInput(name, list(array.shape), http.np_to_triton_dtype(array.dtype)))
        inputs[-1].set_data_from_numpy(array)
    return inputs


def transcribe(server, inputs) -> dict:
    """One request through the server (a client of its own: tritonclient's are not thread-safe)."""
    c = client(server)
    try:
        answer = c.infer("transcribe", inputs)
    finally:
        c.close()
    return {"text": answer.as_numpy("text")[0, 0].decode(), "language": answer.as_numpy("language")[0, 0].decode(),
            "tokens": answer.as_numpy("tokens")[0].tolist(),
            "segments": json.loads(answer.as_numpy("segments")[0, 0])}


def expected(reference, clip: np.ndarray, **options) -> dict:
    """What runtime.transcription gives for the clip alone with these transcribe options."""
    t = next(reference.transcribe([clip], **options))
    return {"text": t.text, "language": t.language, "tokens": t.tokens,
            "segments": [{"start": round(s.start, 3), "end": round(s.end, 3), "text": s.text, "tokens": s.tokens}
                         for s in t.segments]}


def batch_sizes(server) -> dict[int, int]:
    stats = json.loads(urllib.request.urlopen(f"http://{server.url}/v2/models/transcribe/stats", timeout=10).read())
    return {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in stats["model_stats"][0]["batch_stats"]}


def test_a_whisper_export_serves_transcribe_alone(whisper_served, exported, tmp_path):
    from seq2trt.serving.decode_service import DecodeService
    from seq2trt.serving.model_config import write_local_repository
    from seq2trt.serving.server import ServeSettings, served_models
    from seq2trt.serving.transcribe_service import TranscribeService

    out, server = whisper_served
    c = client(server)
    try:
        assert c.is_server_ready() and c.is_model_ready("transcribe")
        assert [m["name"] for m in c.get_model_repository_index()] == ["transcribe"]
    finally:
        c.close()
    assert "serving transcribe from" in "".join(server.lines)
    max_batch, text, speech = served_models(ServeSettings(exported))  # the text export: generate and translate
    assert (text, speech) == (True, False)
    assert write_local_repository(tmp_path / "models", ServeSettings(exported), max_batch, text, speech) == \
        ["generate", "translate"]
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["generate", "translate"]
    with pytest.raises(InputError, match="speech model"):
        DecodeService(out, "ort-fused")
    with pytest.raises(InputError, match="is a text model"):
        TranscribeService(exported, "ort-fused")


def test_batched_requests_get_what_transcribe_gives(whisper_served, audio, reference):
    """Requests of every audio form and several option sets, sent at once: each gets what runtime.transcription
    gives for its audio and options alone."""
    out, server = whisper_served
    tone_8k = synthetic("tone", rate=8000, seconds=1.5)
    mix = (synthetic("noise", rate=22050, seconds=1.0, seed=3) + synthetic("tone", rate=22050, seconds=1.0)) / 2
    forms = [(dict(audio=path.read_bytes()), load_audio(path)) for path in audio.values()]
    forms += [(dict(samples=tone_8k, sampling_rate=8000), prepare_audio(tone_8k, 8000)),
              (dict(samples=mix, sampling_rate=22050), prepare_audio(mix, 22050))]
    variants = [dict(), dict(language="de"), dict(beam_size=4), dict(task="translate", language="fr"),
                dict(num_beams=2, language="en")]  # num_beams: the deprecated spelling, still read
    # every form with the model's defaults, each other option set on two forms in turn
    cases = [(form, clip, dict(max_new_tokens=MAX_NEW)) for form, clip in forms]
    cases += [(*forms[(2 * n + k) % len(forms)], dict(variant, max_new_tokens=MAX_NEW if k % 2 else 4))
              for n, variant in enumerate(variants[1:]) for k in range(2)]
    before = batch_sizes(server)
    with ThreadPoolExecutor(len(cases)) as pool:
        got = list(pool.map(lambda case: transcribe(server, request_inputs(**case[0], **case[2])), cases))
    flags = {"beam_size": "beam", "num_beams": "beam"}
    want = [expected(reference, clip, **{flags.get(k, k): v for k, v in options.items()})
            for _, clip, options in cases]
    assert got == want
    assert len({tuple(w["tokens"]) for w in want}) > len(variants)  # the audio and the options move the tokens
    assert {w["language"] for w, (_, _, options) in zip(want, cases) if "language" not in options} - {"en"}
    after = batch_sizes(server)
    batched = {size: after.get(size, 0) - before.get(size, 0) for size in after}
    assert sum(size * n for size, n in batched.items()) == len(cases)
    assert max(size for size, n in batched.items() if n) > 1  # the server did batch


@pytest.mark.parametrize("beams", [1, 4], ids=["greedy", "beam4"])
def test_served_tokens_equal_transformers_generate(whisper_served, whisper_imported, audio, beams):
    from seq2trt.hf_import.proof import load_transformers_model

    out, server = whisper_served
    src, _ = whisper_imported
    hf_model = load_transformers_model(src, speech=True)
    files = [audio["fox"], audio["stereo"]]
    with ThreadPoolExecutor(len(files)) as pool:
        got = list(pool.map(lambda path: transcribe(server, request_inputs(
            audio=path.read_bytes(), beam_size=beams, max_new_tokens=MAX_NEW)), files))
    want, languages = generate_tokens(hf_model, src, [judge_clip(f) for f in files], None, beams, MAX_NEW)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(src))
    assert [g["tokens"] for g in got] == want
    assert [g["language"] for g in got] == languages
    assert [g["text"] for g in got] == [tokenizer.decode(t, skip_special_tokens=True) for t in want]
    duration = sf.info(str(files[0])).duration
    assert got[0]["segments"] == [{"start": 0.0, "end": round(duration, 3), "text": got[0]["text"],
                                   "tokens": got[0]["tokens"]}]


def _wav(samples: np.ndarray, rate: int) -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, samples, rate, format="WAV")
    return buffer.getvalue()


def test_bad_requests_get_their_own_400_and_the_batch_goes_on(whisper_served, audio, reference):
    from tritonclient.utils import InferenceServerException

    out, server = whisper_served
    fox = audio["fox"].read_bytes()
    bad = [
        (dict(audio=b"RIFF" + bytes(range(256)) * 4), "audio is corrupt or in a format libsndfile cannot read"),
        (dict(audio=b""), "audio is empty"),
        (dict(audio=_wav(np.zeros(0, np.float32), 16000)), "audio holds no samples"),
        (dict(audio=fox, language="xx"), "unknown language 'xx'"),
        (dict(audio=fox, task="dance"), "unknown task 'dance'; choose transcribe or translate"),
        (dict(audio=fox, num_beams=99), f"num_beams must be in [1, {WHISPER_MAX_BATCH}]"),
        (dict(audio=fox, max_new_tokens=1000), "max_new_tokens 1000 does not fit"),
        (dict(audio=fox, max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
        (dict(samples=synthetic("tone")), "input 'sampling_rate' is missing"),
        (dict(samples=synthetic("tone"), sampling_rate=0), "sampling_rate must be a positive whole number"),
        (dict(samples=np.full(800, np.nan, np.float32), sampling_rate=16000), "NaN or infinite"),
        (dict(audio=fox, samples=synthetic("tone"), sampling_rate=16000), "give one"),
        (dict(language="en"), "input 'audio' is missing"),
    ]
    good = [(dict(audio=fox), load_audio(audio["fox"])),
            (dict(samples=synthetic("tone"), sampling_rate=16000), synthetic("tone")),
            (dict(samples=synthetic("noise", seconds=3.0), sampling_rate=16000), synthetic("noise", seconds=3.0))]

    def call(inputs):
        try:
            return transcribe(server, request_inputs(**inputs, max_new_tokens=MAX_NEW)
                              if "max_new_tokens" not in inputs else request_inputs(**inputs))
        except InferenceServerException as exc:
            return exc

    before = batch_sizes(server)
    with ThreadPoolExecutor(len(bad) + len(good)) as pool:
        answers = list(pool.map(call, [inputs for inputs, _ in good + bad]))
    for answer, (_, clip) in zip(answers, good):
        assert answer == expected(reference, clip, max_new_tokens=MAX_NEW)
    for answer, (inputs, fragment) in zip(answers[len(good):], bad):
        assert isinstance(answer, InferenceServerException), (fragment, answer)
        assert answer.status() == "400" and fragment in answer.message(), (fragment, answer.message())
        assert "Traceback" not in answer.message() and "--" not in answer.message(), answer.message()
    after = batch_sizes(server)
    assert max(size for size in after if after[size] > before.get(size, 0)) > 1  # bad and good batched together
    assert transcribe(server, request_inputs(audio=fox, max_new_tokens=MAX_NEW)) == answers[0]  # the server goes on


def test_timestamps_and_long_form_are_transcribes(whisper_served, audio, reference):
    """timestamps (segments cut at the decode's timestamps) and a clip past 30 s (long-form, window by window), in
    one batch: what runtime.transcription gives."""
    out, server = whisper_served
    speech, rate = sf.read(str(audio["numbers"]), dtype="float32")
    long = np.tile(speech, int(np.ceil(35 * rate / len(speech))))[: int(35 * rate)]
    cases = [(dict(audio=audio["fox"].read_bytes(), timestamps=True), load_audio(audio["fox"]), dict(timestamps=True)),
             (dict(audio=audio["fox"].read_bytes(), timestamps=True, beam_size=2), load_audio(audio["fox"]),
              dict(timestamps=True, beam=2)),
             (dict(samples=long, sampling_rate=rate), prepare_audio(long, rate), dict()),
             (dict(samples=long, sampling_rate=rate, timestamps=True), prepare_audio(long, rate),
              dict(timestamps=True)),
             # transformers' long-form options as request parameters: conditioning, and a fallback every window
             # takes (an average log-probability is below 0) to a sampled decode under the request's seed
             (dict(samples=long, sampling_rate=rate, condition_on_prev_tokens=True,
                   temperature=np.array([[0.0, 0.4]], np.float32), logprob_threshold=np.array([[0.0]], np.float32),
                   seed=np.array([[3]], np.int64)), prepare_audio(long, rate),
              dict(condition_on_prev_tokens=True, temperature=(0.0, 0.4), logprob_threshold=0.0, seed=3))]
    with ThreadPoolExecutor(len(cases)) as pool:
        got = list(pool.map(lambda case: transcribe(server, request_inputs(**case[0], max_new_tokens=MAX_NEW)), cases))
    want = [expected(reference, clip, max_new_tokens=MAX_NEW, **options) for _, clip, options in cases]
    assert got == want
    assert got[2]["segments"][-1]["end"] == pytest.approx(35.0, abs=1e-3) and len(got[2]["segments"]) > 1


def test_a_written_python_repository_transcribes_as_transcribe(whisper_exported, audio, reference, tmp_path):
    """`serve --write-repository --repository-backend python` of the Whisper export, served by `--repository`:
    transcribe over BLS calls to the encoder and decoder models answers what runtime.transcription gives."""
    from helpers.cli import invoke

    from .conftest import Server

    out = whisper_exported
    result = invoke("serve", out, "--write-repository", tmp_path / "repo", "--repository-backend", "python")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "repo").iterdir() if p.is_dir()) == ["decoder", "encoder", "transcribe"]
    assert "models/transcribe/infer" in (tmp_path / "repo" / "README.md").read_text()
    tone = synthetic("tone", rate=8000, seconds=1.5)
    cases = [(dict(audio=audio["fox"].read_bytes()), load_audio(audio["fox"]), dict()),
             (dict(samples=tone, sampling_rate=8000, beam_size=2, language="de"), prepare_audio(tone, 8000),
              dict(beam=2, language="de")),
             (dict(audio=audio["stereo"].read_bytes(), timestamps=True), load_audio(audio["stereo"]),
              dict(timestamps=True))]
    server = Server(out, tmp_path / "server.log", "--repository", str(tmp_path / "repo"), "--max-queue-delay-us",
                    "20000")
    try:
        with ThreadPoolExecutor(len(cases)) as pool:
            got = list(pool.map(lambda case: transcribe(server, request_inputs(**case[0], max_new_tokens=MAX_NEW)),
                                cases))
    finally:
        assert server.stop(timeout_s=150) == 0
    assert got == [expected(reference, clip, max_new_tokens=MAX_NEW, **options) for _, clip, options in cases]


def test_without_timestamp_tokens_a_long_clip_is_refused_alone(tmp_path):
    """On a model without timestamp tokens, timestamps and a clip past 30 s (long-form) are refused request by
    request, before the batch is grouped (so a long clip does not take the short ones of its group with it)."""
    from helpers.audio import whisper_checkpoint, whisper_source
    from seq2trt.serving.transcribe_service import SpeechJob, TranscribeService

    ckpt = whisper_checkpoint(whisper_source(tmp_path / "hf", timestamps=0), tmp_path / "ckpt")
    service = TranscribeService(ckpt, "eager")
    try:
        service.check(SpeechJob(synthetic("tone")))
        for job in (SpeechJob(synthetic("tone"), timestamps=True), SpeechJob(synthetic("noise", seconds=31.0))):
            with pytest.raises(InputError, match="no timestamp tokens"):
                service.check(job)
    finally:
        service.close()


def test_a_subnormal_temperature_is_refused_naming_the_input(whisper_exported):
    """Issue 49 item 6: temperature 1e-45 (an FP32 subnormal) passes "> 0" and decodes garbage; transformers
    refuses it, and a served request is refused as transcribe's --temperature is (WindowOptions.checked)."""
    from seq2trt.serving.transcribe_service import SpeechJob, TranscribeService

    service = TranscribeService(whisper_exported, "ort-fused")
    try:
        for temperature in ((1e-45,), (0.0, 1e-45)):
            with pytest.raises(InputError, match="temperature"):
                service.check(SpeechJob(synthetic("tone"), temperature=temperature))
    finally:
        service.close()
