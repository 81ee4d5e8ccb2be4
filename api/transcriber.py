"""`Transcriber`: a Whisper checkpoint or export opened once for speech to text, the speech counterpart of
`seq2trt.Translator` — the same opening, backends, checks and typed errors, and the decode path of
`seq2trt transcribe` (runtime/transcription.py).

    with seq2trt.Transcriber("whisper-out", backend="ort-fused") as whisper:
        for result in whisper.transcribe(["talk.wav"], language="en", timestamps=True):
            print(result.language, result.text, [(s.start, s.end) for s in result.segments])

It is a `Translator` restricted to speech: a text model is refused when it is opened (use `seq2trt.Translator`), and
`transcribe` is `Translator.transcribe`, so the two cannot drift apart. Thread safety is the Translator's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from seq2trt.core.errors import InputError
from seq2trt.runtime.transcription import Transcription
from seq2trt.translator import Audio, Translator

__all__ = ["Transcriber"]


class Transcriber:
    """A Whisper checkpoint (backend "eager") or export directory (a backend with a step model: any of
    `seq2trt.DECODE_BACKENDS` but ort-generate*) opened for `transcribe`. `threads`: ONNX Runtime's intra-op threads,
    and torch's while it is open; `checkpoint`: the export's checkpoint, if it moved (its tokenizer, generation and
    feature settings are read there).

    Use it as a context manager, or call `close()`.
    """

    def __init__(self, path: str | Path, backend: str = "ort-fused", threads: int = 1,
                 checkpoint: str | Path | None = None):
        self._translator = Translator(path, backend=backend, threads=threads, checkpoint=checkpoint)
        if not self._translator.config.audio:
            self._translator.close()
            raise InputError(f"{path} is a text model (it reads token ids, not audio); open it with "
                             "seq2trt.Translator and call translate")
        self.path, self.backend, self.config = self._translator.path, backend, self._translator.config

    @property
    def has_tokenizer(self) -> bool:
        """Whether transcriptions carry text besides token ids (the import kept the model's tokenizer)."""
        return self._translator.has_tokenizer

    def transcribe(self, audio: Audio | Sequence[Audio], sampling_rate: int | None = None,
                   **options: Any) -> list[Transcription]:
        """One Transcription per clip, in order (a list of one for one clip). `audio`: a file path (WAV, FLAC, OGG;
        any rate and channels), a float array of samples (n,) or (n, channels) at `sampling_rate` Hz, or a list of
        either. `options`: those of `Translator.transcribe` (language, task, timestamps, the beam size,
        max_new_tokens, batch_size, max_seconds, progress, and transformers' long-form options), checked before the
        first clip is decoded."""
        return self._translator.transcribe(audio, sampling_rate, **options)

    def close(self) -> None:
        """Release the sessions (and torch's threads); later calls raise."""
        self._translator.close()

    def __enter__(self) -> "Transcriber":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
