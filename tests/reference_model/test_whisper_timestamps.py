"""Whisper's timestamps and long-form transcription (`reference_model.longform.transcribe`), judged by transformers:
the timestamp rule against its `WhisperTimeStampLogitsProcessor`, the segments of a decode against its
`_retrieve_segment`, and whole transcriptions, short-form (greedy and beam-4) and long-form (greedy and beam-4, one
clip and a batch of two lengths), against `WhisperForConditionalGeneration.generate(return_timestamps=True,
return_segments=True)`: every segment's tokens (timestamps included), its start and end, equal.

The models are small random ones with 1501 timestamp tokens (a released checkpoint's); they emit timestamps freely,
so the decodes have many segments and the windows seek. A short `max_new_tokens` keeps them fast and leaves
decodes that end inside a segment (the case where transformers drops the tail and seeks back).
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")

from seq2trt.reference_model.decoding import DecodeSettings  # noqa: E402
from seq2trt.reference_model.eager import EagerStepModel  # noqa: E402
from seq2trt.core.errors import ConfigError, InputError  # noqa: E402
from seq2trt.hf_import.importer import load_hf_as_model  # noqa: E402
from seq2trt.hf_import.proof import load_transformers_model
from seq2trt.hf_import.speech_proof import whisper_generated  # noqa: E402
from seq2trt.reference_model.speech import SpeechTokens, transcribe_features  # noqa: E402
from seq2trt.reference_model.longform import transcribe, window_segments  # noqa: E402

from helpers.audio import SENTENCES, judge_clip, speak  # noqa: E402
from helpers.hf_models import WHISPER_IDS, whisper_model_dir  # noqa: E402

STAMPS = 1501  # <|0.00|> .. <|30.00|>
BEGIN = WHISPER_IDS["no_timestamps"] + 1
EOS = WHISPER_IDS["eot"]
NEW = 24  # max_new_tokens of every decode here


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(ours: step model, cfg, speech, generation; transformers' model) of a random Whisper with timestamps and a
    released checkpoint's max_initial_timestamp_index of 50 (1 s)."""
    src = whisper_model_dir(tmp_path_factory.mktemp("ts") / "hf", timestamps=STAMPS,
                            generation=dict(max_initial_timestamp_index=50))
    _, model, gen, _ = load_hf_as_model(src)
    return (EagerStepModel(model), model.cfg, SpeechTokens.from_record(gen["speech"]), gen,
            load_transformers_model(src, speech=True))


def hf_segments(hf_model, features: np.ndarray, beams: int = 1, attention_mask=None, language: str | None = "en"
                ) -> list:
    """transformers' segments of each clip of a (B, n_mels, frames) batch: [(start, end, tokens)], and the first
    window's whole decode of each (its `result`)."""
    extra = {} if attention_mask is None else dict(attention_mask=torch.as_tensor(attention_mask))
    with torch.inference_mode():
        out = hf_model.generate(input_features=torch.as_tensor(features), return_timestamps=True, language=language,
                                task="transcribe", num_beams=beams, max_new_tokens=NEW, return_segments=True,
                                **extra)
    return [[(float(s["start"]), float(s["end"]), s["tokens"].tolist()) for s in clip] for clip in out["segments"]], \
        [clip[0]["result"] for clip in out["segments"]]


def ours_segments(transcript) -> list:
    return [(s.start, s.end, s.decoded) for s in transcript.segments]


def check_transcripts(ours, theirs, languages=None) -> None:
    for transcript, segments, language in zip(ours, theirs, languages or ["en"] * len(theirs)):
        assert ours_segments(transcript) == segments
        text = [t for _, _, tokens in segments for t in tokens if t < BEGIN]
        assert transcript.tokens == text and [t for s in transcript.segments for t in s.tokens] == text
        assert transcript.language == language


# --- the rule and the cuts, one call of transformers' own each ------------------------------------------------------

HISTORIES = {
    "first token": [],
    "after the first timestamp": [BEGIN + 3],
    "text after a timestamp": [BEGIN, 5, 9],
    "a timestamp after text": [BEGIN, 5, BEGIN + 40],
    "a closed pair": [BEGIN, 5, BEGIN + 40, BEGIN + 40],
    "text after a pair": [BEGIN, 5, BEGIN + 40, BEGIN + 41, 7],
    "the last timestamp": [BEGIN + 2, 5, BEGIN + STAMPS - 1],
}


