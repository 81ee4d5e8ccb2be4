"""Issue 49 cases 2 and 4 through the real `seq2trt serve`: a Whisper without timestamp tokens (a vocabulary that ends
at <|notimestamps|>), exported with a decoder shorter than the model's (--max-tgt-len 24 of 448). A clip past 30 s
would lose everything after its first window on such a model, so it is refused (samples of 31, 32.5 and 40 s as JSON,
40 s as WAV bytes), as `timestamps` is; a max_new_tokens the export's decoder cannot hold is refused naming it and
the export's max_tgt_len. All of them 400 with one reason while the good requests sent with them are answered what
`seq2trt transcribe` gives (the same limits, its own test: tests/reliability/test_transcribe_limits.py); a clip of
exactly 30 s and the default length (capped at the export's) are answered."""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import soundfile as sf

pytest.importorskip("transformers", reason="the hf extra is not installed")

from helpers.audio import synthetic  # noqa: E402
from helpers.cli import invoke  # noqa: E402

from .conftest import Server  # noqa: E402
from .test_transcribe_model import request_inputs, transcribe  # noqa: E402

MAX_TGT_LEN = 24  # the export's decoder positions: start token, 3 prompt tokens, 20 generated at most


@pytest.fixture(scope="module")
def plain_whisper(tmp_path_factory):
    """(export dir, a running Server of it): a random Whisper without timestamp tokens, imported (proof included),
    exported unfused with --max-tgt-len MAX_TGT_LEN, served with --backend ort."""
    from helpers.audio import whisper_checkpoint, whisper_source

    root = tmp_path_factory.mktemp("plain-whisper")
    ckpt = whisper_checkpoint(whisper_source(root / "hf", timestamps=0, seed=3, std=1.0), root / "ckpt")
    result = invoke("export", ckpt, "-o", root / "out", "--max-batch", 4, "--max-tgt-len", MAX_TGT_LEN)
    assert result.exit_code == 0, result.output
    server = Server(root / "out", root / "server.log", "--backend", "ort", "--max-queue-delay-us", "20000")
    yield root / "out", server
    assert server.stop() == 0, "".join(server.lines)


def _wav(samples: np.ndarray, rate: int) -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, samples, rate, format="WAV")
    return buffer.getvalue()


def _call(server, inputs):
    from tritonclient.utils import InferenceServerException

    try:
        return transcribe(server, request_inputs(**inputs))
    except InferenceServerException as exc:
        return exc


def test_what_the_model_cannot_do_is_refused_not_cut(plain_whisper):
    from seq2trt.runtime.transcription import open_transcriber

    out, server = plain_whisper
    rate = 16000
    noise = {seconds: synthetic("noise", seconds=seconds, seed=int(seconds * 10)) for seconds in (31.0, 32.5, 40.0)}
    stamps = "this model has no timestamp tokens"
    bad = [(dict(samples=noise[31.0], sampling_rate=rate), stamps),
           (dict(samples=noise[32.5], sampling_rate=rate), stamps),
           (dict(samples=noise[40.0], sampling_rate=rate), stamps),
           (dict(audio=_wav(noise[40.0], rate)), stamps),
           (dict(samples=synthetic("tone"), sampling_rate=rate, timestamps=True), stamps),
           (dict(samples=synthetic("tone"), sampling_rate=rate, max_new_tokens=MAX_TGT_LEN - 3),
            f"max_new_tokens {MAX_TGT_LEN - 3} does not fit: the export's decoder (its max_tgt_len) holds "
            f"{MAX_TGT_LEN} positions")]
    thirty = synthetic("noise", seconds=30.0, seed=5)  # exactly one window: no long-form, answered
    good = [(dict(samples=synthetic("tone"), sampling_rate=rate), synthetic("tone"), {}),
            (dict(samples=thirty, sampling_rate=rate), thirty, {}),
            (dict(audio=_wav(synthetic("noise", seconds=3.0), rate), max_new_tokens=MAX_TGT_LEN - 4),
             synthetic("noise", seconds=3.0), dict(max_new_tokens=MAX_TGT_LEN - 4))]
    with ThreadPoolExecutor(len(bad) + len(good)) as pool:
        answers = list(pool.map(lambda inputs: _call(server, inputs), [i for i, *_ in good] + [i for i, _ in bad]))
    for answer, (inputs, fragment) in zip(answers[len(good):], bad):
        assert not isinstance(answer, dict), f"answered 200 (audio dropped?): {fragment}: {answer}"
        assert answer.status() == "400" and fragment in answer.message(), (fragment, answer.message())
        assert "--" not in answer.message() and "\n" not in answer.message(), answer.message()
    with open_transcriber(out, "ort") as reference:
        for answer, (_, clip, options) in zip(answers, good):
            want = next(reference.transcribe([clip], **options)).as_dict()
            assert answer == {k: want[k] for k in ("text", "language", "tokens", "segments")}
    # the default length is what the export holds: 20 tokens after the start token and the prompt, at most
    assert all(len(a["tokens"]) <= MAX_TGT_LEN - 4 for a in answers[: len(good)])
    assert max(len(a["tokens"]) for a in answers[: len(good)]) == MAX_TGT_LEN - 4  # the cap was reached
    assert _call(server, good[0][0]) == answers[0]  # the server goes on
