"""Speech to text with a Whisper checkpoint or export: audio in, log-mel features, `reference_model.longform.transcribe`
over the step model of any backend that has one, the tokens decoded to text by the checkpoint's tokenizer.

The checkpoint or export is opened as `translate` opens it (`decode_jobs.open_decoder`: the registry's opener, the
manifest and graph checks, torch's threads). Features of a clip of at most 30 s are those of its audio padded to 30 s
(what `WhisperFeatureExtractor` returns by default); a longer clip's are those of the whole clip (long-form). They
come from the export's features.onnx (checked against the manifest) for clips of at most 30 s, else from the torch
module of `exporters.whisper_features`, with the checkpoint's tokenizer/preprocessor_config.json when it has one
(the default extractor for its number of mel bins otherwise). Text needs the tokenizer files of the import
(tokenizer/); without them a transcription holds its ids alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from seq2trt.core import layout
from seq2trt.core.errors import InputError
from seq2trt.hf_import.families.whisper import FEATURE_EXTRACTOR
from seq2trt.runtime.decode_jobs import (OpenedDecoder, batch_rows, check_beam_memory, generation_config, open_decoder)
from seq2trt.reference_model.decoding.options import spelling
from seq2trt.runtime.registry import names

logger = logging.getLogger(__name__)

# A speech model runs seq2trt's search over a step model: a whole-search graph (generate.onnx) has no prompt input.
TRANSCRIBE_BACKENDS = names(translate=True, whole_search=False)
MAX_SECONDS = 4 * 3600.0  # the default longest clip: 4 h of 16 kHz float32 is 920 MB of samples


@dataclass(frozen=True)
class TranscribedSegment:
    """A stretch of the audio: `start` and `end` in seconds from its start, its text tokens, their text (None
    without a tokenizer)."""

    start: float
    end: float
    tokens: list[int]
    text: str | None


@dataclass(frozen=True)
class Transcription:
    """One clip's transcription: `tokens` (every text token in order: no prompt, timestamps or eos), `text` (the
    tokens through the checkpoint's tokenizer, special tokens skipped; None without one), `language` (the code it
    was decoded with, given or detected; "en" on an English-only model), `segments` (without timestamps one, over
    the whole clip), `duration` (seconds of audio)."""

    tokens: list[int]
    text: str | None
    language: str | None
    segments: list[TranscribedSegment]
    duration: float

    def as_dict(self) -> dict:
        """{language, text, tokens, segments: [{start, end, text, tokens}]}, times rounded to the millisecond: what
        `seq2trt transcribe --format json` prints for a file (beside its name)."""
        return {"language": self.language, "text": self.text, "tokens": self.tokens,
                "segments": [{"start": round(s.start, 3), "end": round(s.end, 3), "text": s.text,
                              "tokens": s.tokens} for s in self.segments]}


def refuse_speech_model(cfg, verb: str = "translate") -> None:
    """A Whisper model given to a verb that feeds token ids is refused, naming the verb that reads audio."""
    if getattr(cfg, "audio", False):
        raise InputError(f"this is a speech model (it reads audio, not token ids), so {verb} cannot run it; "
                         "use `seq2trt transcribe MODEL AUDIO...` (Translator.transcribe in Python)")


def refuse_text_model(cfg, where: Path) -> None:
    if not getattr(cfg, "audio", False):
        raise InputError(f"{where} is a text model: this model reads token ids; use translate "
                         "(`seq2trt translate`, Translator.translate)")


def check_backend(backend: str) -> None:
    if backend not in TRANSCRIBE_BACKENDS:
        raise InputError(f"backend {backend!r} cannot transcribe (a speech model runs seq2trt's search over a step "
                         f"model); choose one of {', '.join(TRANSCRIBE_BACKENDS)}")


def text_tokenizer(folder: Path, eos_id: int):
    """The checkpoint's text codec (hf_import.text) when tokenizer/ holds a vocabulary, else None."""
    from seq2trt.hf_import.families import vocabulary_files

    tokenizer = Path(folder) / layout.TOKENIZER_DIR
    if not tokenizer.is_dir() or not vocabulary_files(tokenizer):
        return None
    from seq2trt.hf_import.text import load_codec

    return load_codec(folder, eos_id)


def feature_params(folder: Path, n_mels: int, frames: int):
    """The feature extractor's settings: the checkpoint's preprocessor_config.json, else transformers' defaults for
    `n_mels` bins; refused when they do not make the model's (n_mels, frames) window."""
    from seq2trt.reference_model.logmel import FeatureParams

    return FeatureParams.from_file(Path(folder) / layout.TOKENIZER_DIR / FEATURE_EXTRACTOR, n_mels, frames,
                                   "re-import the model")


