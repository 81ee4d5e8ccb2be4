"""Whisper's decoding around the searches: the prompt, language detection, and transcription of feature batches.

The prompt after <|startoftranscript|> is <|lang|> <|task|> on a multilingual model, then <|notimestamps|> (when the
model has it and no timestamps are asked for); it is fed as one prefill and not returned (`DecodeSettings.prompt`).
With no language given, a multilingual model detects it as transformers' `WhisperForConditionalGeneration.
detect_language` does: one decoder step on <|startoftranscript|>, the argmax over the language tokens. Rows of one
batch whose languages differ are decoded in groups of one prompt each (rows are independent in every search, so
this gives transformers' per-row prompts). 448 positions hold the start token, the prompt and the generated tokens.

`SpeechTokens` is the checkpoint's generation.json "speech" record (written by the import from
generation_config.json: `hf_families.whisper`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from seq2trt.reference_model.decoding import DecodeSettings, StepModel, greedy_decode, hf_beam_search
from seq2trt.reference_model.errors import ConfigError, InputError

TASKS = ("transcribe", "translate")
SECONDS_PER_FRAME = 0.01  # the feature extractor's hop: 160 samples at 16 kHz


@dataclass(frozen=True)
class SpeechTokens:
    languages: Mapping[str, int]  # language code ("en") -> its token id
    tasks: Mapping[str, int]  # "transcribe" / "translate" -> id
    no_timestamps_id: int | None
    multilingual: bool
    default_language: str | None = None
    default_task: str | None = None
    max_initial_timestamp_index: int | None = None

    @classmethod
    def from_record(cls, record: Mapping[str, Any] | None) -> "SpeechTokens":
        if not record:
            raise ConfigError("this checkpoint holds no speech settings (generation.json has no \"speech\" record); "
                              "re-import the Whisper model with this version of seq2trt")
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in fields})

    def check_language(self, language: str | None) -> str | None:
        """`language` as a code this model has ("en"; "<|en|>" accepted), or None; refused on an English-only
        model unless it is English."""
        if language is None:
            return None
        code = language.strip().strip("<|>").lower()
        if not self.multilingual:
            if code not in ("en", "english"):
                raise InputError(f"this model is English-only: it cannot take language {language!r}; drop --language")
            return None
        if code not in self.languages:
            shown = ", ".join(sorted(self.languages)[:12]) + (" ..." if len(self.languages) > 12 else "")
            raise InputError(f"unknown language {language!r}; this model knows {len(self.languages)}: {shown}")
        return code

    def check_task(self, task: str | None) -> str | None:
        if task is None:
            return None
        if task not in TASKS:
            raise InputError(f"unknown task {task!r}; choose transcribe or translate")
        if not self.multilingual and task != "transcribe":
            raise InputError("this model is English-only: it only transcribes; drop --task translate")
        return task

    def prompt(self, language: str | None, task: str | None, timestamps: bool = False) -> tuple[int, ...]:
        """The ids after the start token: language and task on a multilingual model, then <|notimestamps|>."""
        ids: list[int] = []
        if self.multilingual:
            code = language or self.default_language
            if code is None:
                raise ConfigError("a multilingual model's prompt needs a language; detect it first")
            ids += [self.languages[code], self.tasks[task or self.default_task or "transcribe"]]
        if not timestamps and self.no_timestamps_id is not None:
            ids.append(self.no_timestamps_id)
        return tuple(ids)


def detect_languages(model: StepModel, encoder_state: Any, mask: np.ndarray, bos_id: int,
                     speech: SpeechTokens) -> list[str]:
    """Each row's language: one decoder step on the start token, the argmax over the language tokens."""
    codes = list(speech.languages)
    ids = np.asarray([speech.languages[c] for c in codes])
    logits, _ = model.step(np.full((len(mask), 1), bos_id, np.int64), mask, encoder_state,
                           model.empty_past(len(mask)))
    return [codes[i] for i in np.asarray(logits)[:, ids].argmax(-1)]


