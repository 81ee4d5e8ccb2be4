"""`seq2trt transcribe`, judged by transformers: a small random Whisper (with a tiny WhisperTokenizer and the default
feature extractor saved beside it) transcribes speech spoken by espeak-ng and synthetic signals (a tone at 8 kHz, a
44.1 kHz stereo FLAC); its tokens equal `WhisperForConditionalGeneration.generate` on `WhisperFeatureExtractor`'s
features of the same audio (greedy and beam 4, language given and detected), its text the tokenizer's decoding of
them. Also the output formats, a checkpoint without tokenizer files, and what is refused.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import soundfile as sf

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")

# save_pretrained of a Whisper whose config.json names suppress_tokens: transformers' note, not a problem here
pytestmark = pytest.mark.filterwarnings("ignore:Moving the following attributes:UserWarning")

from helpers.audio import (SENTENCES, generate_tokens, judge_clip, speak, synthetic,  # noqa: E402
                           whisper_checkpoint, whisper_source)
from helpers.hf_models import WHISPER_IDS  # noqa: E402
from helpers.cli import invoke, one_error_line  # noqa: E402

MAX_NEW = 12


@pytest.fixture(scope="module")
def whisper(whisper_imported):
    """(transformers source directory, its checkpoint, transformers' model of it)."""
    from seq2trt.hf_import.proof import load_transformers_model

    src, ckpt = whisper_imported
    return src, ckpt, load_transformers_model(src, speech=True)


@pytest.fixture(scope="module")
def audio(speech_files):
    """Speech at espeak-ng's 22.05 kHz, a tone at 8 kHz (WAV) and noise + tone at 44.1 kHz stereo (FLAC)."""
    return [speech_files[name] for name in ("fox", "numbers", "tone-8k", "stereo")]


def stdout_of(*args) -> str:
    """`seq2trt ARGS...`, which must exit 0: its standard output alone (progress goes to stderr)."""
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    return result.stdout


def json_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


@pytest.mark.parametrize("beams", [1, 4], ids=["greedy", "beam4"])
@pytest.mark.parametrize("language", ["de", None], ids=["given", "detected"])
def test_tokens_equal_transformers_generate(whisper, audio, beams, language):
    src, ckpt, hf_model = whisper
    audio = audio if beams == 1 else [audio[0], audio[3]]  # beam on speech and the 44.1 kHz stereo file
    flags = ["--language", language] if language else []
    result = invoke("transcribe", ckpt, *audio, "--format", "json", "--beam-size", beams, "--max-new-tokens", MAX_NEW,
                    *flags)
    assert result.exit_code == 0, result.output
    rows = json_lines(result.stdout)
    want, languages = generate_tokens(hf_model, src, [judge_clip(a) for a in audio], language, beams, MAX_NEW)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(src))
    assert [r["file"] for r in rows] == [str(a) for a in audio]
    assert [r["tokens"] for r in rows] == want
    assert [r["language"] for r in rows] == languages
    assert [r["text"] for r in rows] == [tokenizer.decode(t, skip_special_tokens=True) for t in want]
    assert "transcribing" in result.stderr  # progress on stderr for many files, none on stdout


def test_formats_and_output_ids(whisper, audio, tmp_path):
    src, ckpt, _ = whisper
    one = audio[0]
    row = json_lines(stdout_of("transcribe", ckpt, one, "--format", "json", "--max-new-tokens", MAX_NEW))[0]
    duration = sf.info(str(one)).frames / sf.info(str(one)).samplerate
    assert row["segments"] == [{"start": 0.0, "end": round(duration, 3), "text": row["text"], "tokens": row["tokens"]}]
    text = stdout_of("transcribe", ckpt, one, "--max-new-tokens", MAX_NEW, "--output-ids", tmp_path / "ids.jsonl")
    assert text == row["text"] + "\n"
    assert (tmp_path / "ids.jsonl").read_text() == json.dumps(row["tokens"]) + "\n"
    ms = round(duration * 1000)
    clock = f"00:00:{ms // 1000:02d}{{}}{ms % 1000:03d}"
    srt = stdout_of("transcribe", ckpt, one, "--max-new-tokens", MAX_NEW, "--format", "srt")
    assert srt == f"1\n00:00:00,000 --> {clock.format(',')}\n{row['text'].strip()}\n\n"
    vtt = stdout_of("transcribe", ckpt, one, "--max-new-tokens", MAX_NEW, "--format", "vtt")
    assert vtt == f"WEBVTT\n\n00:00:00.000 --> {clock.format('.')}\n{row['text'].strip()}\n\n"


