"""Issue 49 case 10 (and the last session's leftover): `transcribe` of an export whose decoder is shorter than the
model's (--max-tgt-len 24 of Whisper's 448) failed after decoding with the graph's terms ("past_len + tgt_len = 65
exceeds max_tgt_len 64"), whatever the length asked. Now a longer max_new_tokens is refused before any audio is
decoded, in one line naming the flag (CLI) or keyword (API) and the export's limit, and the model's default length is
capped at what the export holds: the tokens transformers' generate gives with that many new tokens. (Served: tests/
serving/test_transcribe_refusals.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import soundfile as sf

pytest.importorskip("transformers", reason="the hf extra is not installed")

import seq2trt  # noqa: E402
from helpers.audio import generate_tokens, synthetic  # noqa: E402
from helpers.cli import invoke, one_error_line  # noqa: E402
from seq2trt.core.errors import InputError  # noqa: E402

MAX_TGT_LEN = 24  # the start token, a prompt of 3 (language, task, <|notimestamps|>), 20 tokens generated


@pytest.fixture(scope="module")
def short_export(tmp_path_factory) -> Path:
    from helpers.audio import whisper_checkpoint, whisper_source

    root = tmp_path_factory.mktemp("short-whisper")
    ckpt = whisper_checkpoint(whisper_source(root / "hf", timestamps=0, seed=3, std=1.0), root / "ckpt")
    result = invoke("export", ckpt, "-o", root / "out", "--max-batch", 2, "--max-tgt-len", MAX_TGT_LEN)
    assert result.exit_code == 0, result.output
    sf.write(root / "noise.wav", synthetic("noise", seconds=3.0, seed=2), 16000)
    return root / "out"


def test_a_longer_max_new_tokens_is_refused_up_front_naming_the_flag(short_export, tmp_path, monkeypatch):
    from seq2trt.runtime import transcription

    decoded = []
    real = transcription.FrontEnd.__call__
    monkeypatch.setattr(transcription.FrontEnd, "__call__", lambda self, clips: decoded.append(1) or real(self, clips))
    line = one_error_line(invoke("transcribe", short_export, short_export.parent / "noise.wav", "--backend", "ort",
                                 "--max-new-tokens", MAX_TGT_LEN - 3, "--output-ids", tmp_path / "ids.jsonl"), 2,
                          f"--max-new-tokens {MAX_TGT_LEN - 3} does not fit",
                          f"the export's decoder (its max_tgt_len) holds {MAX_TGT_LEN} positions",
                          f"give 1 .. {MAX_TGT_LEN - 4}")
    assert "past_len" not in line and not decoded and not (tmp_path / "ids.jsonl").exists()


def test_the_api_names_its_keyword(short_export):
    with seq2trt.Transcriber(short_export, backend="ort") as whisper:
        with pytest.raises(InputError, match=f"^max_new_tokens {MAX_TGT_LEN - 3} does not fit: the export's decoder "
                                             f"\\(its max_tgt_len\\) holds {MAX_TGT_LEN} positions"):
            whisper.transcribe(short_export.parent / "noise.wav", max_new_tokens=MAX_TGT_LEN - 3)


def test_the_default_length_is_what_the_export_holds(short_export):
    """The model's own max_length (448) is capped at the export's: generate with max_new_tokens 20 is the judge."""
    from seq2trt.hf_import.proof import load_transformers_model

    from helpers.audio import judge_clip

    src = short_export.parent / "hf"
    clips = [judge_clip(short_export.parent / "noise.wav"), synthetic("tone")]
    want, languages = generate_tokens(load_transformers_model(src, speech=True), src, clips, None, 1,
                                      MAX_TGT_LEN - 4)
    with seq2trt.Transcriber(short_export, backend="ort") as whisper:
        got = whisper.transcribe(clips, sampling_rate=16000)
    assert [t.tokens for t in got] == want and [t.language for t in got] == languages
    assert max(len(t) for t in want) == MAX_TGT_LEN - 4  # the cap, not eos, ended a decode