class FrontEnd:
    """Log-mel features (n_mels, frames) of 16 kHz mono clips: a clip of at most 30 s padded to 30 s (features.onnx
    when given, one session for every batch), a longer one whole (the torch module)."""

    def __init__(self, params, graph: Path | None = None, threads: int = 1):
        self.params, self._session = params, None
        if graph is not None:
            from seq2trt.exporters.ort_session import open_session

            self._session, _ = open_session(graph, threads=threads, optimization=None)

    def _torch(self, batch: np.ndarray, params) -> np.ndarray:
        import torch

        from seq2trt.reference_model.logmel import LogMel

        with torch.no_grad():
            return LogMel(params).eval()(torch.from_numpy(batch)).numpy()

    def __call__(self, clips: Sequence[np.ndarray]) -> list[np.ndarray]:
        import dataclasses

        from seq2trt.exporters.whisper_features import INPUT, OUTPUT, pad_clips

        window = self.params.n_samples
        short = [i for i, c in enumerate(clips) if len(c) <= window]
        out: list = [None] * len(clips)
        if short:
            batch = pad_clips([clips[i] for i in short])
            found = (self._session.run([OUTPUT], {INPUT: batch})[0] if self._session is not None
                     else self._torch(batch, self.params))
            for i, features in zip(short, found):
                out[i] = features
        for i, clip in enumerate(clips):
            if out[i] is None:  # long-form: the whole clip's features, its own clamp, len // hop frames
                params = dataclasses.replace(self.params, n_samples=len(clip))
                out[i] = self._torch(np.asarray(clip, np.float32)[None], params)[0]
        return out


