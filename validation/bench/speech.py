"""`seq2trt bench` on a Whisper export: real-time factor and tokens/s of our step-model backends against what users
of the Hugging Face directory run today (transformers' `WhisperForConditionalGeneration.generate`, Optimum's
`ORTModelForSpeechSeq2Seq`, CTranslate2's `models.Whisper`), with the front end timed on its own.

Inputs: deterministic synthetic clips of each asked length (`synthetic_clip`: a random model needs no real speech),
turned into features once by the export's features.onnx; every backend decodes those same features with the same
prompt (reference_model/speech.py: start, language, task, <|notimestamps|>) and exactly `new_tokens` tokens a row:
min_new_tokens = max_new_tokens for our loops and generate, eos suppressed and max_length = 2 x new_tokens for
CTranslate2 (its Whisper generates max_length / 2 tokens at most). The front ends (features.onnx on ONNX Runtime,
transformers' WhisperFeatureExtractor) are timed on the same clips in the same repetitions. Before timing, every
backend's greedy tokens on the bench features are compared with the eager model's; a baseline that disagrees
(near-ties aside) stops the bench. Backends and front ends run round-robin within each repetition, the starting one
rotating; ratios are medians of per-repetition paired ratios (measure.py's rule). Figures: benchmarks/README.md.
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from seq2trt.core.errors import CheckFailed, InputError
from seq2trt.runtime import registry

from seq2trt.validation.bench.backends import start_turn

logger = logging.getLogger(__name__)

RATE = 16000
DEFAULT_CLIPS = (10.0, 30.0)
BASELINES = registry.BASELINES  # prepared and checked before they are timed
FLOAT_BASELINES = tuple(n for n in BASELINES if not registry.BACKENDS[n].int8)  # a disagreement stops the bench
REFERENCES = (*FLOAT_BASELINES, "eager")  # each gets a vs_<name> ratio when it ran
OPTIMUM_DIR, OPTIMUM_TASK = "optimum-speech", "automatic-speech-recognition-with-past"
CT2_DIR = Path("ct2") / "whisper-float32"


def is_speech(cfg) -> bool:
    from seq2trt.reference_model.sources import AudioFeatures, source_kind

    return isinstance(source_kind(cfg), AudioFeatures)


def check_backends(names: tuple[str, ...]) -> None:
    """Refuse a backend the speech bench cannot time: a whole-search graph (generate.onnx reads token ids)."""
    bad = [n for n in names if registry.BACKENDS[n].whole_search]
    if bad:
        fit = [n for n, b in registry.BACKENDS.items() if not b.whole_search]
        raise InputError(f"{', '.join(bad)} cannot bench a Whisper export (generate.onnx reads token ids); choose from "
                         f"{', '.join(fit)}")


def synthetic_clip(seconds: float, seed: int) -> np.ndarray:
    """float32 16 kHz samples shaped like speech, deterministic: harmonics of a pitch gliding around 100-200 Hz under
    a syllable-rate (4 Hz) envelope, with seeded noise at -30 dB."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(RATE * seconds)) / RATE
    f0 = 140 + 40 * np.sin(2 * np.pi * (0.3 + 0.1 * rng.random()) * t)
    phase = 2 * np.pi * np.cumsum(f0) / RATE
    voiced = sum(np.sin(k * phase) / k for k in range(1, 8))
    envelope = 0.5 * (1 + np.sin(2 * np.pi * 4 * t + rng.uniform(0, 2 * np.pi))) ** 2
    x = 0.2 * envelope * voiced + 0.01 * rng.standard_normal(t.size)
    return x.astype(np.float32)


@dataclass(frozen=True)
class Work:
    """What every backend decodes: the prompt after the start token, exactly `new_tokens`, `beam` beams."""

    bos_id: int
    eos_id: int
    prompt: tuple[int, ...]
    language: str | None
    task: str | None
    new_tokens: int
    beam: int
    length_penalty: float

    def settings(self, cfg, generation: dict | None):
        from seq2trt.reference_model.decoding import DecodeSettings

        return replace(DecodeSettings.for_model(cfg, self.new_tokens, generation), prompt=self.prompt,
                       min_new_tokens=self.new_tokens)


