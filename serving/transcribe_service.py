"""What a served `transcribe` request gets (`seq2trt serve` of a Whisper export), without Triton in it so that it can
be tested alone: `runtime.transcription`'s Transcriber (the decoding of `seq2trt transcribe`) over a dynamically
batched list of requests.

A request's audio is the bytes of a WAV, FLAC or OGG file (`audio` BYTES [1]), or float samples (`samples` FP32
[-1], mono) with their rate (`sampling_rate` INT32 [1]); either way made into 16 kHz mono as `transcribe` reads a
file (`reference_model.audio`: channels' mean, soxr HQ). Its options are `transcribe`'s flags of the same meaning:

  language BYTES [1]       the speech's language code (default: the model's, else detected)   --language
  task BYTES [1]           transcribe, or translate into English                               --task
  beam_size INT32 [1]      beam size, 1 greedy (default: the model's num_beams)                --beam-size
                           (num_beams: its deprecated spelling, accepted with a logged warning)
  max_new_tokens INT32 [1] tokens a window at most                                             --max-new-tokens
  timestamps BOOL [1]      decode timestamps: segments with their times                        --timestamps
  condition_on_prev_tokens BOOL [1]   long-form: each window after the previous text   --condition-on-prev-tokens
  temperature FP32 [-1]    one temperature, or the fallback list (0, 0.2, ...)                 --temperature
  compression_ratio_threshold FP32 [1]  fall back above this zlib ratio             --compression-ratio-threshold
  logprob_threshold FP32 [1]  fall back below this average log-probability              --logprob-threshold
  seed INT64 [1]           the sampling draws' seed (each group's batch: torch.manual_seed)    --seed


Each request is checked alone (a bad one gets its own error naming the request parameter, the others go on), then
the requests are grouped by their options and each group is transcribed in the batches the export's max_batch allows;
rows are independent in every search, so a request gets what `seq2trt transcribe --backend B` gives for its audio (a
clip over 30 s long-form, as there).
"""

from __future__ import annotations

import contextlib
import io
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from seq2trt.core.errors import InputError, Seq2TrtError, first_line

from seq2trt.runtime.transcription import MAX_SECONDS, Transcriber, Transcription, open_transcriber
from seq2trt.serving.decode_service import request_message

logger = logging.getLogger(__name__)

FORMATS = "WAV, FLAC or OGG"


@dataclass(frozen=True)
class SpeechJob:
    """One request: its 16 kHz mono clip and its own options (None: the model's defaults)."""
    clip: np.ndarray
    language: str | None = None
    task: str | None = None
    beam_size: int | None = None
    max_new_tokens: int | None = None
    timestamps: bool = False
    # transformers' long-form options (`Transcriber.transcribe`; None / False: not used)
    condition_on_prev_tokens: bool = False
    temperature: tuple[float, ...] | None = None
    compression_ratio_threshold: float | None = None
    logprob_threshold: float | None = None
    seed: int | None = None
    beam_input: str = "beam_size"  # the input that gave the beam size (num_beams: its deprecated spelling)

    @property
    def long_form(self) -> dict:
        return dict(condition_on_prev_tokens=self.condition_on_prev_tokens, temperature=self.temperature,
                    compression_ratio_threshold=self.compression_ratio_threshold,
                    logprob_threshold=self.logprob_threshold, seed=self.seed)

    @property
    def key(self) -> tuple:
        return (self.language, self.task, self.beam_size, self.max_new_tokens, self.timestamps,
                *self.long_form.values())


class TranscribeService:
    """The Whisper export opened once for transcription; `run(jobs)` transcribes a batch of requests, one
    Transcription or error per request."""

    def __init__(self, out: Path, backend: str, checkpoint: Path | None = None, threads: int = 1,
                 transcriber: Transcriber | None = None):
        self._stack = contextlib.ExitStack()
        if transcriber is None:
            transcriber = self._stack.enter_context(open_transcriber(Path(out), backend, checkpoint, threads))
        self.transcriber = transcriber
        self.max_batch = transcriber.opened.max_batch

    def close(self) -> None:
        self._stack.close()

    @property
    def max_beams(self) -> int:
        return self.max_batch or 64

    def check(self, job: SpeechJob) -> None:
        """Raise an InputError naming what is wrong with the job's options."""
        if job.beam_size is not None and not 1 <= job.beam_size <= self.max_beams:
            raise InputError(f"{job.beam_input} must be in [1, {self.max_beams}] (the export's max_batch), got "
                             f"{job.beam_size}")
        if job.max_new_tokens is not None and job.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be an integer >= 1, got {job.max_new_tokens}; give the most "
                             "tokens a window may take")
        try:
            self.transcriber.check(job.language, job.task, job.beam_size, job.max_new_tokens, 1, **job.long_form)
            # refused alone, not with the requests it would be grouped with
            self.transcriber.check_timestamps([job.clip], job.timestamps)
        except Seq2TrtError as exc:
            raise InputError(request_message(str(exc))) from None

    def _transcribe(self, jobs: list[SpeechJob]) -> list[Transcription]:
        first = jobs[0]
        try:
            return list(self.transcriber.transcribe(
                [j.clip for j in jobs], language=first.language, task=first.task, timestamps=first.timestamps,
                beam=first.beam_size, max_new_tokens=first.max_new_tokens, batch_size=len(jobs), **first.long_form))
        except Seq2TrtError as exc:  # the request's fault (an input or what this model cannot do): HTTP 400
            raise InputError(request_message(str(exc))) from None

    def run(self, jobs: list[SpeechJob]) -> list[Transcription | Exception]:
        """Each job's Transcription, or the error that refused it, in order."""
        results: list[Transcription | Exception | None] = [None] * len(jobs)
        groups: dict[tuple, list[int]] = {}
        for n, job in enumerate(jobs):
            try:
                self.check(job)
            except InputError as exc:
                results[n] = exc
                continue
            groups.setdefault(job.key, []).append(n)
        for members in groups.values():
            try:
                found = self._transcribe([jobs[n] for n in members])
            except InputError as exc:
                found = [exc] * len(members)
            except Exception as exc:  # a failed group must not take the batch's other groups with it
                logger.exception("transcribing %d requests failed", len(members))
                found = [exc] * len(members)
            for n, result in zip(members, found):
                results[n] = result
        return results


