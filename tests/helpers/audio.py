"""Test audio made here, never downloaded: synthetic signals and speech spoken by espeak-ng."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

SENTENCES = ["The quick brown fox jumps over the lazy dog.",
             "Speech goes in and log mel features come out of the graph.",
             "One two three four five six seven eight nine ten."]


def synthetic(kind: str, rate: int = 16000, seconds: float = 2.0, seed: int = 0) -> np.ndarray:
    """float32 mono samples of one kind of signal: silence, a 440 Hz tone, white noise, a clipped 1 kHz tone."""
    t = np.arange(int(rate * seconds)) / rate
    if kind == "silence":
        x = np.zeros_like(t)
    elif kind == "tone":
        x = 0.5 * np.sin(2 * np.pi * 440 * t)
    elif kind == "noise":
        x = 0.1 * np.random.RandomState(seed).randn(t.size)
    elif kind == "clipping":
        x = np.clip(3.0 * np.sin(2 * np.pi * 1000 * t), -1.0, 1.0)
    else:
        raise ValueError(kind)
    return x.astype(np.float32)


def speak(folder: Path, text: str, name: str = "speech.wav") -> Path:
    """A WAV file of `text` spoken by espeak-ng (22050 Hz mono). Fails, never skips, when espeak-ng is missing."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        pytest.fail("espeak-ng is not installed; apt-get install espeak-ng (the speech tests need it)")
    out = Path(folder) / name
    subprocess.run([exe, "-w", str(out), text], check=True, capture_output=True)
    return out


# --- Whisper: a tokenizer, a checkpoint and transformers' transcription, for the transcribe tests -----------------

WHISPER_SPECIAL = ("<|startoftranscript|>", "<|en|>", "<|de|>", "<|fr|>", "<|translate|>", "<|transcribe|>",
                   "<|notimestamps|>")  # ids 101 .. 107, as helpers.hf_models.WHISPER_IDS


def whisper_tokenizer(folder: Path, timestamps: int = 0) -> Path:
    """A tiny byte-level BPE WhisperTokenizer saved into `folder` (a transformers Whisper's directory, before its
    import): ordinary ids 0 .. 99 (printable ASCII 32 .. 126, then five merges), <|endoftext|> 100, the special tokens
    of WHISPER_SPECIAL at 101 .. 107, then `timestamps` tokens <|0.00|>, <|0.02|>, ... (ids as hf_models'
    whisper_model_dir(timestamps=N) lays them out)."""
    import json

    from transformers import WhisperTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # (4.x and 5.x alike)

    byte_chars = bytes_to_unicode()
    merges = [("Ġ", "t"), ("Ġt", "h"), ("Ġth", "e"), ("h", "e"), ("i", "n")]
    tokens = [byte_chars[b] for b in range(32, 127)] + ["".join(m) for m in merges]
    vocab = {**{t: i for i, t in enumerate(tokens)}, "<|endoftext|>": len(tokens)}
    folder = Path(folder)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    end = "<|endoftext|>"
    tokenizer = WhisperTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), unk_token=end,
                                 bos_token=end, eos_token=end, pad_token=end)
    tokenizer.add_special_tokens({"additional_special_tokens": list(WHISPER_SPECIAL)})
    if timestamps:
        tokenizer.add_tokens([f"<|{i * 0.02:.2f}|>" for i in range(timestamps)])
    tokenizer.save_pretrained(folder)
    return folder


STAMPS = 1501  # a released checkpoint's timestamp tokens: <|0.00|> .. <|30.00|>


def whisper_source(path: Path, timestamps: int = STAMPS, suppress_timestamps: bool = False, **kwargs) -> Path:
    """A random transformers Whisper (hf_models.whisper_model_dir with `timestamps` timestamp tokens and `kwargs`)
    with the files an import copies beside it: the tokenizer of `whisper_tokenizer` and the default feature extractor
    at its mel bins. `suppress_timestamps`: the timestamps join suppress_tokens (config and generation config), so
    that a random model never emits one where no timestamps are asked for: transformers' generate would cut the
    decode at them and re-seek inside the window even for a short clip (its long-form loop runs for every input)."""
    from transformers import WhisperFeatureExtractor

    from helpers.hf_models import WHISPER_IDS, WHISPER_SMALL, whisper_model_dir

    config = dict(kwargs.pop("config", None) or {})
    if suppress_timestamps:
        begin = WHISPER_IDS["no_timestamps"] + 1
        config["suppress_tokens"] = [*WHISPER_SMALL["suppress_tokens"], *range(begin, begin + timestamps)]
    src = whisper_model_dir(path, config=config, timestamps=timestamps, **kwargs)
    whisper_tokenizer(src, timestamps)
    WhisperFeatureExtractor(feature_size=config.get("num_mel_bins", WHISPER_SMALL["num_mel_bins"])).save_pretrained(src)
    return Path(src)


def whisper_checkpoint(src: Path, out: Path) -> Path:
    """`seq2trt import hf SRC -o OUT` itself, its proof against transformers included: a checkpoint the tests use
    is one the import accepted (a layout the proof could not follow once slipped through a copy that skipped it)."""
    import seq2trt

    seq2trt.import_hf(Path(src), Path(out))
    return Path(out)


def judge_clip(path: Path) -> np.ndarray:
    """A file as Whisper's users load it, independently of seq2trt: soundfile, the channels' mean, soxr HQ to
    16 kHz."""
    import soundfile
    import soxr

    samples, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    mono = samples.mean(axis=1)
    return (soxr.resample(mono, rate, 16000, quality="HQ") if rate != 16000 else mono).astype(np.float32)


def generate_tokens(hf_model, src: Path, clips, language: str | None, beams: int, max_new_tokens: int):
    """(tokens, languages): transformers' transcription of 16 kHz clips, the judge: WhisperFeatureExtractor's
    input_features, then generate(language=..., task="transcribe") (language None: detected per clip); the tokens
    after the start token and its prompt of three (language, task, <|notimestamps|>), up to eos, and each clip's
    language as transformers' detect_language finds it (or the one given)."""
    import torch
    from transformers import WhisperFeatureExtractor

    from seq2trt.hf_import.speech_proof import whisper_generated

    fe = WhisperFeatureExtractor.from_pretrained(str(src))
    features = torch.as_tensor(fe(list(clips), sampling_rate=16000, return_tensors="np")["input_features"])
    with torch.inference_mode():
        out = hf_model.generate(input_features=features, language=language, task="transcribe", num_beams=beams,
                                max_new_tokens=max_new_tokens, return_dict_in_generate=True)
        detected = None if language is not None else hf_model.detect_language(input_features=features).tolist()
    by_id = {v: k.strip("<|>") for k, v in hf_model.generation_config.lang_to_id.items()}
    languages = [language] * len(clips) if language is not None else [by_id[i] for i in detected]
    return whisper_generated(out.sequences, 3, hf_model.generation_config.eos_token_id), languages
