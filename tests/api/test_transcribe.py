"""`seq2trt.Translator(...).transcribe` and `seq2trt.Transcriber`: the same transcriptions as `seq2trt transcribe` on the same files, and from
arrays of samples at their own rate (mono and stereo); an export's graphs (its features.onnx in front) through ort and
ort-fused equal transformers' `generate` on `WhisperFeatureExtractor`'s features; typed results; what is refused.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile as sf

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")

# save_pretrained of a Whisper whose config.json names suppress_tokens: transformers' note, not a problem here
pytestmark = pytest.mark.filterwarnings("ignore:Moving the following attributes:UserWarning")

import seq2trt  # noqa: E402
from seq2trt.core.errors import InputError  # noqa: E402

from helpers.audio import generate_tokens, judge_clip  # noqa: E402
from helpers.cli import invoke, invoke_ok  # noqa: E402

MAX_NEW = 12


@pytest.fixture(scope="module")
def whisper(whisper_imported, tmp_path_factory):
    """(source directory, checkpoint, export with fused ORT graphs, transformers' model)."""
    from seq2trt.hf_import.proof import load_transformers_model

    src, ckpt = whisper_imported
    out = tmp_path_factory.mktemp("whisper") / "out"
    invoke_ok("export", ckpt, "-o", out)
    invoke_ok("fuse", out, "--target", "ort")
    return src, ckpt, out, load_transformers_model(src, speech=True)


@pytest.fixture(scope="module")
def audio(speech_files):
    return [speech_files[name] for name in ("speech", "tone-8k", "stereo")]


def as_rows(files, results) -> list[dict]:
    """The API's results in the CLI's --format json shape, field by field."""
    return [{"file": str(f), "language": r.language, "text": r.text, "tokens": r.tokens,
             "segments": [{"start": round(s.start, 3), "end": round(s.end, 3), "text": s.text, "tokens": s.tokens}
                          for s in r.segments]} for f, r in zip(files, results)]


def test_api_equals_cli_on_files_and_arrays(whisper, audio):
    _, ckpt, _, _ = whisper
    result = invoke("transcribe", ckpt, *audio, "--format", "json", "--max-new-tokens", MAX_NEW)
    assert result.exit_code == 0, result.output
    cli_rows = [json.loads(line) for line in result.stdout.splitlines()]
    seen = []
    with seq2trt.Translator(ckpt, backend="eager") as whisper_model:
        assert whisper_model.has_tokenizer
        results = whisper_model.transcribe(audio, max_new_tokens=MAX_NEW, batch_size=2,
                                           progress=lambda done, total: seen.append((done, total)))
        assert all(isinstance(r, seq2trt.Transcription) for r in results)
        assert all(isinstance(s, seq2trt.TranscribedSegment) for r in results for s in r.segments)
        assert as_rows(audio, results) == cli_rows
        assert seen == [(2, 3), (3, 3)]
        samples, rate = sf.read(str(audio[2]), dtype="float32")  # (n, 2) at 44.1 kHz: as its file
        assert whisper_model.transcribe(samples, sampling_rate=rate, max_new_tokens=MAX_NEW) == results[2:]


@pytest.mark.parametrize("backend, language, beams", [("ort", "fr", 4), ("ort-fused", None, 1)])
def test_export_backends_equal_transformers(whisper, audio, backend, language, beams):
    """The export reads its own features.onnx (beam 4 with the language given, greedy with it detected)."""
    src, _, out, hf_model = whisper
    with seq2trt.Translator(out, backend=backend) as whisper_model:
        assert whisper_model._transcriber.front_end._session is not None  # features.onnx, not the torch module
        got = whisper_model.transcribe(audio, language=language, beam_size=beams, max_new_tokens=MAX_NEW)
    want, languages = generate_tokens(hf_model, src, [judge_clip(a) for a in audio], language, beams, MAX_NEW)
    assert [r.tokens for r in got] == want and [r.language for r in got] == languages


def test_refusals(whisper, audio, tmp_path, make_model):
    from seq2trt.reference_model.checkpoint import save_checkpoint

    _, ckpt, out, _ = whisper
    text = save_checkpoint(tmp_path / "text", make_model(seed=1))
    with seq2trt.Translator(text, backend="eager") as translator:
        with pytest.raises(InputError, match="reads token ids; use translate"):
            translator.transcribe(audio[:1])
    with pytest.raises(InputError, match="cannot transcribe"):
        seq2trt.Translator(out, backend="ort-generate")
    translator = seq2trt.Translator(ckpt, backend="eager")
    with pytest.raises(InputError, match="speech model"):
        translator.translate(["hello"])
    with pytest.raises(InputError, match="speech model"):
        translator.generate([[1, 2, 3]])
    with pytest.raises(InputError, match="sampling_rate"):
        translator.transcribe(np.zeros(16000, np.float32))
    with pytest.raises(InputError, match="a list"):
        translator.transcribe([[0.0, 0.1, 0.2]], sampling_rate=16000)
    with pytest.raises(InputError, match="dtype int16"):
        translator.transcribe(np.zeros(16000, np.int16), sampling_rate=16000)
    with pytest.raises(InputError, match="no audio"):
        translator.transcribe([])
    with pytest.raises(InputError, match="unknown language 'xx'"):
        translator.transcribe(audio[:1], language="xx")
    with pytest.raises(InputError, match="over the limit of 1 s"):
        translator.transcribe(audio[1:2], max_seconds=1)
    with pytest.raises(InputError, match="does not exist"):
        translator.transcribe(tmp_path / "missing.wav")
    with pytest.raises(InputError, match="beam_size 10000000 needs about .* GiB"):  # a hang past 300 s before
        translator.transcribe(audio[:1], beam_size=10 ** 7)
    # transcribe(None) raised a TypeError, transcribe(bytes) called the first byte "audio 1 is a int"
    with pytest.raises(InputError, match="^audio is a NoneType; give a file path"):
        translator.transcribe(None)
    with pytest.raises(InputError, match="^audio is a bytes; .*write them to a file"):
        translator.transcribe(audio[0].read_bytes())
    with pytest.raises(InputError, match="^audio 2 is a bytes"):
        translator.transcribe([audio[0], b"RIFF"])
    translator.close()
    with pytest.raises(InputError, match="closed"):
        translator.transcribe(audio[:1])


@pytest.mark.parametrize("where, backend, language, beams", [("out", "ort-fused", "fr", 4), ("ckpt", "eager", None, 1)])
def test_transcriber_equals_transformers(whisper, audio, where, backend, language, beams):
    """`seq2trt.Transcriber`, the speech counterpart of Translator: the tokens and languages of transformers'
    `generate` on the same files, and the text its own tokenizer decodes from them."""
    src, ckpt, out, hf_model = whisper
    with seq2trt.Transcriber(out if where == "out" else ckpt, backend=backend) as whisper_model:
        assert whisper_model.has_tokenizer and whisper_model.config.audio
        got = whisper_model.transcribe(audio, language=language, beam_size=beams, max_new_tokens=MAX_NEW)
        assert whisper_model.transcribe(audio[0], language=language, beam_size=beams, max_new_tokens=MAX_NEW) == got[:1]
    want, languages = generate_tokens(hf_model, src, [judge_clip(a) for a in audio], language, beams, MAX_NEW)
    assert [r.tokens for r in got] == want and [r.language for r in got] == languages
    tokenizer = transformers.WhisperTokenizer.from_pretrained(str(src))
    assert [r.text for r in got] == tokenizer.batch_decode(want, skip_special_tokens=True)
    with pytest.raises(InputError, match="closed"):
        whisper_model.transcribe(audio[:1])


def test_transcriber_refuses_a_text_model(tmp_path, make_model):
    from seq2trt.reference_model.checkpoint import save_checkpoint

    text = save_checkpoint(tmp_path / "text", make_model(seed=1))
    with pytest.raises(InputError, match="is a text model .*seq2trt.Translator"):
        seq2trt.Transcriber(text, backend="eager")