def _checked(name: str, tokens: list[list[int]], rows: int, work: Work) -> list[list[int]]:
    if len(tokens) != rows or any(len(t) != work.new_tokens for t in tokens):
        raise CheckFailed(f"{name} returned {len(tokens)} rows of lengths {sorted({len(t) for t in tokens})}, not "
                          f"{rows} of {work.new_tokens} tokens; its time would not be comparable")
    return tokens


class OursBackend:
    """A step model (eager, ONNX Runtime, TensorRT) under the searches transcription runs."""

    front_end = "features.onnx"

    def __init__(self, name, model, cfg, generation, threads, closers=()):
        import torch

        self.name, self.model, self.cfg, self.generation, self.threads = name, model, cfg, generation, threads
        self._closers, self._set_threads = list(closers), torch.set_num_threads

    def activate(self) -> None:
        start_turn(self.threads, self._set_threads)

    def decode(self, features: np.ndarray, work: Work, beam: int) -> tuple[float, list[list[int]]]:
        from seq2trt.reference_model.decoding import greedy_decode, hf_beam_search

        settings = work.settings(self.cfg, self.generation)
        mask = np.ones((len(features), self.cfg.max_src_len), dtype=np.int64)
        start = time.perf_counter()
        if beam == 1:
            tokens = greedy_decode(self.model, features, mask, settings)
        else:
            tokens = hf_beam_search(self.model, features, mask, settings, beam, work.length_penalty, False)
        return time.perf_counter() - start, _checked(self.name, tokens, len(features), work)

    def close(self) -> None:
        for close in self._closers:
            close()


class GenerateBackend:
    """transformers' or Optimum's Whisper `generate(input_features, language, task)` in this process."""

    front_end = "extractor"

    def __init__(self, name, model, threads, set_threads=None):
        self.name, self.model, self.threads, self._set_threads = name, model, threads, set_threads

    def activate(self) -> None:
        start_turn(self.threads, self._set_threads)

    def decode(self, features: np.ndarray, work: Work, beam: int) -> tuple[float, list[list[int]]]:
        import torch
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # generate warns on every call that the processors came from the config
        options = {k: v for k, v in (("language", work.language), ("task", work.task)) if v is not None}
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            start = time.perf_counter()
            out = self.model.generate(input_features=torch.as_tensor(features), num_beams=beam,
                                      length_penalty=work.length_penalty, max_new_tokens=work.new_tokens,
                                      min_new_tokens=work.new_tokens, return_dict_in_generate=True, **options)
            seconds = time.perf_counter() - start
        head = out.sequences[:, : 1 + len(work.prompt)].tolist()
        if any(row != [work.bos_id, *work.prompt] for row in head):
            raise CheckFailed(f"{self.name} decoded after the prompt {head[0]}, not ours "
                              f"{[work.bos_id, *work.prompt]}; its time would not be comparable")
        return seconds, _checked(self.name, out.sequences[:, 1 + len(work.prompt):].tolist(), len(features), work)

    def close(self) -> None:
        self.model = None


class Ct2WhisperBackend:
    """CTranslate2's `models.Whisper` in this process (one model: the one-per-process rule is about two)."""

    front_end = "extractor"

    def __init__(self, name, model_dir: Path, threads: int, compute_type: str):
        from seq2trt.validation.bench.ct2_baseline import import_ctranslate2

        ct2 = import_ctranslate2()
        self.name, self.threads, self._ct2 = name, threads, ct2
        self.model = ct2.models.Whisper(str(model_dir), device="cpu", compute_type=compute_type, inter_threads=1,
                                        intra_threads=threads)

    def activate(self) -> None:
        start_turn(self.threads)

    def decode(self, features: np.ndarray, work: Work, beam: int) -> tuple[float, list[list[int]]]:
        view = self._ct2.StorageView.from_array(np.ascontiguousarray(features, dtype=np.float32))
        start = time.perf_counter()
        results = self.model.generate(view, [[work.bos_id, *work.prompt]] * len(features), beam_size=beam,
                                      length_penalty=work.length_penalty, max_length=2 * work.new_tokens,
                                      suppress_tokens=[-1, work.eos_id], suppress_blank=True)
        seconds = time.perf_counter() - start
        return seconds, _checked(self.name, [r.sequences_ids[0] for r in results], len(features), work)

    def close(self) -> None:
        self.model = None
