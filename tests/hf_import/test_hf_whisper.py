"""`seq2trt import hf` of Whisper: small random models made with transformers' `WhisperConfig` (80 and 128 mel bins,
multilingual and English-only, unequal stacks), imported, then judged by transformers itself: encoder states from
the conv front end, the step logits of greedy search, greedy and beam-4 tokens of its `generate(input_features,
language, task)` with the prompt, and the language its `detect_language` finds. Also what is refused.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")

from seq2trt.cli.main import cli  # noqa: E402
from seq2trt.reference_model.checkpoint import load_checkpoint  # noqa: E402
from seq2trt.reference_model.eager import EagerStepModel  # noqa: E402
from seq2trt.core.errors import ConfigError, InputError  # noqa: E402
from seq2trt.hf_import.importer import config_from_hf, load_hf_as_model  # noqa: E402
from seq2trt.hf_import.proof import load_transformers_model
from seq2trt.hf_import.speech_proof import whisper_generated  # noqa: E402
from seq2trt.reference_model.sources import AudioFeatures, source_kind  # noqa: E402
from seq2trt.reference_model.speech import SpeechTokens, transcribe_features  # noqa: E402

from helpers.hf_models import WHISPER_IDS, whisper_model_dir  # noqa: E402

CASES = {
    "multilingual-80": dict(config={}, multilingual=True),
    "english-only-80": dict(config={}, multilingual=False),
    "multilingual-128-unequal": dict(config=dict(num_mel_bins=128, encoder_layers=3, decoder_layers=1, d_model=48,
                                                 encoder_attention_heads=6, decoder_attention_heads=6),
                                     multilingual=True),
    # No max_length of its own: generate's library default (20 new tokens; transformers 5 leaves it unset in the
    # model's generation config) is not the model's, and the import reads no limit (it was refused under 5.x).
    "no-max-length": dict(config={}, multilingual=True, generation=dict(max_length=None)),
}


@pytest.mark.parametrize("case", CASES)
def test_import_equals_transformers(tmp_path, case):
    src = whisper_model_dir(tmp_path / "hf", **CASES[case])
    result = CliRunner().invoke(cli, ["import", "hf", str(src), "-o", str(tmp_path / "ckpt")])
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "ckpt" / "import.json").read_text())
    proof = record["verification"]["seeded"]
    assert record["verification"]["passed"] and proof["greedy_equal"] == proof["beam_equal"] == proof["sources"]
    assert proof["logits_scaled_err"] <= 1e-4 and proof["step_logits_compared"] > 0
    model, _ = load_checkpoint(tmp_path / "ckpt")
    assert model.cfg.audio and model.cfg.n_mels == CASES[case]["config"].get("num_mel_bins", 80)
    speech = json.loads((tmp_path / "ckpt" / "generation.json").read_text())["speech"]
    assert speech["multilingual"] is CASES[case]["multilingual"]
    assert speech["no_timestamps_id"] == WHISPER_IDS["no_timestamps"]
    assert model.cfg.max_new_tokens == (None if case == "no-max-length" else 447)


def test_detected_language_and_prompted_tokens_equal_generate(tmp_path):
    """No language given: ours detects one per row as transformers does, and decodes each row with its own prompt;
    the tokens equal generate(input_features) with no language (its own detection and per-row prompts)."""
    src = whisper_model_dir(tmp_path / "hf", seed=3)
    _, model, gen, _ = load_hf_as_model(src)
    hf_model = load_transformers_model(src, speech=True)
    features = np.stack(source_kind(model.cfg).random(np.random.default_rng(5), 6))
    speech = SpeechTokens.from_record(gen["speech"])
    languages: list = []
    ours = transcribe_features(EagerStepModel(model), model.cfg, speech, features, max_new_tokens=12,
                               generation=gen, languages_out=languages)
    with torch.inference_mode():
        detected = hf_model.detect_language(input_features=torch.as_tensor(features)).tolist()
        theirs = hf_model.generate(input_features=torch.as_tensor(features), max_new_tokens=12, task="transcribe",
                                   return_dict_in_generate=True).sequences
    by_id = {i: c for c, i in speech.languages.items()}
    assert languages == [by_id[i] for i in detected]
    assert ours == whisper_generated(theirs, 3, WHISPER_IDS["eot"])  # language, task, <|notimestamps|>


def test_begin_suppress_tokens_hold_at_the_first_token_only(tmp_path):
    """begin_suppress_tokens becomes begin_suppress_ids: never the first generated token, allowed after it."""
    src = whisper_model_dir(tmp_path / "hf")
    _, cfg, _ = config_from_hf(src)
    assert cfg.begin_suppress_ids == (7, WHISPER_IDS["eot"]) and cfg.suppress_ids == (1, 2)
    assert cfg.pad_id == cfg.eos_id == WHISPER_IDS["eot"]  # allowed: an audio source is never padded with ids


def test_features_of_the_wrong_shape_are_refused(tmp_path):
    src = whisper_model_dir(tmp_path / "hf")
    _, model, _, _ = load_hf_as_model(src)
    kind = source_kind(model.cfg)
    assert isinstance(kind, AudioFeatures)
    with pytest.raises(InputError, match=r"\(batch, 80, 3000\)"):
        model.encode(torch.zeros(1, 80, 2000), torch.ones(1, 1500, dtype=torch.int64))
    with pytest.raises(InputError, match="shape"):
        kind.check([np.zeros((80, 100), np.float32)], 0, "", "source")
    with pytest.raises(InputError, match="NaN"):
        kind.check([np.full((80, 3000), np.nan, np.float32)], 0, "", "source")


def test_language_and_task_are_checked(tmp_path):
    src = whisper_model_dir(tmp_path / "hf", multilingual=False)
    _, _, gen = config_from_hf(src)
    english = SpeechTokens.from_record(gen["speech"])
    with pytest.raises(InputError, match="English-only"):
        english.check_language("de")
    with pytest.raises(InputError, match="English-only"):
        english.check_task("translate")
    multi = SpeechTokens.from_record(config_from_hf(whisper_model_dir(tmp_path / "multi"))[2]["speech"])
    with pytest.raises(InputError, match="unknown language 'xx'; this model knows 3"):
        multi.check_language("xx")
    assert multi.prompt("fr", "translate") == (104, WHISPER_IDS["translate"], WHISPER_IDS["no_timestamps"])


def test_multilingual_without_language_tables_is_refused(tmp_path):
    src = whisper_model_dir(tmp_path / "hf", generation=dict(lang_to_id=None, task_to_id=None))
    with pytest.raises(ConfigError, match="multilingual Whisper needs lang_to_id"):
        config_from_hf(src)


def test_scale_embedding_is_refused_by_name(tmp_path):
    src = whisper_model_dir(tmp_path / "hf", config=dict(scale_embedding=True))
    with pytest.raises(ConfigError, match="scale_embedding"):
        config_from_hf(src)


def test_transcribe_without_timestamp_tokens(tmp_path):
    """A model whose vocabulary has no timestamp tokens transcribes 30 s clips (one window each, one segment) as
    transformers' generate does; only timestamps and clips past 30 s need those tokens."""
    from seq2trt.reference_model.longform import transcribe

    src = whisper_model_dir(tmp_path / "hf", seed=2)
    _, model, gen, _ = load_hf_as_model(src)
    features = source_kind(model.cfg).random(np.random.default_rng(1), 3)
    speech = SpeechTokens.from_record(gen["speech"])
    found = transcribe(EagerStepModel(model), model.cfg, speech, features, language="en", max_new_tokens=10,
                       generation=gen)
    hf_model = load_transformers_model(src, speech=True)
    with torch.inference_mode():
        theirs = hf_model.generate(input_features=torch.as_tensor(np.stack(features)), max_new_tokens=10,
                                   language="en", task="transcribe", return_dict_in_generate=True).sequences
    assert [t.tokens for t in found] == whisper_generated(theirs, 3, WHISPER_IDS["eot"])
    assert all(len(t.segments) == 1 and t.segments[0].start == 0.0 and t.language == "en" for t in found)
    with pytest.raises(ConfigError, match="timestamp"):
        transcribe(EagerStepModel(model), model.cfg, speech, features[:1], timestamps=True, generation=gen)


