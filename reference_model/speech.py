"""Whisper's decoding around the searches: the prompt, language detection, and transcription of feature batches.

The prompt after <|startoftranscript|> is <|lang|> <|task|> on a multilingual model, then <|notimestamps|> (when the
model has it and no timestamps are asked for); it is fed as one prefill and not returned (`DecodeSettings.prompt`).
With no language given, a multilingual model detects it as transformers' `WhisperForConditionalGeneration.
detect_language` does: one decoder step on <|startoftranscript|>, the argmax over the language tokens. Rows of one
batch whose languages differ are decoded in groups of one prompt each (rows are independent in every search, so
this gives transformers' per-row prompts). 448 positions hold the start token, the prompt and the generated tokens.

With timestamps the prompt has no <|notimestamps|>; the timestamp tokens are the ids after it, 0.02 s apart, and
every step obeys transformers' timestamp rule (`DecodeSettings.constrain`). Clips are then transcribed as transformers'
`generate(..., return_timestamps=True)` does, short-form or long: a 30 s window of features from `seek` (the last
window padded with zeros), decoded, split into segments at its timestamp pairs (`window_segments`), and `seek` moved
to the last pair's timestamp, or past the window when it ends in a single timestamp or has no pair; until the clip's
features are spent. Each window is decoded alone: no prompt from the one before (its condition_on_prev_tokens False)
and no temperature fallback (its default temperature).

`SpeechTokens` is the checkpoint's generation.json "speech" record (written by the import from
generation_config.json: `hf_families.whisper`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from seq2trt.reference_model.decoding import DecodeSettings, StepModel, greedy_decode, hf_beam_search
from seq2trt.reference_model.errors import ConfigError, InputError

TASKS = ("transcribe", "translate")
SECONDS_PER_FRAME = 0.01  # the feature extractor's hop: 160 samples at 16 kHz
TIME_PRECISION = 0.02  # seconds between timestamp tokens: one encoder position (transformers' time_precision)


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

    def timestamp_begin(self, cfg) -> int:
        """The first timestamp token (<|0.00|>, the id after <|notimestamps|>); refused on a vocabulary without."""
        begin = None if self.no_timestamps_id is None else self.no_timestamps_id + 1
        if begin is None or begin >= cfg.tgt_vocab_size:
            raise ConfigError("this model has no timestamp tokens (none after <|notimestamps|> in its vocabulary); "
                              "transcribe clips of at most 30 s without timestamps")
        return begin

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
                        languages_out: list | None = None, timestamps: bool = False) -> list:
    """Token ids of each row of a (B, n_mels, frames) feature batch (short-form: one 30 s window a row), without the
    prompt and eos, greedy (`beam_size` 1) or Hugging Face's beam search; `languages_out` receives each row's
    language (given or detected). The model's other generation options (`generation`) apply as in translate.
    `timestamps`: decoded under the timestamp rule, its tokens among the ids returned (one window's decode)."""
    language, task = speech.check_language(language), speech.check_task(task)
    state = None  # encoded once when detection needs it, and reused by the decode
    if needs_detection(speech, language):
        state = model.encode(features, np.ones((len(features), cfg.max_src_len), dtype=np.int64))
    codes = row_languages(model, cfg, speech, features, language, state)
    if languages_out is not None:
        languages_out.extend(c if speech.multilingual else "en" for c in codes)
    return decode_windows(model, cfg, speech, features, codes, task, timestamps, beam_size=beam_size,
                          length_penalty=length_penalty, early_stopping=early_stopping,
                          max_new_tokens=max_new_tokens, generation=generation, state=state)


class Preencoded:
    """A step model whose `encode` returns an encoder state already computed (for the same rows): a batch that
    language detection encoded is not encoded again for its decode, as transformers encodes a batch once."""

    def __init__(self, model: StepModel, state: Any):
        self.model, self.state = model, state

    def encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> Any:
        return self.state

    def empty_past(self, batch: int) -> Any:
        return self.model.empty_past(batch)

    def step(self, input_ids, encoder_attention_mask, encoder_state, past):
        return self.model.step(input_ids, encoder_attention_mask, encoder_state, past)

    def select(self, state: Any, index: np.ndarray) -> Any:
        return self.model.select(state, index)


def needs_detection(speech: SpeechTokens, language: str | None) -> bool:
    return speech.multilingual and language is None and speech.default_language is None


def row_languages(model: StepModel, cfg, speech: SpeechTokens, windows: np.ndarray,
                  language: str | None, state: Any = None) -> list[str | None]:
    """Each row's language code from its first window (B, n_mels, frames): `language` (a code `check_language`
    returned) when given, else the model's default, else detected (on `state`, the windows' encoder state, when
    given); None on an English-only model."""
    if needs_detection(speech, language):
        mask = np.ones((len(windows), cfg.max_src_len), dtype=np.int64)
        return detect_languages(model, model.encode(windows, mask) if state is None else state, mask, cfg.bos_id,
                                speech)
    return [language] * len(windows)


def decode_windows(model: StepModel, cfg, speech: SpeechTokens, windows: np.ndarray, codes: Sequence[str | None],
                   task: str | None, timestamps: bool, *, beam_size: int = 1, length_penalty: float = 1.0,
                   early_stopping: bool | str = False, max_new_tokens: int | None = None,
                   generation: dict | None = None, state: Any = None) -> list:
    """Each window's tokens (B, n_mels, frames) decoded with the prompt of its row's language `codes[i]`, in
    groups of one prompt each; with `timestamps`, under the timestamp rule. `state`: the windows' encoder state
    when already computed (language detection's), else each group encodes its rows."""
    mask = np.ones((len(windows), cfg.max_src_len), dtype=np.int64)
    stamps = {}
    if timestamps:
        stamps = dict(timestamp_begin=speech.timestamp_begin(cfg),
                      max_initial_timestamp_index=speech.max_initial_timestamp_index)
    results: list = [None] * len(windows)
    for code in dict.fromkeys(codes):
        rows = np.asarray([i for i, c in enumerate(codes) if c == code])
        prompt = speech.prompt(code, task, timestamps)
        settings = dataclasses.replace(DecodeSettings.for_model(cfg, 1, generation), prompt=prompt,
                                       max_new_tokens=generation_limit(cfg, prompt, max_new_tokens), **stamps)
        group = model if state is None else Preencoded(model, model.select(state, rows))
        if beam_size == 1:
            found = greedy_decode(group, windows[rows], mask[rows], settings)
        else:
            found = hf_beam_search(group, windows[rows], mask[rows], settings, beam_size, length_penalty,
                                   early_stopping)
        for row, tokens in zip(rows, found):
            results[row] = tokens
    return results


@dataclass(frozen=True)
class Segment:
    start: float  # seconds from the start of the audio
    end: float
    tokens: list[int]  # the segment's text tokens (no timestamps, no prompt, no eos)
    # The segment's tokens as decoded, its timestamps included (transformers' segment "tokens"); without
    # timestamps, `tokens`.
    decoded: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Transcript:
    tokens: list[int]  # every text token of the audio, in order (no prompt, no timestamps, no eos)
    language: str | None  # the language decoded with (given or detected); None on an English-only model
    segments: list[Segment]  # without timestamps: one segment over the whole audio


def window_segments(tokens: Sequence[int], begin: int, offset: float, frames: int,
                    stride: int) -> tuple[list[Segment], int]:
    """One window's decode (its tokens without eos) split as transformers' `_retrieve_segment` splits it, and the
    feature frames to move `seek` by. A segment runs from a timestamp to the next, the window's timestamp pairs
    (two timestamps in a row: one segment's end, the next one's start) are the cuts; tokens after the last pair are
    dropped unless a single timestamp ends the decode. With no pair the decode is one segment from the window's
    start to its last timestamp (past <|0.00|>), else to the window's end. `offset`: the window's start in seconds;
    `frames`: the clip's frames in it; `stride`: feature frames a timestamp step (the encoder's front end)."""
    import torch

    stamp = [t >= begin for t in tokens]
    single_ending = stamp[-2:] == [False, True]
    cuts = [i + 1 for i in range(len(tokens) - 1) if stamp[i] and stamp[i + 1]]
    if not cuts:
        stamps = [t for t in tokens if t >= begin]
        # transformers: the window's frames in seconds then in timestamp steps, in float32 (a long tensor's product)
        end = int(torch.tensor(frames) * SECONDS_PER_FRAME / TIME_PRECISION)
        if stamps and stamps[-1] != begin:
            end = stamps[-1] - begin
        return [_segment(tokens, begin, offset, offset + end * TIME_PRECISION)], frames
    if single_ending:
        cuts.append(len(tokens))
    else:
        cuts[-1] += 1  # the last segment keeps both timestamps of its closing pair
    segments, first = [], 0
    for i, cut in enumerate(cuts):
        piece = tokens[first:cut]
        closing = piece[-2] if i == len(cuts) - 1 and not single_ending else piece[-1]
        segments.append(_segment(piece, begin, offset + (piece[0] - begin) * TIME_PRECISION,
                                 offset + (closing - begin) * TIME_PRECISION))
        first = cut
    return segments, frames if single_ending else (tokens[first - 2] - begin) * stride


def _segment(tokens: Sequence[int], begin: int, start: float, end: float) -> Segment:
    return Segment(float(start), float(end), [t for t in tokens if t < begin], list(tokens))


def transcribe(model: StepModel, cfg, speech: SpeechTokens, features: Sequence[np.ndarray], *,
               language: str | None = None, task: str | None = None, timestamps: bool = False, beam_size: int = 1,
               length_penalty: float = 1.0, early_stopping: bool | str = False, max_new_tokens: int | None = None,
               generation: dict | None = None) -> list[Transcript]:
    """One Transcript per audio clip from its log-mel features (n_mels, frames), as transformers'
    `WhisperForConditionalGeneration.generate` transcribes the clip alone. A clip of at most 30 s comes as the
    features of its audio padded to 30 s (exactly 2 x max_src_len frames: the feature extractor's defaults),
    decoded in one window (short-form); a longer one as the features of the whole clip, not padded (the extractor
    with truncation=False, or padding="longest" on the clip alone), decoded window by window with timestamps
    (long-form: transformers decodes it so whether or not timestamps were asked for). With `timestamps` (and for
    every long clip) the segments are the decode's, cut at its timestamps; else one segment over the 30 s."""
    window = cfg.source_frames
    short = [i for i, f in enumerate(features) if np.shape(f)[-1] < window]
    if short:
        raise InputError(f"clip {short[0] + 1} has {np.shape(features[short[0]])[-1]} feature frames; a clip takes "
                         f"{window} at least (30 s: pad the audio to 30 s before computing its features)")
    language, task = speech.check_language(language), speech.check_task(task)
    clips = [np.asarray(f, dtype=np.float32) for f in features]
    timed = [i for i, f in enumerate(clips) if timestamps or f.shape[-1] > window]
    if timed:
        speech.timestamp_begin(cfg)  # refused before any decoding
    options = dict(beam_size=beam_size, length_penalty=length_penalty, early_stopping=early_stopping,
                   max_new_tokens=max_new_tokens, generation=generation)
    first = np.stack([f[:, :window] for f in clips])
    state = None  # the first windows' encoder state, when detection computes it: the one-window clips reuse it
    if needs_detection(speech, language):
        state = model.encode(first, np.ones((len(first), cfg.max_src_len), dtype=np.int64))
    codes = row_languages(model, cfg, speech, first, language, state)
    out: list = [None] * len(clips)
    plain = [i for i in range(len(clips)) if i not in set(timed)]
    if plain:
        found = decode_windows(model, cfg, speech, np.stack([clips[i] for i in plain]), [codes[i] for i in plain],
                               task, False, **options,
                               state=None if state is None else model.select(state, np.asarray(plain)))
        seconds = window * SECONDS_PER_FRAME
        for i, tokens in zip(plain, found):
            out[i] = Transcript(tokens, codes[i] if speech.multilingual else None,
                                [Segment(0.0, seconds, tokens, list(tokens))])
    windows = _sequential(model, cfg, speech, [clips[i] for i in timed], [codes[i] for i in timed], task, options,
                          None if state is None else model.select(state, np.asarray(timed))) if timed else []
    for i, segments in zip(timed, windows):
        out[i] = Transcript([t for s in segments for t in s.tokens], codes[i] if speech.multilingual else None,
                            segments)
    return out


def _sequential(model: StepModel, cfg, speech: SpeechTokens, clips: list[np.ndarray], codes: list, task: str | None,
                options: dict, first_state: Any = None) -> list[list[Segment]]:
    """transformers' sequential transcription of each clip: every live clip's window at its `seek` decoded in one
    batch with timestamps, its segments kept, `seek` moved on; until every clip's frames are spent. `first_state`:
    the encoder state of the clips' first windows when language detection computed it (not encoded again)."""
    window, begin = cfg.source_frames, speech.timestamp_begin(cfg)
    stride = window // cfg.max_src_len
    seek, segments = [0] * len(clips), [[] for _ in clips]
    while live := [i for i, clip in enumerate(clips) if seek[i] < clip.shape[-1]]:
        frames = [min(clips[i].shape[-1] - seek[i], window) for i in live]
        batch = np.zeros((len(live), clips[0].shape[0], window), np.float32)  # the last window padded with zeros
        for row, (i, n) in enumerate(zip(live, frames)):
            batch[row, :, :n] = clips[i][:, seek[i]: seek[i] + n]
        state, first_state = first_state, None  # every clip is at seek 0 in the first round, and only then
        found = decode_windows(model, cfg, speech, batch, [codes[i] for i in live], task, True, **options,
                               state=state)
        for i, n, tokens in zip(live, frames, found):
            got, advance = window_segments(tokens, begin, seek[i] * TIME_PRECISION / stride, n, stride)
            segments[i] += got
            seek[i] += advance
    return segments