@pytest.mark.parametrize("keep", ["preprocessor_config", "nothing"])
def test_without_tokenizer_files_ids_are_printed(whisper, audio, tmp_path, keep):
    """Without a vocabulary the ids are printed (the extractor's defaults stand in for a missing
    preprocessor_config.json: the same features)."""
    src, ckpt, hf_model = whisper
    bare = tmp_path / "ckpt"
    shutil.copytree(ckpt, bare)
    for path in (bare / "tokenizer").iterdir():
        if not (keep == "preprocessor_config" and path.name in ("preprocessor_config.json", "config.json")):
            path.unlink()
    if keep == "nothing":
        (bare / "tokenizer").rmdir()
    out = stdout_of("transcribe", bare, audio[0], "--max-new-tokens", MAX_NEW, "--language", "en")
    want, _ = generate_tokens(hf_model, src, [judge_clip(audio[0])], "en", 1, MAX_NEW)
    assert [json.loads(line) for line in out.splitlines()] == want
    row = json_lines(stdout_of("transcribe", bare, audio[0], "--format", "json", "--max-new-tokens", MAX_NEW,
                               "--language", "en"))[0]
    assert row["text"] is None and row["tokens"] == want[0]


@pytest.fixture(scope="module")
def english_only(tmp_path_factory):
    root = tmp_path_factory.mktemp("english")
    return whisper_checkpoint(whisper_source(root / "hf", multilingual=False, suppress_timestamps=True), root / "ckpt")


@pytest.fixture(scope="module")
def text_model(tmp_path_factory, make_model):
    from seq2trt.reference_model.checkpoint import save_checkpoint

    return save_checkpoint(tmp_path_factory.mktemp("text") / "ckpt", make_model(seed=1))


def test_english_only_model_transcribes_and_refuses_translate(english_only, audio, tmp_path):
    src = english_only.parent / "hf"
    from seq2trt.hf_import.proof import load_transformers_model

    hf_model = load_transformers_model(src, speech=True)
    row = json_lines(stdout_of("transcribe", english_only, audio[0], "--format", "json", "--max-new-tokens",
                               MAX_NEW))[0]
    import torch
    from seq2trt.hf_import.speech_proof import whisper_generated

    features = transformers.WhisperFeatureExtractor.from_pretrained(str(src))(
        [judge_clip(audio[0])], sampling_rate=16000, return_tensors="pt")["input_features"]
    with torch.inference_mode():
        out = hf_model.generate(input_features=features, max_new_tokens=MAX_NEW, return_dict_in_generate=True)
    assert row["tokens"] == whisper_generated(out.sequences, 1, 100)[0]  # prompt: <|notimestamps|>
    assert row["language"] == "en"
    one_error_line(invoke("transcribe", english_only, audio[0], "--task", "translate"), 2, "English-only",
                   "--task translate")
    one_error_line(invoke("transcribe", english_only, audio[0], "--language", "de"), 2, "English-only")


@pytest.fixture(scope="module")
def no_timestamps(tmp_path_factory):
    """A Whisper whose vocabulary ends at <|notimestamps|>."""
    root = tmp_path_factory.mktemp("no-timestamps")
    return whisper_checkpoint(whisper_source(root / "hf", timestamps=0), root / "ckpt")