@pytest.mark.parametrize("initial", [None, 3])
@pytest.mark.parametrize("sharp", [1.0, 6.0])
def test_timestamp_rule_equals_transformers_processor(initial, sharp):
    """DecodeSettings.constrain with the timestamp rule (after the model's suppressed ids) equals transformers'
    SuppressTokens, SuppressTokensAtBegin and WhisperTimeStamp processors in generate's order, on random scores of
    every history kind at once (`sharp` scales them so that text sometimes wins over the timestamps' sum)."""
    from transformers import GenerationConfig
    from transformers.generation.logits_process import (SuppressTokensAtBeginLogitsProcessor,
                                                        SuppressTokensLogitsProcessor, WhisperTimeStampLogitsProcessor)

    vocab, prompt = BEGIN + STAMPS, (102, 106)
    settings = DecodeSettings(101, EOS, EOS, 10, suppress_ids=(1, 2), begin_suppress_ids=(7, EOS), prompt=prompt,
                              timestamp_begin=BEGIN, max_initial_timestamp_index=initial)
    config = GenerationConfig(no_timestamps_token_id=BEGIN - 1, eos_token_id=EOS, max_initial_timestamp_index=initial)
    rng = np.random.default_rng(int(sharp) + (initial or 0))
    for length in sorted({len(h) for h in HISTORIES.values()}):
        rows = [h for h in HISTORIES.values() if len(h) == length]
        tokens = np.asarray(rows, np.int64).reshape(len(rows), length)
        scores = (rng.standard_normal((len(rows), vocab)) * sharp).astype(np.float32)
        scores[:, :BEGIN] += 2.0 * sharp  # text competes with 1501 timestamps
        begin = 1 + len(prompt)
        ids = torch.cat([torch.tensor([[101, *prompt]] * len(rows)), torch.as_tensor(tokens)], 1)
        expected = torch.as_tensor(scores.copy())
        for processor in (SuppressTokensAtBeginLogitsProcessor([7, EOS], begin),
                          SuppressTokensLogitsProcessor([1, 2]), WhisperTimeStampLogitsProcessor(config, begin)):
            expected = processor(ids, expected)
        got = settings.constrain(scores, length, tokens=tokens if length else None)
        np.testing.assert_array_equal(got, expected.numpy())


CUTS = {
    "pairs, open tail": [BEGIN, 5, BEGIN + 50, BEGIN + 50, 6, 7, BEGIN + 90, BEGIN + 95, 8],
    "pairs, single ending": [BEGIN, 5, BEGIN + 50, BEGIN + 50, 6, BEGIN + 80],
    "pairs, pair ending": [BEGIN + 1, 5, BEGIN + 50, BEGIN + 51, 6, BEGIN + 80, BEGIN + 80],
    "no pair, a last timestamp": [BEGIN + 4, 5, 6, BEGIN + 70],
    "no pair, only <|0.00|>": [BEGIN, 5, 6],
    "no timestamps": [5, 6, 7],
}


@pytest.mark.parametrize("seek,frames", [(0, 3000), (4410, 1234)])
@pytest.mark.parametrize("case", CUTS)
def test_window_segments_equal_retrieve_segment(case, seek, frames):
    """Segments and the seek step of one window's decode equal transformers' _retrieve_segment."""
    from transformers import WhisperForConditionalGeneration

    tokens = CUTS[case]
    offset = torch.tensor([seek], dtype=torch.float64) * 0.02 / 2
    theirs, step = WhisperForConditionalGeneration._retrieve_segment(
        torch.tensor(tokens), [None], offset, BEGIN, torch.tensor([frames]), 0.02, 0.01, 2, 0, 0, False,
        torch.zeros((1, 4)))
    segments, advance = window_segments(tokens, BEGIN, seek * 0.02 / 2, frames, 2)
    assert advance == int(step)
    assert [(s.start, s.end, s.decoded) for s in segments] == \
        [(float(s["start"]), float(s["end"]), s["tokens"].tolist()) for s in theirs]
    assert all(s.tokens == [t for t in s.decoded if t < BEGIN] for s in segments)


# --- whole transcriptions -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("beams", [1, 4])
def test_short_form_timestamps_equal_generate(models, beams):
    """Clips of 30 s with timestamps: the first window's tokens equal generate's decode token for token, and the
    transcripts' segments (transformers re-seeks inside the 30 s too) equal its segments."""
    step_model, cfg, speech, gen, hf_model = models
    features = np.random.default_rng(beams).standard_normal((3, 80, 3000)).astype(np.float32)
    theirs, results = hf_segments(hf_model, features, beams)
    first = transcribe_features(step_model, cfg, speech, features, language="en", task="transcribe",
                                beam_size=beams, max_new_tokens=NEW, generation=gen, timestamps=True)
    assert first == whisper_generated(torch.stack(results), 2, EOS)  # the prompt: en, transcribe
    ours = transcribe(step_model, cfg, speech, list(features), language="en", task="transcribe", timestamps=True,
                      beam_size=beams, max_new_tokens=NEW, generation=gen)
    check_transcripts(ours, theirs)
    assert sum(len(s) for s in theirs) > len(theirs)  # cut at pairs: something to get wrong


