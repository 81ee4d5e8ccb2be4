"""Whisper's decoding around the searches: the prompt, language detection, and transcription of feature batches.

The prompt after <|startoftranscript|> is <|lang|> <|task|> on a multilingual model, then <|notimestamps|> (when the
model has it and no timestamps are asked for); it is fed as one prefill and not returned (`DecodeSettings.prompt`).
With no language given, a multilingual model detects it as transformers' `WhisperForConditionalGeneration.
detect_language` does: one decoder step on <|startoftranscript|>, the argmax over the language tokens. Rows of one
batch whose languages differ are decoded in groups of one prompt each (rows are independent in every search, so
this gives transformers' per-row prompts). 448 positions hold the start token, the prompt and the generated tokens.

With timestamps the prompt has no <|notimestamps|>; the timestamp tokens are the ids after it, 0.02 s apart, and
every step obeys transformers' timestamp rule (`DecodeSettings.constrain`). Clips are transcribed window by window in
`reference_model.longform`.

`SpeechTokens` is the checkpoint's generation.json "speech" record (written by the import from
generation_config.json: `families.whisper`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from seq2trt.reference_model.decoding import DecodeSettings, StepModel, greedy_decode, hf_beam_search
from seq2trt.core.errors import ConfigError, InputError

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
    # <|startofprev|>, the token before the previous text under condition_on_prev_tokens: generation_config's
    # prev_sot_token_id, else suppress_tokens[-2] (transformers' own fallback), else None (no such token).
    prev_sot_id: int | None = None
    prev_sot_recorded: bool = False  # whether the import wrote prev_sot_id (older ones did not)

    @classmethod
    def from_record(cls, record: Mapping[str, Any] | None) -> "SpeechTokens":
        if not record:
            raise ConfigError("this checkpoint holds no speech settings (generation.json has no \"speech\" record); "
                              "re-import the Whisper model with this version of seq2trt")
        fields = {f.name for f in dataclasses.fields(cls)} - {"prev_sot_recorded"}
        return cls(**{k: v for k, v in record.items() if k in fields}, prev_sot_recorded="prev_sot_id" in record)

    def previous_start(self) -> int | None:
        """<|startofprev|>'s id (None: the model has none); refused on a checkpoint imported before it was kept."""
        if not self.prev_sot_recorded:
            raise ConfigError("this checkpoint's speech settings do not say which token is <|startofprev|> (imported "
                              "by an older seq2trt); re-import the Whisper model with this version of seq2trt to use "
                              "condition_on_prev_tokens")
        return self.prev_sot_id

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


def generation_limit(cfg, prompt: Sequence[int], max_new_tokens: int | None, prefix: Sequence[int] = (),
                     name: str = "max_new_tokens", decoder: str = "the decoder") -> int:
    """Tokens a search may generate after `prefix`, the start token and `prompt`: `max_new_tokens` when given
    (refused past the decoder's positions, naming it `name` and the decoder `decoder`), else what the model's own
    limit leaves (max_length counts the prefix and the prompt, as transformers counts its decoder_input_ids)."""
    fed = len(prefix) + 1 + len(prompt)
    room = cfg.max_tgt_len - fed
    if max_new_tokens is not None:
        if not 1 <= max_new_tokens <= room:
            what = "the previous text, the start token and the prompt" if prefix else "the start token and the prompt"
            raise InputError(f"{name} {max_new_tokens} does not fit: {decoder} holds {cfg.max_tgt_len} positions, "
                             f"{fed} of them {what}; give 1 .. {room}")
        return max_new_tokens
    own = cfg.max_new_tokens + 1 if cfg.max_new_tokens is not None else cfg.max_tgt_len
    return max(1, min(room, own - fed))


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


def compression_ratio(tokens: Sequence[int], vocab_size: int) -> float:
    """transformers' `_retrieve_compression_ratio`: the tokens' little-endian bytes over their zlib-compressed
    bytes."""
    import math
    import zlib

    length = int(math.log2(vocab_size) / 8) + 1
    raw = b"".join(int(t).to_bytes(length, "little") for t in tokens)
    return len(raw) / len(zlib.compress(raw))