def test_errors(whisper, audio, text_model, no_timestamps, tmp_path):
    """Each refusal is one error line, exit 2, and --output-ids is not written."""
    _, ckpt, _ = whisper
    sf.write(tmp_path / "long.wav", synthetic("tone", rate=8000, seconds=31.0), 8000)
    (tmp_path / "empty.wav").write_bytes(b"")
    (tmp_path / "corrupt.wav").write_bytes(b"RIFF" + bytes(range(256)) * 4)
    ids = tmp_path / "ids.jsonl"
    cases = [
        ((ckpt, tmp_path / "missing.wav"), ("missing.wav does not exist",)),
        ((ckpt, audio[0], tmp_path / "empty.wav"), ("empty.wav is empty",)),
        ((ckpt, tmp_path / "corrupt.wav"), ("corrupt.wav is corrupt",)),
        ((ckpt, audio[2], "--max-seconds", 1), ("over the limit of 1 s",)),
        ((ckpt, audio[0], "--language", "xx"), ("unknown language 'xx'", "knows 3")),
        ((ckpt, *audio[:2], "--format", "srt"), ("--format srt", "one AUDIO file")),
        ((ckpt, audio[0], "--max-new-tokens", 1000), ("--max-new-tokens 1000 does not fit", "decoder holds 448")),
        ((ckpt, audio[0], "--backend", "ort"), ("--backend ort runs exported graphs",)),
        ((text_model, audio[0]), ("reads token ids; use translate",)),
        ((no_timestamps, audio[0], "--timestamps"), ("no timestamp tokens",)),
        ((no_timestamps, audio[0], tmp_path / "long.wav"), ("no timestamp tokens", "at most 30 s")),
        ((ckpt, audio[0], "--temperature", "0,x"), ("--temperature must be a number or a comma list",)),
        ((ckpt, audio[0], "--temperature", "0,-0.2"), ("temperature must be a number >= 0",)),
        ((ckpt, audio[0], "--compression-ratio-threshold", 0), ("compression_ratio_threshold must be a number > 0",)),
        ((ckpt, audio[0], "--seed", -3), ("--seed", "must be an integer in [0, 2**64)",)),
        ((ckpt, audio[0], "--seed", "99999999999999999999999"), ("--seed", "must be an integer in [0, 2**64)",)),
    ]
    for args, fragments in cases:
        one_error_line(invoke("transcribe", *args, "--output-ids", ids), 2, *fragments)
        assert not ids.exists()
    before = audio[0].read_bytes()
    one_error_line(invoke("transcribe", ckpt, audio[0], "--output-ids", audio[0]), 2, "is the audio file")
    assert audio[0].read_bytes() == before
    one_error_line(invoke("translate", ckpt, "hello"), 2, "speech model", "seq2trt transcribe")
    assert invoke("transcribe", ckpt, audio[0], "--backend", "ort-generate").exit_code == 2  # not a choice


def test_backends_are_the_registry_step_model_backends():
    from seq2trt.cli.transcribe_commands import transcribe
    from seq2trt.runtime import registry

    param = next(p for p in transcribe.params if "--backend" in p.opts)
    assert tuple(param.type.choices) == registry.names(translate=True, whole_search=False)
    assert "ort-generate" not in param.type.choices and {"eager", "ort", "ort-fused", "tensorrt"} <= set(
        param.type.choices)


# --- timestamps and long-form ---------------------------------------------------------------------------------------

BEGIN = WHISPER_IDS["no_timestamps"] + 1  # <|0.00|>


@pytest.fixture(scope="module")
def timed(tmp_path_factory):
    """A random Whisper that emits timestamps freely (max_initial_timestamp_index 50, as released checkpoints), its
    checkpoint, transformers' model, and about 40 s of espeak-ng speech beside a short clip."""
    from seq2trt.hf_import.proof import load_transformers_model

    root = tmp_path_factory.mktemp("timed")
    src = whisper_source(root / "hf", generation=dict(max_initial_timestamp_index=50))
    long = speak(root, " ".join(SENTENCES * 4), "long.wav")
    assert 32 < sf.info(str(long)).duration < 70, sf.info(str(long)).duration
    return src, whisper_checkpoint(src, root / "ckpt"), load_transformers_model(src, speech=True), \
        [speak(root, SENTENCES[1], "short.wav"), long]


