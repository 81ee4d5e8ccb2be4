"""Whisper's long-form transcription, as transformers' `generate(..., return_timestamps=True)` does it, short-form or
long: a 30 s window of features from `seek` (the last window padded with zeros), decoded, split into segments at its
timestamp pairs (`window_segments`), and `seek` moved to the last pair's timestamp, or past the window when it ends in
a single timestamp or has no pair; until the clip's features are spent. With `condition_on_prev_tokens` a window is
decoded after the previous text (a decoder prefix); with a temperature list a window that fails a threshold is decoded
again at the next temperature (`WindowOptions`; docs/design.md, "Long-form options"). The prompt, language detection
and one batch of windows are `reference_model.speech`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from seq2trt.reference_model.decoding import MIN_TEMPERATURE, StepModel, option_problem, seeded_generator
from seq2trt.core.errors import InputError
from seq2trt.reference_model.speech import (SECONDS_PER_FRAME, TIME_PRECISION, SpeechTokens,
                                            decode_windows, needs_detection, row_languages)


@dataclass(frozen=True)
class WindowOptions:
    """transformers' long-form options of `generate` (its `_set_thresholds_and_condition` and temperature
    fallback), checked: each window decoded at `temperatures[0]` (0: greedy or beam search; > 0: sampling with one
    beam), and again at the next temperature while it fails a threshold (its zlib compression ratio above
    `compression_ratio_threshold`, its average log-probability below `logprob_threshold`), the last decode kept;
    `condition_on_prev_tokens`: each window after a clip's first is decoded after its previous text. `seed`: the
    one torch stream every sampling decode of a `transcribe` call draws from, as `torch.manual_seed(seed)` before
    `generate` (None: a fresh seed)."""
    temperatures: tuple[float, ...] = (0.0,)
    compression_ratio_threshold: float | None = None
    logprob_threshold: float | None = None
    condition_on_prev_tokens: bool = False
    seed: int | None = None

    @classmethod
    def checked(cls, temperature: float | Sequence[float] | None = None, compression_ratio_threshold=None,
                logprob_threshold=None, condition_on_prev_tokens: bool = False, seed: int | None = None,
                no_speech_threshold=None) -> "WindowOptions":
        """The options as given to `transcribe`, a bad value refused (InputError naming it)."""
        if no_speech_threshold is not None:
            raise InputError("no_speech_threshold is not supported (transformers' WhisperNoSpeechDetection is not "
                             "reproduced); drop it")
        values = (0.0,) if temperature is None else \
            (temperature,) if isinstance(temperature, (int, float)) else tuple(temperature)
        if not values or not all(_number(t) and (t == 0 or option_problem("temperature", t) is None) for t in values):
            shown = ",".join(map(str, values)) if isinstance(temperature, (list, tuple)) else repr(temperature)
            raise InputError(f"temperature must be a number >= 0 or a list of them (0: greedy; one that samples at "
                             f"least {MIN_TEMPERATURE:.3g}, the smallest normal float32), got {shown}")
        if compression_ratio_threshold is not None and not (_number(compression_ratio_threshold)
                                                            and compression_ratio_threshold > 0):
            raise InputError(f"compression_ratio_threshold must be a number > 0 (e.g. 2.4), got "
                             f"{compression_ratio_threshold!r}")
        if logprob_threshold is not None and not _number(logprob_threshold):
            raise InputError(f"logprob_threshold must be a number (e.g. -1.0), got {logprob_threshold!r}")
        if not isinstance(condition_on_prev_tokens, bool):
            raise InputError(f"condition_on_prev_tokens must be true or false, got {condition_on_prev_tokens!r}")
        if option_problem("seed", seed) is not None:
            raise InputError(f"seed must be {option_problem('seed', seed)}, got {seed!r}")
        return cls(tuple(float(t) for t in values),
                   None if compression_ratio_threshold is None else float(compression_ratio_threshold),
                   None if logprob_threshold is None else float(logprob_threshold), condition_on_prev_tokens, seed)

    @property
    def thresholds(self) -> bool:
        return self.compression_ratio_threshold is not None or self.logprob_threshold is not None

    def generator(self):
        """The torch generator every sampling decode of one call draws from (None: no temperature samples)."""
        if not any(t > 0 for t in self.temperatures):
            return None
        return seeded_generator(self.seed)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and bool(np.isfinite(value))


def decode_with_fallback(model: StepModel, cfg, speech: SpeechTokens, windows: np.ndarray,
                         codes: Sequence[str | None], task: str | None, timestamps: bool, options: dict,
                         fallback: WindowOptions, generator=None, state: Any = None,
                         prefixes: Sequence[tuple] | None = None) -> tuple[list, list[bool]]:
    """transformers' `generate_with_fallback` over a batch of windows: each decoded at the first temperature, the
    rows that fail a threshold again at the next (those rows alone), the last decode kept. Returns each row's
    tokens and whether its last decode was at a low temperature (< 0.5: the next window may condition on it).
    A temperature > 0 sets `options["beam_size"]` to 1 for the rest of the call, as generate leaves its
    generation_config's num_beams at 1 once it sampled."""
    rows = list(range(len(windows)))
    prefixes = [()] * len(windows) if prefixes is None else list(prefixes)
    results: list = [None] * len(windows)
    low = [True] * len(windows)
    for n, temperature in enumerate(fallback.temperatures):
        if temperature > 0:
            options["beam_size"] = 1
        measures: list | None = [] if fallback.thresholds else None
        picked = np.asarray(rows)
        found = decode_windows(model, cfg, speech, windows[picked], [codes[r] for r in rows], task, timestamps,
                               **options, state=state if n == 0 else None, prefixes=[prefixes[r] for r in rows],
                               temperature=temperature, generator=generator, measures=measures)
        again = []
        for j, (row, tokens) in enumerate(zip(rows, found)):
            results[row], low[row] = tokens, temperature < 0.5
            if measures is not None:
                ratio, average = measures[j]
                if (fallback.compression_ratio_threshold is not None and ratio > fallback.compression_ratio_threshold) \
                        or (fallback.logprob_threshold is not None and average < fallback.logprob_threshold):
                    again.append(row)
        if not again:
            break
        rows = again
    return results, low


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
               generation: dict | None = None, condition_on_prev_tokens: bool = False,
               temperature: float | Sequence[float] | None = None, compression_ratio_threshold: float | None = None,
               logprob_threshold: float | None = None, no_speech_threshold: float | None = None,
               seed: int | None = None) -> list[Transcript]:
    """One Transcript per audio clip from its log-mel features (n_mels, frames), as transformers'
    `WhisperForConditionalGeneration.generate` transcribes the clip alone. A clip of at most 30 s comes as the
    features of its audio padded to 30 s (exactly 2 x max_src_len frames: the feature extractor's defaults),
    decoded in one window (short-form); a longer one as the features of the whole clip, not padded (the extractor
    with truncation=False, or padding="longest" on the clip alone), decoded window by window with timestamps
    (long-form: transformers decodes it so whether or not timestamps were asked for). With `timestamps` (and for
    every long clip) the segments are the decode's, cut at its timestamps; else one segment over the 30 s.

    generate's long-form options (`WindowOptions`; defaults: none of them): `temperature` (a number or a list:
    temperature fallback, short-form too as in generate) with `compression_ratio_threshold` and
    `logprob_threshold`, `condition_on_prev_tokens`, and `seed` (the torch stream of every sampling decode of this
    call: `torch.manual_seed(seed)` before generate draws the same for one clip). `no_speech_threshold` is refused.
    Each clip is decoded as generate decodes it alone: transformers' batch left-pads the previous text of rows
    whose prefixes differ under a decoder attention mask (our graphs have none), so rows here are decoded in groups
    of one prefix each; and its fallback re-runs the failing rows as one smaller batch whose sampling draws differ
    from the groups' here, so a sampled fallback matches generate's stream for one clip a call."""
    fallback = WindowOptions.checked(temperature, compression_ratio_threshold, logprob_threshold,
                                     condition_on_prev_tokens, seed, no_speech_threshold)
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
    if fallback.condition_on_prev_tokens and any(clips[i].shape[-1] > window for i in timed):
        speech.previous_start()  # an old import: refused before any decoding
    options = dict(beam_size=beam_size, length_penalty=length_penalty, early_stopping=early_stopping,
                   max_new_tokens=max_new_tokens, generation=generation)
    generator = fallback.generator()  # one stream for the whole call, as generate's global one
    first = np.stack([f[:, :window] for f in clips])
    state = None  # the first windows' encoder state, when detection computes it: the one-window clips reuse it
    if needs_detection(speech, language):
        state = model.encode(first, np.ones((len(first), cfg.max_src_len), dtype=np.int64))
    codes = row_languages(model, cfg, speech, first, language, state)
    out: list = [None] * len(clips)
    plain = [i for i in range(len(clips)) if i not in set(timed)]
    if plain:
        found = _plain_windows(model, cfg, speech, [clips[i] for i in plain], [codes[i] for i in plain], task,
                               options, None if state is None else model.select(state, np.asarray(plain)), fallback,
                               generator)
        seconds = window * SECONDS_PER_FRAME
        for i, tokens in zip(plain, found):
            out[i] = Transcript(tokens, codes[i] if speech.multilingual else None,
                                [Segment(0.0, seconds, tokens, list(tokens))])
    windows = _sequential(model, cfg, speech, [clips[i] for i in timed], [codes[i] for i in timed], task, options,
                          None if state is None else model.select(state, np.asarray(timed)), fallback,
                          generator) if timed else []
    for i, segments in zip(timed, windows):
        out[i] = Transcript([t for s in segments for t in s.tokens], codes[i] if speech.multilingual else None,
                            segments)
    return out