@pytest.fixture(scope="module")
def long_clip(tmp_path_factory):
    """About 50 s of espeak-ng speech as 16 kHz samples: every test sentence, spoken five times over."""
    wav = speak(tmp_path_factory.mktemp("speech"), " ".join(SENTENCES * 5))
    samples = judge_clip(wav)
    assert 40 * 16000 < len(samples) < 75 * 16000, len(samples) / 16000
    return samples


def long_features(clips: list) -> tuple[np.ndarray, np.ndarray]:
    """transformers' long-form inputs: the whole clips' features, padded to the longest, and their frames' mask."""
    from transformers import WhisperFeatureExtractor

    got = WhisperFeatureExtractor(feature_size=80)(clips, sampling_rate=16000, truncation=False, padding="longest",
                                                   return_attention_mask=True, return_tensors="np")
    return got["input_features"].astype(np.float32), got["attention_mask"]


@pytest.mark.parametrize("beams", [1, 4])
def test_long_form_equals_generate(models, long_clip, beams):
    """A clip of about 50 s: transformers' sequential long-form transcription, window by window from seek, segment
    for segment (tokens with their timestamps, start and end in seconds)."""
    step_model, cfg, speech, gen, hf_model = models
    features, _ = long_features([long_clip])
    assert features.shape[-1] > 4000
    theirs, _ = hf_segments(hf_model, features, beams)
    ours = transcribe(step_model, cfg, speech, [features[0]], language="en", task="transcribe", timestamps=True,
                      beam_size=beams, max_new_tokens=NEW, generation=gen)
    check_transcripts(ours, theirs)
    assert max(end for _, end, _ in theirs[0]) > 30.0  # past the first window


def test_long_form_batch_of_two_lengths_equals_generate(models, long_clip):
    """A long clip and a shorter long one in one batch (transformers: padded features and their attention mask;
    ours: each clip's own features), decoded without asking for timestamps (long-form decodes them all the same)
    and with no language: each clip's is detected on its first window, as transformers' detect_language does."""
    step_model, cfg, speech, gen, hf_model = models
    clips = [long_clip, long_clip[: 36 * 16000] * 0.5]
    features, mask = long_features(clips)
    frames = mask.sum(-1)
    assert frames[1] < frames[0] and frames[1] > 3000
    theirs, _ = hf_segments(hf_model, features, attention_mask=mask, language=None)
    with torch.inference_mode():
        detected = hf_model.detect_language(input_features=torch.as_tensor(features[:, :, :3000])).tolist()
    by_id = {i: code for code, i in speech.languages.items()}
    from seq2trt.reference_model import longform as longform_module, speech as speech_module

    encoded, rounds = [], []

    class Counting:  # the windows each encode call takes
        def __getattr__(self, name):
            return getattr(step_model, name)

        def encode(self, features, mask):
            encoded.append(len(features))
            return step_model.encode(features, mask)

    real = speech_module.decode_windows

    def recording(model, cfg, speech, windows, *args, **kwargs):
        rounds.append(len(windows))
        return real(model, cfg, speech, windows, *args, **kwargs)

    with mock.patch.object(longform_module, "decode_windows", recording):
        ours = transcribe(Counting(), cfg, speech, [f[:, :n] for f, n in zip(features, frames)], task="transcribe",
                          max_new_tokens=NEW, generation=gen)
    check_transcripts(ours, theirs, [by_id[i] for i in detected])
    # Detection encodes both first windows once; the first round decodes from that state; each later round encodes
    # its windows once (one group: both clips are English here).
    assert encoded == [2] + rounds[1:] and rounds[0] == 2 and len(rounds) > 1, (encoded, rounds)


# --- what is refused ------------------------------------------------------------------------------------------------

def test_timestamps_need_timestamp_tokens(tmp_path):
    """A vocabulary that ends at <|notimestamps|> has no timestamps: asked for, or a clip past 30 s, refused."""
    src = whisper_model_dir(tmp_path / "hf")
    _, model, gen, _ = load_hf_as_model(src)
    speech, step_model = SpeechTokens.from_record(gen["speech"]), EagerStepModel(model)
    with pytest.raises(ConfigError, match="no timestamp tokens"):
        transcribe(step_model, model.cfg, speech, [np.zeros((80, 3000), np.float32)], language="en",
                   timestamps=True)
    with pytest.raises(ConfigError, match="no timestamp tokens"):
        transcribe(step_model, model.cfg, speech, [np.zeros((80, 4000), np.float32)], language="en")


def test_clips_shorter_than_a_window_are_refused(models):
    step_model, cfg, speech, gen, _ = models
    with pytest.raises(InputError, match="clip 2 has 2999 feature frames; a clip takes 3000 at least"):
        transcribe(step_model, cfg, speech, [np.zeros((80, 3000), np.float32), np.zeros((80, 2999), np.float32)],
                   language="en", timestamps=True)
