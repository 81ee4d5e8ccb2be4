"""Whisper's long-form options of `reference_model.longform.transcribe` (condition_on_prev_tokens, temperature
fallback with compression_ratio_threshold and logprob_threshold, seed), judged by transformers'
`WhisperForConditionalGeneration.generate(return_timestamps=True, return_segments=True, ...)` with the same options:
every segment's tokens (timestamps included), start and end, equal.

The model is a small random one with 1501 timestamp tokens (it emits them freely: many segments, windows that seek);
the clips are random features of 65 s (three windows at least), so each later window has previous text to condition
on. A logprob_threshold of 0 fails every decode (an average log-probability is at most 0, and below it wherever a
token's probability is under 1), so every window falls back through every temperature: the fallback is certain by
the arithmetic, not by a measured run.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")

from seq2trt.reference_model import longform as longform_module  # noqa: E402  (its windows decoded by name there)
from seq2trt.reference_model import speech as speech_module  # noqa: E402
from seq2trt.reference_model.eager import EagerStepModel  # noqa: E402
from seq2trt.core.errors import ConfigError, InputError  # noqa: E402
from seq2trt.hf_import.importer import load_hf_as_model  # noqa: E402
from seq2trt.hf_import.proof import load_transformers_model  # noqa: E402
from seq2trt.reference_model.speech import SpeechTokens, compression_ratio  # noqa: E402
from seq2trt.reference_model.longform import transcribe  # noqa: E402

from helpers.hf_models import WHISPER_IDS, whisper_model_dir  # noqa: E402

STAMPS = 1501
BEGIN = WHISPER_IDS["no_timestamps"] + 1
NEW = 24  # max_new_tokens of every decode here
FRAMES = 6500  # 65 s of features: three windows at least


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(ours: step model, cfg, speech, generation; transformers' model) of a random Whisper with timestamps and a
    <|startofprev|> of its own (id 3 here: an ordinary id of this small vocabulary, which no rule suppresses)."""
    src = whisper_model_dir(tmp_path_factory.mktemp("lf") / "hf", timestamps=STAMPS,
                            generation=dict(max_initial_timestamp_index=50, prev_sot_token_id=3))
    _, model, gen, _ = load_hf_as_model(src)
    return (EagerStepModel(model), model.cfg, SpeechTokens.from_record(gen["speech"]), gen,
            load_transformers_model(src, speech=True))


@pytest.fixture(scope="module")
def clip():
    return np.random.default_rng(7).standard_normal((80, FRAMES)).astype(np.float32)


def hf_segments(hf_model, features: np.ndarray, beams: int = 1, **options) -> list:
    with torch.inference_mode():
        out = hf_model.generate(input_features=torch.as_tensor(features[None]), return_timestamps=True,
                                language="en", task="transcribe", num_beams=beams, max_new_tokens=NEW,
                                return_segments=True, **options)
    return [(float(s["start"]), float(s["end"]), s["tokens"].tolist()) for s in out["segments"][0]]


def ours_segments(step_model, cfg, speech, gen, features, beams: int = 1, **options) -> list:
    got, = transcribe(step_model, cfg, speech, [features], language="en", task="transcribe", beam_size=beams,
                      max_new_tokens=NEW, generation=gen, **options)
    assert got.tokens == [t for s in got.segments for t in s.tokens]
    return [(s.start, s.end, s.decoded) for s in got.segments]


def counting_decodes():
    """A patch of decode_windows recording each call's (rows, temperature, prefix lengths)."""
    calls, real = [], speech_module.decode_windows

    def recording(model, cfg, speech, windows, *args, **kwargs):
        calls.append((len(windows), kwargs.get("temperature", 0.0), [len(p) for p in kwargs.get("prefixes") or []]))
        return real(model, cfg, speech, windows, *args, **kwargs)

    return calls, mock.patch.object(longform_module, "decode_windows", recording)


def test_the_import_records_startofprev(tmp_path, models):
    """prev_sot_token_id when given; else suppress_tokens[-2], as generate takes it (this model's [1, 2]: 1)."""
    assert models[2].prev_sot_id == 3
    _, _, gen, _ = load_hf_as_model(whisper_model_dir(tmp_path / "hf", timestamps=4))
    assert SpeechTokens.from_record(gen["speech"]).prev_sot_id == 1
    old = SpeechTokens.from_record({k: v for k, v in gen["speech"].items() if k != "prev_sot_id"})
    with pytest.raises(ConfigError, match="re-import the Whisper model"):
        old.previous_start()