def generation_limit(cfg, prompt: Sequence[int], max_new_tokens: int | None) -> int:
    """Tokens a search may generate after the start token and `prompt`: `max_new_tokens` when given (refused past the
    decoder's positions), else what the model's own limit leaves (max_length counts the prompt, as in transformers)."""
    room = cfg.max_tgt_len - 1 - len(prompt)
    if max_new_tokens is not None:
        if not 1 <= max_new_tokens <= room:
            raise InputError(f"max_new_tokens {max_new_tokens} does not fit: the decoder holds {cfg.max_tgt_len} "
                             f"positions, {1 + len(prompt)} of them the start token and the prompt; give 1 .. {room}")
        return max_new_tokens
    own = cfg.max_new_tokens + 1 if cfg.max_new_tokens is not None else cfg.max_tgt_len
    return max(1, min(room, own - 1 - len(prompt)))


def transcribe_features(model: StepModel, cfg, speech: SpeechTokens, features: np.ndarray, *,
                        language: str | None = None, task: str | None = None, beam_size: int = 1,
                        length_penalty: float = 1.0, early_stopping: bool | str = False,
                        max_new_tokens: int | None = None, generation: dict | None = None,
                        languages_out: list | None = None) -> list:
    """Token ids of each row of a (B, n_mels, frames) feature batch (short-form: one 30 s window a row), without the
    prompt and eos, greedy (`beam_size` 1) or Hugging Face's beam search; `languages_out` receives each row's
    language (given or detected). The model's other generation options (`generation`) apply as in translate."""
    language, task = speech.check_language(language), speech.check_task(task)
    mask = np.ones((len(features), cfg.max_src_len), dtype=np.int64)
    codes: list[str | None] = [language] * len(features)
    if speech.multilingual and language is None and speech.default_language is None:
        codes = detect_languages(model, model.encode(features, mask), mask, cfg.bos_id, speech)
    if languages_out is not None:
        languages_out.extend(c if speech.multilingual else "en" for c in codes)
    results: list = [None] * len(features)
    for code in dict.fromkeys(codes):
        rows = np.asarray([i for i, c in enumerate(codes) if c == code])
        prompt = speech.prompt(code, task)
        settings = dataclasses.replace(DecodeSettings.for_model(cfg, 1, generation), prompt=prompt,
                                       max_new_tokens=generation_limit(cfg, prompt, max_new_tokens))
        if beam_size == 1:
            found = greedy_decode(model, features[rows], mask[rows], settings)
        else:
            found = hf_beam_search(model, features[rows], mask[rows], settings, beam_size, length_penalty,
                                   early_stopping)
        for row, tokens in zip(rows, found):
            results[row] = tokens
    return results


@dataclass(frozen=True)
class Segment:
    start: float  # seconds from the start of the audio
    end: float
    tokens: list[int]  # the segment's text tokens (no timestamps, no prompt, no eos)


@dataclass(frozen=True)
class Transcript:
    tokens: list[int]  # every text token of the audio, in order (no prompt, no timestamps, no eos)
    language: str | None  # the language decoded with (given or detected); None on an English-only model
    segments: list[Segment]  # without timestamps: one segment over the whole audio


def transcribe(model: StepModel, cfg, speech: SpeechTokens, features: Sequence[np.ndarray], *,
               language: str | None = None, task: str | None = None, timestamps: bool = False, beam_size: int = 1,
               length_penalty: float = 1.0, early_stopping: bool | str = False, max_new_tokens: int | None = None,
               generation: dict | None = None) -> list[Transcript]:
    """One Transcript per audio clip from its log-mel features (n_mels, frames): a clip of at most 30 s comes as
    the features of its audio padded to 30 s (exactly 2 x max_src_len frames), decoded in one window (short-form)."""
    frames = cfg.source_frames
    long = [i for i, f in enumerate(features) if np.shape(f)[-1] != frames]
    if long:
        raise InputError(f"clip {long[0] + 1} has {np.shape(features[long[0]])[-1]} feature frames; one window "
                         f"takes {frames} (30 s: pad the audio to 30 s before computing its features)")
    if timestamps:
        raise ConfigError("timestamps are not decoded yet; drop --timestamps")
    batch = np.stack([np.asarray(f, dtype=np.float32) for f in features])
    languages: list = []
    found = transcribe_features(model, cfg, speech, batch, language=language, task=task, beam_size=beam_size,
                                length_penalty=length_penalty, early_stopping=early_stopping,
                                max_new_tokens=max_new_tokens, generation=generation, languages_out=languages)
    seconds = frames * SECONDS_PER_FRAME
    return [Transcript(tokens, code if speech.multilingual else None, [Segment(0.0, seconds, tokens)])
            for tokens, code in zip(found, languages)]