def _plain_windows(model: StepModel, cfg, speech: SpeechTokens, clips: list[np.ndarray], codes: list,
                   task: str | None, options: dict, state: Any, fallback: WindowOptions, generator) -> list[list[int]]:
    """Each clip of at most 30 s decoded without timestamps (the prompt ends with <|notimestamps|>, no timestamp
    rule), as transformers' generate decodes it: its long-form loop runs for short inputs too, so where a decode
    holds a timestamp pair (a model whose vocabulary has timestamp tokens emits them freely) it keeps the tokens up
    to the last pair and decodes the window again from that timestamp, until the window is spent. The tokens are
    generate's output: every decode's kept tokens in order, their timestamps included."""
    begin = None if speech.no_timestamps_id is None else speech.no_timestamps_id + 1
    if begin is None or begin >= cfg.tgt_vocab_size:  # no id is a timestamp: one decode a clip
        found, _ = decode_with_fallback(model, cfg, speech, np.stack(clips), codes, task, False, options, fallback,
                                        generator, state=state)
        return found
    segments = _sequential(model, cfg, speech, clips, codes, task, options, state, fallback, generator,
                           timestamps=False)
    return [[t for s in row for t in s.decoded] for row in segments]


def previous_text(cfg, speech: SpeechTokens, segments: Sequence[Segment], begin: int) -> tuple[int, ...]:
    """The decoder prefix of a window conditioned on the clip's segments so far, as transformers'
    `_prepare_decoder_input_ids` builds it: <|startofprev|>, then the segments' tokens (a segment closing with two
    timestamps without its last: `_pad_to_max_length`'s skip_ending_double_timestamps) cut to their last
    max_target_positions // 2 - 1. None before the first segment."""
    tokens = [t for s in segments for t in (s.decoded[:-1] if len(s.decoded) > 2 and s.decoded[-2] >= begin
                                            else s.decoded)]
    tokens = tokens[len(tokens) - min(len(tokens), cfg.max_tgt_len // 2 - 1):]
    start = speech.previous_start()
    return tuple(([] if start is None else [start]) + tokens)


def _sequential(model: StepModel, cfg, speech: SpeechTokens, clips: list[np.ndarray], codes: list, task: str | None,
                options: dict, first_state: Any = None, fallback: WindowOptions = WindowOptions(),
                generator=None, timestamps: bool = True) -> list[list[Segment]]:
    """transformers' sequential transcription of each clip: every live clip's window at its `seek` decoded in one
    batch with timestamps (with temperature fallback, and after the clip's previous text where it conditions), its
    segments kept, `seek` moved on; until every clip's frames are spent. `first_state`: the encoder state of the
    clips' first windows when language detection computed it (not encoded again). `timestamps` False: decoded
    without them (`_plain_windows`); the segments are still cut at the timestamps a decode holds."""
    window, begin = cfg.source_frames, speech.timestamp_begin(cfg)
    stride = window // cfg.max_src_len
    seek, segments = [0] * len(clips), [[] for _ in clips]
    conditioned = [fallback.condition_on_prev_tokens] * len(clips)  # generate's do_condition_on_prev_tokens
    while live := [i for i, clip in enumerate(clips) if seek[i] < clip.shape[-1]]:
        frames = [min(clips[i].shape[-1] - seek[i], window) for i in live]
        batch = np.zeros((len(live), clips[0].shape[0], window), np.float32)  # the last window padded with zeros
        for row, (i, n) in enumerate(zip(live, frames)):
            batch[row, :, :n] = clips[i][:, seek[i]: seek[i] + n]
        state, first_state = first_state, None  # every clip is at seek 0 in the first round, and only then
        prefixes = [previous_text(cfg, speech, segments[i], begin) if conditioned[i] and segments[i] else ()
                    for i in live]
        found, low = decode_with_fallback(model, cfg, speech, batch, [codes[i] for i in live], task, timestamps,
                                          options, fallback, generator, state=state, prefixes=prefixes)
        for i, n, tokens, cool in zip(live, frames, found, low):
            got, advance = window_segments(tokens, begin, seek[i] * TIME_PRECISION / stride, n, stride)
            segments[i] += got
            # A last pair at <|0.00|> (possible without the timestamp rule) moves nothing: transformers' loop would
            # decode the same window forever; the window is taken as spent instead.
            seek[i] += advance if advance > 0 else n
            conditioned[i] = fallback.condition_on_prev_tokens and cool
    return segments
