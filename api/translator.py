"""`Translator`: a checkpoint or an export opened once with any decode backend, then asked for translations from
Python — the objects and the decode path `seq2trt translate` uses (runtime/decode_jobs.py: open_decoder, decode_job),
with the same checks and the same typed errors.

    with seq2trt.Translator("out", backend="ort-fused") as translator:
        for hyp in translator.translate(["kalo mine suta"], beam_size=4):
            print(hyp.text, hyp.ids)

    with seq2trt.Translator("whisper-ckpt", backend="eager") as whisper:
        for result in whisper.transcribe(["talk.wav"], language="en"):
            print(result.language, result.text, [(s.start, s.end) for s in result.segments])

Thread safety: one Translator may be called from several threads at once. The CPU backends (eager, ort,
ort-fused, ort-int8) run concurrently — an ONNX Runtime session and an eval-mode torch module take concurrent
calls, and the decoding loops keep their state in locals; the others (TensorRT engines, whose execution context
holds one call's shapes, and ONNX Runtime's BeamSearch graph) take one call at a time under a lock. Each call
returns what it would return alone.
"""

from __future__ import annotations

import contextlib
import numbers
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, Union

import numpy as np

from seq2trt.reference_model.decoding import GNMT_ALPHA, DecodeSettings
from seq2trt.reference_model.decoding.options import DECODE_OPTIONS, SETTING_FIELDS, renamed_kwargs, spelling
from seq2trt.core.errors import InputError
from seq2trt.runtime.registry import CONCURRENT_BACKENDS, DECODE_BACKENDS  # CONCURRENT: the kinds' modules say
from seq2trt.runtime.decode_jobs import FLAGS as DECODE_FLAGS
from seq2trt.runtime.decode_jobs import check_decode_options, check_threads, decode_job, has_tokenizer, open_decoder
from seq2trt.runtime.transcription import (MAX_SECONDS, TRANSCRIBE_BACKENDS, TranscribedSegment, Transcriber,
                                           Transcription, check_backend, refuse_speech_model, refuse_text_model)

__all__ = ["Translator", "Hypothesis", "Transcription", "TranscribedSegment", "check_decode_options",
           "CONCURRENT_BACKENDS", "SEARCH_OPTIONS"]

Audio = Union[str, Path, np.ndarray]  # a WAV/FLAC/OGG file, or float samples (n,) or (n, channels)

# What a refusal of bytes adds: the API reads files and arrays, not encoded audio in memory.
_BYTES_HINT = " (encoded audio: write them to a file, or decode them with soundfile.read(io.BytesIO(data)))"

# The keyword options of translate/generate beyond their named parameters (beam_size, max_new_tokens, length_penalty,
# scores, n_best) -> the DecodeSettings field each sets: a view of the one options table (options.DECODE_OPTIONS).
_NAMED = ("scores", "n_best")
SEARCH_OPTIONS = {o.kwarg: o.field for o in DECODE_OPTIONS if o.field in SETTING_FIELDS and o.kwarg not in _NAMED}


@dataclass(frozen=True)
class Hypothesis:
    """One decoded output: `ids` (generated token ids, without the start token and eos), `text` (the ids through
    the checkpoint's tokenizer, None when it has none) and `score` (asked with `scores=True`, else None): beam
    search's own score (Hugging Face's sequences_scores for imported models, GNMT's for models trained here), the
    sum of the tokens' log-probabilities for greedy search and sampling."""

    ids: list[int]
    text: str | None = None
    score: float | None = None
    # Asked with `token_logprobs=True`: each generated token's log-probability where the search chose it, the
    # closing eos included when one was generated (transformers' compute_transition_scores).
    token_logprobs: tuple[float, ...] | None = None


# translate/generate's keywords by the DecodeSettings field (or decode_job option) each sets: what the API's
# messages name (the CLI's name its flags: options.spelling("flag")).
KEYWORDS = {**spelling("kwarg"), "batch_size": "batch_size", "threads": "threads", "src_lang": "src_lang",
            "tgt_lang": "tgt_lang"}