@pytest.mark.parametrize("beams", [1, 2])
def test_condition_on_prev_tokens_equals_generate(models, clip, beams):
    """Each window after the first decoded after <|startofprev|> and the text so far: generate's segments."""
    step_model, cfg, speech, gen, hf_model = models
    theirs = hf_segments(hf_model, clip, beams, condition_on_prev_tokens=True)
    calls, patch = counting_decodes()
    with patch:
        ours = ours_segments(step_model, cfg, speech, gen, clip, beams, condition_on_prev_tokens=True)
    assert ours == theirs
    assert max(end for _, end, _ in theirs) > 30.0 and len(calls) >= 3
    assert calls[0][2] == [0] and all(lengths[0] > 1 for _, _, lengths in calls[1:])  # every later window conditioned
    # the previous text changes the decode (else the test would not see it)
    assert ours_segments(step_model, cfg, speech, gen, clip, beams) != ours


def test_condition_on_prev_tokens_on_ort_equals_generate(models, clip, tmp_path):
    """The same through an ONNX Runtime export (decoder positions to 160: the prefill of a conditioned window is
    its previous text, up to 1 + 3 windows x 24 tokens here, then the prompt and 24 new tokens)."""
    from seq2trt.exporters import spec
    from seq2trt.exporters.onnx_export import export
    from seq2trt.runtime.registry import open_step_model

    _, cfg, speech, gen, hf_model = models
    src = whisper_model_dir(tmp_path / "hf", timestamps=STAMPS,
                            generation=dict(max_initial_timestamp_index=50, prev_sot_token_id=3))
    _, model, _, _ = load_hf_as_model(src)
    out = export(model, tmp_path / "out", limits=spec.Limits.for_model(model.cfg, max_batch=2, max_tgt_len=160))
    theirs = hf_segments(hf_model, clip, condition_on_prev_tokens=True)
    assert max(end for _, end, _ in theirs) > 30.0
    with open_step_model(out, "ort") as (step_model, _):
        assert ours_segments(step_model, cfg, speech, gen, clip, condition_on_prev_tokens=True) == theirs


def test_greedy_fallback_equals_generate(models, clip):
    """A compression ratio threshold below every ratio (a ratio is > 0) with the temperatures (0.0,): no sampling,
    one decode a window; the results are generate's (the threshold's check is a no-op with one temperature)."""
    step_model, cfg, speech, gen, hf_model = models
    theirs = hf_segments(hf_model, clip, compression_ratio_threshold=1e-6, temperature=(0.0,))
    assert ours_segments(step_model, cfg, speech, gen, clip, compression_ratio_threshold=1e-6,
                         temperature=(0.0,)) == theirs


@pytest.mark.parametrize("temperatures,condition", [((0.0, 0.4), True), ((0.0, 0.6), True)])
def test_sampled_fallback_reproduces_generate_under_one_seed(models, clip, temperatures, condition):
    """logprob_threshold 0 fails every decode: each window is decoded at every temperature, the last kept (sampled,
    from the one stream `torch.manual_seed(seed)` seeds before generate); a last temperature >= 0.5 stops the
    next window from conditioning on it, one below 0.5 does not."""
    step_model, cfg, speech, gen, hf_model = models
    options = dict(temperature=temperatures, logprob_threshold=0.0, condition_on_prev_tokens=condition)
    torch.manual_seed(123)
    theirs = hf_segments(hf_model, clip, **options)
    calls, patch = counting_decodes()
    with patch:
        ours = ours_segments(step_model, cfg, speech, gen, clip, seed=123, **options)
    assert ours == theirs
    windows = len(calls) // len(temperatures)
    assert windows >= 3 and [t for _, t, _ in calls] == list(temperatures) * windows
    conditions = condition and temperatures[-1] < 0.5
    assert all((lengths[0] > 1) == (conditions and i >= len(temperatures))
               for i, (_, _, lengths) in enumerate(calls))
    if temperatures[-1] < 0.5:  # another seed draws other tokens: the samples come from the stream
        assert ours_segments(step_model, cfg, speech, gen, clip, seed=124, **options) != ours