def hf_segments(hf_model, src, clip: np.ndarray, seed: int | None = None, **options) -> list[tuple]:
    """transformers' segments of one clip transcribed alone with timestamps: (start, end, text tokens); `options`:
    generate's long-form ones, under torch.manual_seed(`seed`) when given."""
    import torch

    fe = transformers.WhisperFeatureExtractor.from_pretrained(str(src))
    whole = dict(truncation=False, padding="longest") if len(clip) > fe.n_samples else {}
    features = fe([clip], sampling_rate=16000, return_tensors="pt", **whole)["input_features"]
    if seed is not None:
        torch.manual_seed(seed)
    with torch.inference_mode():
        out = hf_model.generate(input_features=features, return_timestamps=True, return_segments=True,
                                language="en", task="transcribe", max_new_tokens=MAX_NEW, **options)
    return [(round(float(s["start"]), 3), round(float(s["end"]), 3), [t for t in s["tokens"].tolist() if t < BEGIN])
            for s in out["segments"][0]]


def test_timestamps_and_long_form_equal_generate(timed):
    """--timestamps on a short clip, and a clip past 30 s (long-form: window by window from seek): every segment's
    start, end and tokens equal generate(return_timestamps=True, return_segments=True) on the clip alone; srt has a
    cue a segment."""
    src, ckpt, hf_model, files = timed
    rows = json_lines(stdout_of("transcribe", ckpt, *files, "--timestamps", "--language", "en", "--format", "json",
                                "--max-new-tokens", MAX_NEW))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(src))
    for path, row in zip(files, rows):
        want = hf_segments(hf_model, src, judge_clip(path))
        assert [(s["start"], s["end"], s["tokens"]) for s in row["segments"]] == want
        assert row["tokens"] == [t for _, _, tokens in want for t in tokens]
        assert [s["text"] for s in row["segments"]] == [tokenizer.decode(t, skip_special_tokens=True)
                                                        for _, _, t in want]
    assert len(rows[1]["segments"]) > 1 and rows[1]["segments"][-1]["end"] > 30.0
    srt = stdout_of("transcribe", ckpt, files[1], "--language", "en", "--format", "srt", "--max-new-tokens", MAX_NEW)
    assert srt.count(" --> ") == len(rows[1]["segments"])  # long-form decodes timestamps with or without the flag


def test_long_form_options_equal_generate(timed):
    """--condition-on-prev-tokens, --temperature 0,0.2,0.4 with --logprob-threshold 0 (an average log-probability
    is below 0 wherever a token is less than certain: every window falls back to the last temperature, sampled) and
    a --compression-ratio-threshold no ratio reaches, under --seed: the long clip's segments equal generate's with
    the same options after torch.manual_seed(seed)."""
    src, ckpt, hf_model, files = timed
    flags = ("--condition-on-prev-tokens", "--temperature", "0,0.2,0.4", "--logprob-threshold", 0,
             "--compression-ratio-threshold", 1e9)
    rows = json_lines(stdout_of("transcribe", ckpt, files[1], "--language", "en", "--format", "json",
                                "--max-new-tokens", MAX_NEW, "--seed", 7, *flags))
    want = hf_segments(hf_model, src, judge_clip(files[1]), seed=7, condition_on_prev_tokens=True,
                       temperature=(0.0, 0.2, 0.4), logprob_threshold=0.0, compression_ratio_threshold=1e9)
    assert [(s["start"], s["end"], s["tokens"]) for s in rows[0]["segments"]] == want
    assert want != hf_segments(hf_model, src, judge_clip(files[1]))  # the options change the transcription


def test_a_file_named_like_a_flag_gets_the_double_dash_hint(tmp_path):
    """click's "No such option: -d" gave no hint for a file named -dash.wav (translate's texts had one)."""
    one_error_line(invoke("transcribe", tmp_path, "-dash.wav"), 2, "No such option", "put `--` before the files",
                   "seq2trt transcribe MODEL -- -dash.wav")


def test_a_temperature_list_is_shown_as_given():
    """The refusal of --temperature -1 showed a Python tuple: "got (-1.0,)"."""
    from seq2trt.core.errors import InputError
    from seq2trt.reference_model.longform import WindowOptions

    with pytest.raises(InputError) as exc:
        WindowOptions.checked(temperature=(-1.0,))
    assert str(exc.value).endswith("got -1.0") and "(" not in str(exc.value).split("got")[-1]
    with pytest.raises(InputError, match=r"got 0.0,-0.2$"):
        WindowOptions.checked(temperature=(0.0, -0.2))