def test_released_layout_that_emits_timestamps_imports_and_transcribes_as_generate(tmp_path):
    """A Whisper laid out like every released checkpoint (1,501 timestamp tokens, max_initial_timestamp_index 50)
    whose random weights emit timestamp pairs without --timestamps: transformers' generate then cuts the decode at
    the last pair and decodes the rest of the 30 s window again (its long-form loop runs for short inputs too). The
    import's proof follows it (it crashed with an IndexError), and transcribe without timestamps returns generate's
    own tokens, every re-seek included (it returned the first window's decode)."""
    from seq2trt.reference_model.longform import transcribe

    from helpers.audio import whisper_source

    src = whisper_source(tmp_path / "hf", generation=dict(max_initial_timestamp_index=50))
    result = CliRunner().invoke(cli, ["import", "hf", str(src), "-o", str(tmp_path / "ckpt")])
    assert result.exit_code == 0, result.output
    proof = json.loads((tmp_path / "ckpt" / "import.json").read_text())["verification"]
    assert proof["passed"] and proof["seeded"]["greedy_equal"] == proof["seeded"]["sources"]
    model, _ = load_checkpoint(tmp_path / "ckpt")
    gen = json.loads((tmp_path / "ckpt" / "generation.json").read_text())
    features = source_kind(model.cfg).random(np.random.default_rng(0), 3)
    ours = transcribe(EagerStepModel(model), model.cfg, SpeechTokens.from_record(gen["speech"]), features,
                      language="en", max_new_tokens=24, generation=gen)
    hf_model = load_transformers_model(src, speech=True)
    with torch.inference_mode():  # the plain output: every re-seek's tokens (return_dict keeps the last call's)
        theirs = hf_model.generate(input_features=torch.as_tensor(np.stack(features)), max_new_tokens=24,
                                   language="en", task="transcribe").tolist()
    eot, begin = WHISPER_IDS["eot"], WHISPER_IDS["no_timestamps"] + 1
    theirs = [row[: row.index(eot)] if eot in row else row for row in theirs]
    assert any(len(row) > 24 for row in theirs), "no row re-seeked: the case is not exercised"
    assert [t.tokens for t in ours] == theirs
    assert all(len(t.segments) == 1 and t.segments[0].start == 0.0 for t in ours)
    assert any(tok >= begin for t in ours for tok in t.tokens)