# The same names as `seq2trt translate` spells them: the CLI is a Translator opened with spelling="flag".
FLAGS = {**DECODE_FLAGS, "threads": "--threads", "src_lang": "--src-lang", "tgt_lang": "--tgt-lang"}


class Translator:
    """A checkpoint (backend "eager") or an export directory (any backend of `seq2trt.DECODE_BACKENDS`) opened for
    decoding. `threads`: ONNX Runtime's intra-op threads, and torch's while the Translator is open. `checkpoint`:
    the export's checkpoint, if it moved (its tokenizer and generation settings are read there). `src_lang`,
    `tgt_lang`: language codes of mBART-50 / M2M100 / NLLB tokenizers (the target code is forced first). A Whisper
    checkpoint or export is opened for `transcribe` (backends with a step model: not ort-generate*); a text model
    for `translate` and `generate`. `spelling`: how errors name the options, "kwarg" (this API's keywords) or "flag"
    (`seq2trt translate`'s flags: that command is a Translator opened so); `speech` False refuses a speech model
    when it is opened (translate's refusal) instead of opening it for `transcribe`.

    Use it as a context manager, or call `close()`: that releases the sessions and restores torch's threads.
    """

    def __init__(self, path: str | Path, backend: str = "ort-fused", threads: int = 1,
                 checkpoint: str | Path | None = None, src_lang: str | None = None, tgt_lang: str | None = None, *,
                 spelling: str = "kwarg", speech: bool = True):
        if not isinstance(path, (str, Path)):
            raise InputError(f"path must be a checkpoint or export directory (a str or Path), got "
                             f"{type(path).__name__} {path!r}")
        if backend not in DECODE_BACKENDS:
            raise InputError(f"unknown backend {backend!r}; choose one of {', '.join(DECODE_BACKENDS)}")
        self._names = FLAGS if spelling == "flag" else KEYWORDS
        check_threads(threads, self._names["threads"])
        self.path, self.backend = Path(path), backend
        if speech:
            self._refuse_whole_search_on_speech()
        self._stack = contextlib.ExitStack()
        self._lock = threading.Lock() if backend not in CONCURRENT_BACKENDS else contextlib.nullcontext()
        try:
            self._opened = self._stack.enter_context(
                open_decoder(self.path, backend, checkpoint and Path(checkpoint), threads))
            self.config = self._opened.config
            self._transcriber: Transcriber | None = None
            self._codec = None
            if self.config.audio:
                if not speech:
                    refuse_speech_model(self.config)
                check_backend(backend)
                if src_lang or tgt_lang:
                    raise InputError("src_lang/tgt_lang are for text models; a speech model takes transcribe("
                                     "language=...)")
                self._transcriber = Transcriber(self._opened, self.path, threads)
            else:
                self._codec = self._load_codec(self._opened.folder, src_lang, tgt_lang)
        except BaseException:
            self._stack.close()
            raise
        self._closed = False

    def _refuse_whole_search_on_speech(self) -> None:
        """A speech export with a whole-search backend (generate.onnx) is refused before anything is opened."""
        from seq2trt.exporters.manifest import read_manifest
        from seq2trt.core.layout import MANIFEST

        if self.backend not in TRANSCRIBE_BACKENDS and (self.path / MANIFEST).is_file():
            if read_manifest(self.path).config.audio:
                check_backend(self.backend)

    def _load_codec(self, folder: Path, src_lang: str | None, tgt_lang: str | None):
        from seq2trt.hf_import.text import load_codec

        if not has_tokenizer(folder):
            if src_lang or tgt_lang:
                name, lang = (self._names["tgt_lang"], tgt_lang) if tgt_lang else (self._names["src_lang"], src_lang)
                raise InputError(f"{name} {lang} needs the model's tokenizer (its language codes), and {folder} has "
                                 f"none (no tokenizer/ and no vocab.json); drop {name}, or import the model with its "
                                 "tokenizer files")
            return None
        return load_codec(folder, self.config.eos_id, src_lang, tgt_lang)

    @property
    def has_tokenizer(self) -> bool:
        """Whether `translate` can take texts (the checkpoint has a tokenizer; `generate` always takes ids), or for a
        speech model whether `transcribe` returns text besides ids."""
        if self._transcriber is not None:
            return self._transcriber.has_tokenizer
        return self._codec is not None

    def translate(self, texts: Sequence[str], beam_size: int | None = None, max_new_tokens: int | None = None,
                  length_penalty: float | None = None, batch_size: int = 32, scores: bool = False,
                  n_best: int | None = None, **search: Any) -> list[Hypothesis] | list[list[Hypothesis]]:
        """Translate `texts` (encoded by the checkpoint's tokenizer); one Hypothesis each, in order, or with
        `n_best` a list of that many each (at most `beam_size`, or that many samples).
        `beam_size`: 1 greedy (None: an imported model's num_beams, else 1); `length_penalty`: GNMT's (alpha) for
        models trained here (None: GNMT_ALPHA; imported ones use their own); `max_new_tokens`: tokens generated at
        most, eos included (None: the model's limit); `scores`: fill each Hypothesis's score. `search`: SEARCH_OPTIONS
        (sample, temperature, top_k, top_p, seed, min_length, min_new_tokens, no_repeat_ngram_size,
        repetition_penalty, token_logprobs, fast_sampling), as `seq2trt translate`'s flags of those names; None or
        absent: the model's own. `beam=` and `alpha=` are the deprecated spellings of `beam_size=` and
        `length_penalty=` (a FutureWarning)."""
        refuse_speech_model(self.config, "Translator.translate")
        if isinstance(texts, str):
            raise InputError("texts must be a list of strings, got one string; wrap it in a list")
        self.check_text()
        texts = list(texts)  # an iterator is read once
        for n, text in enumerate(texts, 1):
            if not isinstance(text, str):
                raise InputError(f"text {n} is a {type(text).__name__}, not a string; texts must be a list of "
                                 "strings" + (" (decode bytes first)" if isinstance(text, bytes) else ""))
            if not text.strip():
                raise InputError(f"text {n} is empty; give at least one symbol")
        (beam_size, alpha), options = self._options(beam_size, length_penalty, scores, n_best, search)
        return self._run([self.encode(t) for t in texts], beam_size, max_new_tokens, alpha, batch_size,
                         options, n_best is not None)

    def generate(self, ids: Sequence[Sequence[int]], beam_size: int | None = None, max_new_tokens: int | None = None,
                 length_penalty: float | None = None, batch_size: int = 32, scores: bool = False,
                 n_best: int | None = None, **search: Any) -> list[Hypothesis] | list[list[Hypothesis]]:
        """Decode source token ids (used as given: include eos where the model expects it); options as `translate`."""
        refuse_speech_model(self.config, "Translator.generate")
        sources = []
        for n, source in enumerate(ids, 1):
            source = list(source)
            if not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in source):
                raise InputError(f"source {n} must be a list of integer token ids, got {source[:8]!r}")
            sources.append([int(i) for i in source])  # numpy integers too
        (beam_size, alpha), options = self._options(beam_size, length_penalty, scores, n_best, search)
        return self._run(sources, beam_size, max_new_tokens, alpha, batch_size, options, n_best is not None)

    @staticmethod
    def _options(beam_size: int | None, length_penalty: float | None, scores: bool, n_best: int | None,
                 search: dict[str, Any]) -> tuple[tuple[int | None, float], dict[str, Any]]:
        """((the beam size, the length penalty), the DecodeSettings fields `search` and the named options set); the
        deprecated spellings warned and renamed, an unknown keyword refused."""
        search = renamed_kwargs({**search, "beam_size": beam_size, "length_penalty": length_penalty}, stacklevel=4)
        beam_size, length_penalty = search.pop("beam_size"), search.pop("length_penalty")
        unknown = sorted(set(search) - set(SEARCH_OPTIONS))
        if unknown:
            raise InputError(f"unknown search option(s) {', '.join(unknown)}; Translator takes beam_size, "
                             "max_new_tokens, length_penalty, batch_size, scores, n_best and "
                             f"{', '.join(SEARCH_OPTIONS)}")
        options = {SEARCH_OPTIONS[k]: v for k, v in search.items()}
        options.update(num_return_sequences=n_best, output_scores=scores or None)
        return (beam_size, GNMT_ALPHA if length_penalty is None else length_penalty), options

    def check_text(self) -> None:
        """Refuse texts when the checkpoint has no tokenizer, saying how to give token ids instead."""
        if self._codec is None:
            how = ("with --ids-file F (JSON lines, one list of source ids per line)" if self._names is FLAGS else
                   "to Translator.generate")
            raise InputError(f"{self._opened.folder} has no tokenizer (no tokenizer/ and no vocab.json), so text "
                             f"cannot be encoded; give token ids {how}")

    def encode(self, text: str) -> list[int]:
        """A text as the model's source ids (eos included where the model expects it)."""
        self.check_text()
        return self._codec.encode(text)

    def text(self, ids: list[int]) -> str | None:
        """Generated ids as text; None without a tokenizer."""
        return self._codec.decode(ids) if self._codec is not None else None

    @property
    def folder(self) -> Path:
        """The checkpoint folder its tokenizer and generation settings are read from."""
        return self._opened.folder

    def stream(self, sources: list[list[int]], origin: str, beam_size: int | None, max_new_tokens: int | None,
               alpha: float, batch_size: int, options: dict[str, Any]) -> tuple[DecodeSettings, Iterator[list]]:
        """The decode `translate` and `generate` collect and `seq2trt translate` prints as each batch finishes:
        (settings, each source's search output in input order: its token ids when `settings.plain`, else its list
        of decoding.Hypothesis). Everything is checked before it returns (errors name a source by `origin` and its
        number); `options`: DecodeSettings fields (options.SETTING_FIELDS; None: the model's own)."""
        if self._closed:
            raise InputError("this Translator is closed; open a new one")
        check_decode_options(alpha, batch_size, self._names)
        forced = self._codec.forced_bos_id if self._codec is not None else None
        with self._lock:
            settings, decoded = decode_job(self._opened, self.backend, sources, origin, beam_size, alpha,
                                           max_new_tokens, batch_size, forced, options, self._names)
        return settings, self._locked(decoded)

    def _locked(self, decoded: Iterator[list]) -> Iterator[list]:
        with self._lock:  # the decode runs as the outputs are read
            yield from decoded

    def _run(self, sources: list[list[int]], beam_size: int | None, max_new_tokens: int | None, alpha: float,
             batch_size: int, options: dict[str, Any], lists: bool) -> list[Hypothesis] | list[list[Hypothesis]]:
        if not sources:
            if self._closed:
                raise InputError("this Translator is closed; open a new one")
            check_decode_options(alpha, batch_size, self._names)
            return []
        settings, decoded = self.stream(sources, "source", beam_size, max_new_tokens, alpha, batch_size, options)
        outputs = list(decoded)
        found = [[self._hypothesis(out, None)] if settings.plain else
                 [self._hypothesis(h.tokens, h.score if settings.output_scores else None, h.token_logprobs)
                  for h in out]
                 for out in outputs]
        return found if lists else [hyps[0] for hyps in found]

    def _hypothesis(self, ids: list[int], score: float | None, token_logprobs=None) -> Hypothesis:
        return Hypothesis(ids, self.text(ids), score, token_logprobs)

    def transcribe(self, audio: Audio | Sequence[Audio], sampling_rate: int | None = None, *,
                   language: str | None = None, task: str | None = None, timestamps: bool = False,
                   beam_size: int | None = None, max_new_tokens: int | None = None, batch_size: int = 16,
                   max_seconds: float | None = MAX_SECONDS,
                   progress: Callable[[int, int], None] | None = None, condition_on_prev_tokens: bool = False,
                   temperature: float | Sequence[float] | None = None,
                   compression_ratio_threshold: float | None = None, logprob_threshold: float | None = None,
                   seed: int | None = None, **deprecated: Any) -> list[Transcription]:
        """Transcribe speech with a Whisper model: one Transcription per clip, in order (a list of one for one clip).
        `audio`: a file path (WAV, FLAC, OGG; any rate and channels), a float array of samples (n,) or (n, channels) at
        `sampling_rate` Hz (required for arrays; mixed to mono and resampled to 16 kHz as files are), or a list of
        either. `language`: its code ("en"; None: the model's, else detected per clip); `task`: "transcribe" or
        "translate" (into English; multilingual models); `timestamps`: segments cut at the decoded timestamps;
        `beam_size` (None: the model's num_beams; `beam=`: its deprecated spelling); `max_new_tokens`: tokens a window
        generates at most, eos included; `max_seconds`: longest clip accepted (None: any); `progress(done, total)`:
        after each batch of `batch_size` clips. transformers' long-form options, as its `generate` takes them (defaults:
        none): `condition_on_prev_tokens` (each window after a clip's first decoded after its previous text),
        `temperature` (a number, or a list such as (0.0, 0.2, 0.4, 0.6, 0.8, 1.0): a window failing
        `compression_ratio_threshold` or `logprob_threshold` is decoded again at the next one, sampling), `seed` (each
        batch's draws: `torch.manual_seed(seed)` before generate; batch_size 1 reproduces generate's for each clip).
        Every clip and option is checked before the first is decoded. Raises InputError for a text model (use
        `translate`)."""
        if self._closed:
            raise InputError("this Translator is closed; open a new one")
        refuse_text_model(self.config, self.path)
        beam = self._beam_size(beam_size, deprecated)
        transcriber = self._transcriber
        long_form = dict(condition_on_prev_tokens=condition_on_prev_tokens, temperature=temperature,
                         compression_ratio_threshold=compression_ratio_threshold,
                         logprob_threshold=logprob_threshold, seed=seed)
        transcriber.check(language, task, beam, max_new_tokens, batch_size, **long_form)
        clips = self._clips(audio, sampling_rate, max_seconds)
        with self._lock:
            return list(transcriber.transcribe(
                clips, language=language, task=task, timestamps=timestamps, beam=beam,
                max_new_tokens=max_new_tokens, batch_size=batch_size,
                progress=None if progress is None else lambda done: progress(done, len(clips)), **long_form))

    @staticmethod
    def _beam_size(beam_size: int | None, deprecated: dict[str, Any]) -> int | None:
        """transcribe's beam size, `beam=` (deprecated) renamed with a warning; any other keyword refused."""
        given = renamed_kwargs({**deprecated, "beam_size": beam_size}, stacklevel=4)
        unknown = sorted(set(given) - {"beam_size"})
        if unknown:
            raise InputError(f"unknown option(s) {', '.join(unknown)} of transcribe; see help(Translator.transcribe)")
        return given["beam_size"]

    @staticmethod
    def _clips(audio: Audio | Sequence[Audio], sampling_rate: int | None,
               max_seconds: float | None) -> list[np.ndarray]:
        """16 kHz mono float32 clips from `audio` (see `transcribe`), each checked."""
        from seq2trt.reference_model.audio import load_audio, prepare_audio

        if isinstance(audio, (str, Path, np.ndarray)):
            items = [audio]
        elif isinstance(audio, (list, tuple)):
            items = list(audio)
        else:
            raise InputError(f"audio is a {type(audio).__name__}; give a file path, an array of samples, or a list "
                             "of them" + _BYTES_HINT * isinstance(audio, (bytes, bytearray)))
        if not items:
            raise InputError("no audio given; pass a file path, an array of samples, or a list of them")
        clips = []
        for n, item in enumerate(items, 1):
            if isinstance(item, (str, Path)):
                clips.append(load_audio(item, max_seconds))
            elif isinstance(item, np.ndarray):
                if sampling_rate is None:
                    raise InputError(f"audio {n} is an array and no sampling_rate was given; pass "
                                     "sampling_rate=<Hz> (e.g. 16000) with arrays of samples")
                clips.append(prepare_audio(item, sampling_rate, max_seconds, where=f"audio {n}"))
            else:
                raise InputError(f"audio {n} is a {type(item).__name__}; give a file path or a numpy array of float "
                                 "samples (a list of numbers: np.asarray it first)"
                                 + _BYTES_HINT * isinstance(item, (bytes, bytearray)))
        return clips

    def close(self) -> None:
        """Release the sessions (and torch's threads); later calls raise."""
        self._closed = True
        self._stack.close()

    def __enter__(self) -> "Translator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