class _LogProbs:
    """Each row's summed log-probability of its chosen tokens as transformers' `_retrieve_avg_logprobs` sums it:
    log_softmax over the processed scores (after the model's rules and, sampling, the warpers) multiplied back by
    the temperature, in float32 and then the scores' dtype, added in that dtype token by token (eos included)."""

    def __init__(self, settings: DecodeSettings, batch: int):
        self.settings, self.sums = settings, [0] * batch

    def __call__(self, step: int, rows: np.ndarray, scores: np.ndarray, tokens: np.ndarray) -> None:
        import torch

        x = torch.from_numpy(np.array(scores))
        if self.settings.do_sample:
            x = self.settings.warp(x) * self.settings.temperature
        logp = torch.log_softmax(x.float(), dim=-1).to(x.dtype)
        for row, token, value in zip(rows.tolist(), tokens.tolist(), logp[torch.arange(len(rows)), tokens]):
            self.sums[row] = self.sums[row] + value


def decode_windows(model: StepModel, cfg, speech: SpeechTokens, windows: np.ndarray, codes: Sequence[str | None],
                   task: str | None, timestamps: bool, *, beam_size: int = 1, length_penalty: float = 1.0,
                   early_stopping: bool | str = False, max_new_tokens: int | None = None,
                   generation: dict | None = None, state: Any = None, prefixes: Sequence[tuple] | None = None,
                   temperature: float = 0.0, generator=None, measures: list | None = None) -> list:
    """Each window's tokens (B, n_mels, frames) decoded with the prompt of its row's language `codes[i]` after its
    decoder prefix `prefixes[i]` (none by default), in groups of one prompt and prefix each; with `timestamps`,
    under the timestamp rule. `state`: the windows' encoder state when already computed (language detection's),
    else each group encodes its rows. `temperature` > 0 samples (one beam, from `generator`). `measures`, when
    given, receives each row's (compression ratio, average log-probability) as transformers' `_need_fallback`
    computes them: over the tokens with eos when one was generated; beam search's log-probability is its
    sequences_scores."""
    mask = np.ones((len(windows), cfg.max_src_len), dtype=np.int64)
    prefixes = [()] * len(windows) if prefixes is None else [tuple(p) for p in prefixes]
    stamps = {}
    if timestamps:
        stamps = dict(timestamp_begin=speech.timestamp_begin(cfg),
                      max_initial_timestamp_index=speech.max_initial_timestamp_index)
    sampled = temperature > 0
    if sampled:
        stamps.update(do_sample=True, temperature=temperature, num_return_sequences=1)
    results: list = [None] * len(windows)
    scored: list = [None] * len(windows)
    for key in dict.fromkeys(zip(codes, prefixes)):
        rows = np.asarray([i for i, k in enumerate(zip(codes, prefixes)) if k == key])
        code, prefix = key
        prompt = speech.prompt(code, task, timestamps)
        settings = dataclasses.replace(DecodeSettings.for_model(cfg, 1, generation), prompt=prompt, prefix=prefix,
                                       max_new_tokens=generation_limit(cfg, prompt, max_new_tokens, prefix), **stamps)
        group = model if state is None else Preencoded(model, model.select(state, rows))
        if beam_size == 1 or sampled:
            sums = _LogProbs(settings, len(rows)) if measures is not None else None
            found = greedy_decode(group, windows[rows], mask[rows], settings, generator=generator, on_choice=sums)
            totals = None if sums is None else sums.sums  # summed log-probabilities: averaged below
        else:
            found = hf_beam_search(group, windows[rows], mask[rows],
                                   dataclasses.replace(settings, output_scores=measures is not None), beam_size,
                                   length_penalty, early_stopping)
            if measures is not None:
                totals = [h[0].score for h in found]  # sequences_scores: already length-normalised
                found = [h[0].tokens for h in found]
        for j, (row, tokens) in enumerate(zip(rows, found)):
            results[row] = tokens
            if measures is not None:
                ended = list(tokens) + ([cfg.eos_id] if len(tokens) < settings.max_new_tokens else [])
                average = float(totals[j] / len(ended)) if beam_size == 1 or sampled else float(totals[j])
                scored[row] = (compression_ratio(ended, cfg.tgt_vocab_size), average)
    if measures is not None:
        measures.extend(scored)
    return results


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