def test_beam_fallback_then_one_beam_as_generate(models, clip):
    """Beam search's log-probability is its sequences_scores; once a window sampled, generate's generation_config
    keeps num_beams 1 for the rest of the call: every later window's first decode is greedy (one beam)."""
    step_model, cfg, speech, gen, hf_model = models
    options = dict(temperature=(0.0, 0.4), logprob_threshold=0.0, condition_on_prev_tokens=True)
    torch.manual_seed(5)
    theirs = hf_segments(hf_model, clip, 2, **options)
    beams = []
    real = speech_module.decode_windows

    def recording(*args, **kwargs):
        beams.append(kwargs["beam_size"])
        return real(*args, **kwargs)

    with mock.patch.object(longform_module, "decode_windows", recording):
        ours = ours_segments(step_model, cfg, speech, gen, clip, 2, seed=5, **options)
    assert ours == theirs
    assert beams[0] == 2 and set(beams[1:]) == {1} and len(beams) >= 6


def test_a_batch_transcribes_each_clip_as_generate_alone(models, clip):
    """Two clips of different lengths in one call, conditioned: each one's segments are generate's for it alone
    (their prefixes differ, so they are decoded in groups of one prefix each)."""
    step_model, cfg, speech, gen, hf_model = models
    clips = [clip, clip[:, ::-1][:, :4200].copy()]
    ours = transcribe(step_model, cfg, speech, clips, language="en", task="transcribe", max_new_tokens=NEW,
                      generation=gen, condition_on_prev_tokens=True)
    for features, got in zip(clips, ours):
        assert [(s.start, s.end, s.decoded) for s in got.segments] == \
            hf_segments(hf_model, features, condition_on_prev_tokens=True)


def test_short_form_falls_back_as_generate(tmp_path):
    """A 30 s clip without timestamps (a vocabulary without them: transformers' loop would otherwise seek inside
    the window): generate's fallback applies to short-form too."""
    src = whisper_model_dir(tmp_path / "hf")
    _, model, gen, _ = load_hf_as_model(src)
    step_model, cfg, speech = EagerStepModel(model), model.cfg, SpeechTokens.from_record(gen["speech"])
    hf_model = load_transformers_model(src, speech=True)
    features = np.random.default_rng(3).standard_normal((2, 80, 3000)).astype(np.float32)
    options = dict(temperature=(0.0, 0.5), logprob_threshold=0.0)
    for row in range(2):
        torch.manual_seed(9)
        with torch.inference_mode():
            want = hf_model.generate(input_features=torch.as_tensor(features[row: row + 1]), language="en",
                                     task="transcribe", max_new_tokens=NEW, **options)
        calls, patch = counting_decodes()
        with patch:
            got, = transcribe(step_model, cfg, speech, [features[row]], language="en", task="transcribe",
                              max_new_tokens=NEW, generation=gen, seed=9, **options)
        assert [t for _, t, _ in calls] == [0.0, 0.5]
        assert got.tokens == [t for t in want[0].tolist() if t != cfg.eos_id], want


def test_compression_ratio_is_transformers():
    from transformers import WhisperForConditionalGeneration

    for tokens in ([5, 6, 7, 5, 6, 7, 5, 6, 7, 100], list(range(1600))):
        assert compression_ratio(tokens, 1609) == \
            WhisperForConditionalGeneration._retrieve_compression_ratio(torch.tensor(tokens), 1609)


@pytest.mark.parametrize("option,value,message", [
    ("temperature", -0.1, "temperature must be a number >= 0"),
    ("temperature", (), "temperature must be"),
    ("compression_ratio_threshold", 0.0, "compression_ratio_threshold must be a number > 0"),
    ("logprob_threshold", float("nan"), "logprob_threshold must be a number"),
    ("seed", -1, r"seed must be an integer in \[0, 2\*\*64\)"),
    ("seed", 99999999999999999999999, r"seed must be an integer in \[0, 2\*\*64\)"),  # was an OverflowError
    ("temperature", 1e-45, "smallest normal float32"),  # subnormal: every score / T overflowed float32
    ("condition_on_prev_tokens", "yes", "condition_on_prev_tokens must be true or false"),
    ("no_speech_threshold", 0.6, "no_speech_threshold is not supported"),
])
def test_bad_values_are_refused(models, option, value, message):
    step_model, cfg, speech, gen, _ = models
    with pytest.raises(InputError, match=message):
        transcribe(step_model, cfg, speech, [np.zeros((80, 3000), np.float32)], language="en", **{option: value})