def _check_seconds(frames: int, rate: int, max_seconds: float | None) -> None:
    if frames == 0:
        raise InputError("the request's audio holds no samples; give audio at least one sample long")
    if max_seconds is not None and frames > max_seconds * rate:
        raise InputError(f"the request's audio is {frames / rate:.2f} s long, over the server's limit of "
                         f"{max_seconds:g} s; send it in pieces of {max_seconds:g} s or less")


def clip_from_bytes(data: bytes, max_seconds: float | None = MAX_SECONDS) -> np.ndarray:
    """16 kHz mono float32 samples of an audio file's bytes (WAV, FLAC, OGG), as `transcribe` reads that file."""
    from seq2trt.reference_model.audio import _soundfile, prepare_audio

    if not data:
        raise InputError(f"audio is empty (0 bytes); give the bytes of a {FORMATS} file")
    sf = _soundfile()
    try:
        info = sf.info(io.BytesIO(data))
        if info.frames == 0:
            raise InputError(f"audio holds no samples libsndfile can read (a header alone, or a cut-off stream); "
                             f"give the bytes of a {FORMATS} file that holds audio")
        _check_seconds(info.frames, info.samplerate, max_seconds)
        samples, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (sf.SoundFileError, RuntimeError, TypeError) as exc:
        why = getattr(exc, "error_string", None) or first_line(exc)  # libsndfile's reason
        raise InputError(f"audio is corrupt or in a format libsndfile cannot read ({why}); give the bytes of a "
                         f"{FORMATS} file, or float samples as `samples` with `sampling_rate`") from None
    return prepare_audio(samples, rate, max_seconds, "the request's audio")


def clip_from_samples(samples: np.ndarray, sampling_rate: int | None,
                      max_seconds: float | None = MAX_SECONDS) -> np.ndarray:
    """16 kHz mono float32 samples of a request's `samples` ([1, N] once batched) at `sampling_rate` Hz."""
    from seq2trt.reference_model.audio import prepare_audio

    if sampling_rate is None:
        raise InputError("input 'sampling_rate' is missing; give the rate of `samples` in Hz as INT32 [1, 1], "
                         "e.g. 16000")
    if samples.ndim != 2 or samples.shape[0] != 1:
        raise InputError(f"samples must hold one mono clip per request (shape [1, N]), got shape "
                         f"{list(samples.shape)}")
    if sampling_rate <= 0:
        raise InputError(f"sampling_rate must be a positive whole number of Hz, got {sampling_rate}; give the rate "
                         "the samples were recorded at, e.g. 16000")
    _check_seconds(samples.shape[1], sampling_rate, max_seconds)
    return prepare_audio(samples[0], int(sampling_rate), max_seconds, "the request's samples")


def request_clip(audio: np.ndarray | None, samples: np.ndarray | None, sampling_rate: int | None,
                 max_seconds: float | None = MAX_SECONDS) -> np.ndarray:
    """A request's clip: from `audio` (file bytes, BYTES [1, 1]) or `samples` with `sampling_rate`, not both."""
    if audio is not None and samples is not None:
        raise InputError("the request gives both `audio` and `samples`; give one: the file's bytes as `audio`, or "
                         "its float samples as `samples` with `sampling_rate`")
    if audio is not None:
        if audio.size != 1:
            raise InputError(f"audio must hold one file per request, got shape {list(audio.shape)}")
        value = audio.reshape(-1)[0]
        return clip_from_bytes(value if isinstance(value, bytes) else str(value).encode("utf-8"), max_seconds)
    if samples is not None:
        return clip_from_samples(samples, sampling_rate, max_seconds)
    raise InputError(f"input 'audio' is missing; give the bytes of a {FORMATS} file as BYTES [1, 1], or float "
                     "samples as `samples` FP32 [1, N] with `sampling_rate` INT32 [1, 1]")


def transcription_record(t: Transcription) -> dict:
    """A transcription as `seq2trt transcribe --format json` prints it (less the file): language, text, tokens and
    segments [{start, end, text, tokens}], times rounded to the millisecond."""
    return {"language": t.language, "text": t.text, "tokens": t.tokens,
            "segments": [{"start": round(s.start, 3), "end": round(s.end, 3), "text": s.text, "tokens": s.tokens}
                         for s in t.segments]}