class Transcriber:
    """A Whisper model opened for transcription (see `open_transcriber`)."""

    def __init__(self, opened: OpenedDecoder, source: Path, threads: int = 1):
        from seq2trt.reference_model.speech import SpeechTokens

        cfg = opened.config
        refuse_text_model(cfg, source)
        self.generation = generation_config(opened.folder)
        self.speech = SpeechTokens.from_record((self.generation or {}).get("speech"))
        graph, self.decoder = None, "the model's decoder"  # as messages name it
        if (source / layout.MANIFEST).exists():
            from seq2trt.exporters.manifest import read_manifest, verify

            manifest = read_manifest(source)
            if layout.FEATURES in manifest.data["files"]:
                graph = verify(source, [layout.FEATURES]).path(layout.FEATURES)
            # An export made with a shorter --max-tgt-len holds fewer decoder positions than the model: a window's
            # decode stops there (as Seq2TrtModelForSeq2SeqLM caps max_length), and a longer max_new_tokens is
            # refused before any audio is decoded, not at the step past the export's graphs.
            limit = manifest.limits.max_tgt_len
            if limit < cfg.max_tgt_len:
                own = cfg.max_new_tokens
                cfg = dataclasses.replace(cfg, max_tgt_len=limit, max_new_tokens=None if own is None else
                                          min(own, limit - 1))
            self.decoder = "the export's decoder (its max_tgt_len)"
        self.opened, self.config = opened, cfg
        self.front_end = FrontEnd(feature_params(opened.folder, cfg.n_mels, cfg.source_frames), graph, threads)
        self.codec = text_tokenizer(opened.folder, cfg.eos_id)

    @property
    def has_tokenizer(self) -> bool:
        return self.codec is not None

    def beams(self, beam: int | None) -> int:
        """`beam`, or the model's num_beams; an integer >= 1."""
        beams = beam if beam is not None else (self.generation or {}).get("num_beams", 1)
        if not isinstance(beams, int) or isinstance(beams, bool) or beams < 1:
            raise InputError(f"the beam size must be an integer >= 1, got {beams!r}")
        return beams

    def check(self, language: str | None, task: str | None, beam: int | None, max_new_tokens: int | None,
              batch_size: int, name: str = "max_new_tokens", **long_form) -> int:
        """Every option checked before audio is read; returns the clips a batch takes. `name`: what messages call
        max_new_tokens (the CLI's --max-new-tokens). `long_form`: the options of
        `reference_model.longform.WindowOptions.checked` (condition_on_prev_tokens, temperature,
        compression_ratio_threshold, logprob_threshold, no_speech_threshold, seed), a bad value refused naming it."""
        from seq2trt.reference_model.speech import generation_limit
        from seq2trt.reference_model.longform import WindowOptions

        if WindowOptions.checked(**long_form).condition_on_prev_tokens:
            self.speech.previous_start()  # an older import: refused before any audio is read
        code, task = self.speech.check_language(language), self.speech.check_task(task)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InputError(f"the batch size must be an integer >= 1, got {batch_size!r}")
        if max_new_tokens is not None:  # every language's prompt is as long: any one measures the room left
            generation_limit(self.config, self.speech.prompt(code or next(iter(self.speech.languages), None), task),
                             max_new_tokens, name=name, decoder=self.decoder)
        beam_name = spelling("flag" if name.startswith("--") else "kwarg")["beam_size"]  # as `name` is spelled
        check_beam_memory(self.config, self.beams(beam), beam_name)  # a hang or a huge allocation otherwise
        return batch_rows(batch_size, self.opened.max_batch, self.beams(beam), beam_name)

    def check_timestamps(self, clips: Sequence[np.ndarray], timestamps: bool) -> None:
        """Refuse, before any decode, timestamps or a clip past 30 s (long-form decodes with timestamps) on a model
        without timestamp tokens: the rest of such a clip would be dropped."""
        if timestamps or any(len(c) > self.front_end.params.n_samples for c in clips):
            self.speech.timestamp_begin(self.config)

    def decode_text(self, tokens: list[int]) -> str | None:
        return self.codec.decode(tokens) if self.codec is not None else None

    def transcribe(self, clips: Sequence[np.ndarray], *, language: str | None = None, task: str | None = None,
                   timestamps: bool = False, beam: int | None = None, max_new_tokens: int | None = None,
                   batch_size: int = 16, names: Sequence[str] | None = None,
                   progress: Callable[[int], None] | None = None, condition_on_prev_tokens: bool = False,
                   temperature: float | Sequence[float] | None = None,
                   compression_ratio_threshold: float | None = None, logprob_threshold: float | None = None,
                   seed: int | None = None) -> Iterator[Transcription]:
        """One Transcription per 16 kHz mono clip, in order, decoded in batches (options checked before the first);
        `progress(done)` after each batch; errors of a batch name its clips by `names`. transformers' long-form
        options (`reference_model.longform.transcribe`; defaults: none): `condition_on_prev_tokens`, `temperature`
        (a number or a list: fallback) with `compression_ratio_threshold` and `logprob_threshold`, and `seed`, which
        seeds each batch's decode as `torch.manual_seed(seed)` before generate (batch_size 1: each clip's draws are
        generate's for the clip alone)."""
        from seq2trt.reference_model.longform import transcribe

        long_form = dict(condition_on_prev_tokens=condition_on_prev_tokens, temperature=temperature,
                         compression_ratio_threshold=compression_ratio_threshold,
                         logprob_threshold=logprob_threshold, seed=seed)
        rows = self.check(language, task, beam, max_new_tokens, batch_size, **long_form)
        beams = self.beams(beam)
        gen = self.generation or {}
        rate, window = self.front_end.params.sampling_rate, self.front_end.params.n_samples
        self.check_timestamps(clips, timestamps)
        for start in range(0, len(clips), rows):
            batch = clips[start: start + rows]
            features = self.front_end(batch)
            try:
                found = transcribe(self.opened.model, self.config, self.speech, features, language=language,
                                   task=task, timestamps=timestamps, beam_size=beams,
                                   length_penalty=gen.get("length_penalty", 1.0),
                                   early_stopping=gen.get("early_stopping", False), max_new_tokens=max_new_tokens,
                                   generation=self.generation, **long_form)
            except InputError as exc:
                if names is None:
                    raise
                raise InputError(f"{', '.join(names[start: start + rows])}: {exc}") from None
            if progress is not None:  # before the batch's results: a caller may stop reading at the last one
                progress(start + len(batch))
            for clip, t in zip(batch, found):
                duration = len(clip) / rate
                # one window without timestamps: its one segment ends where the audio does, not its 30 s padding
                plain = not timestamps and len(clip) <= window
                segments = [TranscribedSegment(s.start, min(s.end, duration) if plain else s.end, list(s.tokens),
                                               self.decode_text(list(s.tokens))) for s in t.segments]
                language_ = t.language if self.speech.multilingual else "en"
                yield Transcription(list(t.tokens), self.decode_text(list(t.tokens)), language_, segments, duration)


def read_clips(paths: Sequence[Path], max_seconds: float | None = MAX_SECONDS) -> list[np.ndarray]:
    """Each audio file as float32 mono 16 kHz samples; a missing, empty, corrupt or over-long file is refused
    (reference_model.audio), naming it."""
    from seq2trt.reference_model.audio import load_audio

    return [load_audio(Path(p), max_seconds) for p in paths]


@contextlib.contextmanager
def open_transcriber(source: Path, backend: str = "eager", checkpoint: Path | None = None,
                     threads: int = 1) -> Iterator[Transcriber]:
    """A Whisper checkpoint (backend eager) or export (any of TRANSCRIBE_BACKENDS) opened for transcription, with
    torch held to `threads` while it is open."""
    check_backend(backend)
    source = Path(source)
    with open_decoder(source, backend, checkpoint, threads) as opened:
        yield Transcriber(opened, source, threads)