@pytest.mark.parametrize("damage, fragment", [
    (lambda path: path.write_text("{not json"), "cannot be read"),
    (lambda path: path.write_text(json.dumps({**json.loads(path.read_text()), "sampling_rate": 8000})),
     "sampling_rate 8000"),
    (lambda path: path.write_text(json.dumps({**json.loads(path.read_text()), "n_fft": 0})), "n_fft"),
    (lambda path: path.write_text(json.dumps({**json.loads(path.read_text()), "feature_size": 128})),
     "the model reads (80, 3000)"),
])
def test_a_damaged_feature_extractor_is_refused_at_import(tmp_path, damage, fragment):
    """preprocessor_config.json was copied unchecked: the import said "equal to transformers" and the checkpoint
    could not transcribe (and "re-import" copied the same file again). It is now checked against the model."""
    from transformers import WhisperFeatureExtractor

    from helpers.cli import one_error_line

    src = whisper_model_dir(tmp_path / "hf")
    WhisperFeatureExtractor(feature_size=80).save_pretrained(src)
    damage(src / "preprocessor_config.json")
    line = one_error_line(CliRunner().invoke(cli, ["import", "hf", str(src), "-o", str(tmp_path / "ckpt")]), 2,
                          "preprocessor_config.json", fragment)
    assert "re-import" not in line
    assert not (tmp_path / "ckpt").exists()


def test_a_feature_extractor_without_a_tokenizer_imports(tmp_path):
    """preprocessor_config.json alone was taken for tokenizer files that cannot load, and the advice "remove them"
    would have deleted the feature extractor's settings: it is no tokenizer, and is kept."""
    from transformers import WhisperFeatureExtractor

    src = whisper_model_dir(tmp_path / "hf")
    WhisperFeatureExtractor(feature_size=80).save_pretrained(src)
    result = CliRunner().invoke(cli, ["import", "hf", str(src), "-o", str(tmp_path / "ckpt")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "ckpt" / "tokenizer" / "preprocessor_config.json").is_file()


def test_no_speech_threshold_in_the_generation_config_is_named_at_import(tmp_path):
    """The import ran transformers' generate with it, which failed (UnboundLocalError: logprobs, without a
    logprob_threshold) and was reported as transformers' own model failing on the source."""
    src = whisper_model_dir(tmp_path / "hf", generation=dict(no_speech_threshold=0.6))
    with pytest.raises(ConfigError, match="generation_config.json: no_speech_threshold 0.6 is not supported.*remove it"):
        config_from_hf(src)


def test_the_import_holds_one_model_at_a_time(tmp_path, monkeypatch):
    """A speech model's proof runs transformers' side first and frees its model before ours is built (a
    whisper-large-v3 is 6 GB of fp32 weights a copy): when our model starts loading, transformers' is gone."""
    from helpers.hf_models import import_watching_models

    src = whisper_model_dir(tmp_path / "hf", config={}, multilingual=True)
    record, alive = import_watching_models(src, tmp_path / "ckpt", monkeypatch)
    assert alive == [[False]] and record["verification"]["passed"]
