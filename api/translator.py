"""`Translator`: a checkpoint or an export opened once with any decode backend, then asked for translations from
Python — the objects and the decode path `seq2trt translate` uses (validation/decode_jobs.py), with the same checks
and the same typed errors.

    with seq2trt.Translator("out", backend="ort-fused") as translator:
        for hyp in translator.translate(["kalo mine suta"], beam=4):
            print(hyp.text, hyp.ids)

Thread safety: one Translator may be called from several threads at once. The CPU backends (eager, ort,
ort-fused, ort-int8) run concurrently — an ONNX Runtime session and an eval-mode torch module take concurrent
calls, and the decoding loops keep their state in locals; the others (TensorRT engines, whose execution context
holds one call's shapes, and ONNX Runtime's BeamSearch graph) take one call at a time under a lock. Each call
returns what it would return alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from seq2trt.reference_model.errors import InputError
from seq2trt.validation.backends import DECODE_BACKENDS
from seq2trt.validation.decode_jobs import (batch_rows, check_sources, choose_search, decode_batches, decode_settings,
                                            generation_config, has_tokenizer, open_decoder)

__all__ = ["Translator", "Hypothesis", "decode_sources", "check_decode_options", "CONCURRENT_BACKENDS"]

# Backends whose step model takes calls from several threads at once (see the module docstring).
CONCURRENT_BACKENDS = ("eager", "ort", "ort-fused", "ort-int8")


@dataclass(frozen=True)
class Hypothesis:
    """One decoded output: `ids` (generated token ids, without the start token and eos), `text` (the ids through
    the checkpoint's tokenizer, None when it has none) and `score` (asked with `scores=True`, else None): beam
    search's own score (Hugging Face's sequences_scores for imported models, GNMT's for models trained here), the
    sum of the tokens' log-probabilities for greedy search."""

    ids: list[int]
    text: str | None = None
    score: float | None = None


def check_decode_options(alpha: float, batch_size: int) -> None:
    """Refuse a length penalty that is not a number and a batch size under 1, before anything is opened."""
    if not alpha == alpha:
        raise InputError(f"--alpha must be a number, got {alpha}; give a length penalty such as 0.6")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int):
        raise InputError(f"--batch-size must be an integer, got {batch_size!r}")
    if batch_size < 1:
        raise InputError(f"--batch-size must be >= 1, got {batch_size}")


def decode_sources(opened: tuple, backend: str, sources: Sequence[Sequence[int]], origin: str, beam: int | None = None,
                   alpha: float = 0.6, max_new_tokens: int | None = None, batch_size: int = 32,
                   forced_bos_id: int | None = None, scores: bool = False) -> Iterator[list]:
    """Each source's generated ids, in order, decoded in padded batches (an iterator, one batch decoded at a time);
    with `scores`, each source's list of one `reference_model.decoding.Hypothesis` (tokens, score) instead.
    `opened`: what `open_decoder` yields. Everything is checked before the first decode: the sources against the
    model's limits (errors name `origin` and the source's number), the search, the length limit, the batch."""
    step_model, cfg, folder, src_limit, max_batch = opened
    check_sources(sources, cfg, *src_limit, origin)
    beams, decode = choose_search(generation_config(folder), beam, alpha)
    if backend.startswith("ort-generate"):  # the search runs inside the graph (Hugging Face's, alpha its length_penalty)
        from seq2trt.validation.generate_backend import generate_search, read_generation

        if scores:
            raise InputError(f"backend {backend} returns no scores (ONNX Runtime's BeamSearch runs the whole search); "
                             "use ort-fused or ort for scores")
        decode = generate_search(read_generation(folder), beams, alpha)
    settings = decode_settings(cfg, max_new_tokens, forced_bos_id)
    if scores:
        settings = dataclasses.replace(settings, output_scores=True)
    rows = batch_rows(batch_size, max_batch, beams)
    return decode_batches(step_model, sources, cfg.pad_id, decode, settings, rows)


class Translator:
    """A checkpoint (backend "eager") or an export directory (any backend of `seq2trt.DECODE_BACKENDS`) opened for
    decoding. `threads`: ONNX Runtime's intra-op threads, and torch's while the Translator is open. `checkpoint`:
    the export's checkpoint, if it moved (its tokenizer and generation settings are read there). `src_lang`,
    `tgt_lang`: language codes of mBART-50 / M2M100 / NLLB tokenizers (the target code is forced first).

    Use it as a context manager, or call `close()`: that releases the sessions and restores torch's threads.
    """

    def __init__(self, path: str | Path, backend: str = "ort-fused", threads: int = 1,
                 checkpoint: str | Path | None = None, src_lang: str | None = None, tgt_lang: str | None = None):
        if backend not in DECODE_BACKENDS:
            raise InputError(f"unknown backend {backend!r}; choose one of {', '.join(DECODE_BACKENDS)}")
        self.path, self.backend = Path(path), backend
        self._stack = contextlib.ExitStack()
        self._lock = threading.Lock() if backend not in CONCURRENT_BACKENDS else contextlib.nullcontext()
        try:
            self._opened = self._stack.enter_context(
                open_decoder(self.path, backend, checkpoint and Path(checkpoint), threads))
            self.config = self._opened[1]
            self._codec = self._load_codec(self._opened[2], src_lang, tgt_lang)
        except BaseException:
            self._stack.close()
            raise
        self._closed = False

    def _load_codec(self, folder: Path, src_lang: str | None, tgt_lang: str | None):
        from seq2trt.reference_model.text import load_codec

        if not has_tokenizer(folder):
            if src_lang or tgt_lang:
                raise InputError(f"language codes need the model's tokenizer, and {folder} has none (no tokenizer/ "
                                 "and no vocab.json); drop src_lang/tgt_lang, or import the model with its tokenizer")
            return None
        return load_codec(folder, self.config.eos_id, src_lang, tgt_lang)

    @property
    def has_tokenizer(self) -> bool:
        """Whether `translate` can take texts (the checkpoint has a tokenizer); `generate` always takes ids."""
        return self._codec is not None

    def translate(self, texts: Sequence[str], beam: int | None = None, max_new_tokens: int | None = None,
                  alpha: float = 0.6, batch_size: int = 32, scores: bool = False) -> list[Hypothesis]:
        """Translate `texts` (encoded by the checkpoint's tokenizer); one Hypothesis each, in order.
        `beam`: beam size, 1 greedy (None: an imported model's num_beams, else 1); `alpha`: GNMT's length penalty
        for models trained here (imported ones use their own); `max_new_tokens`: tokens generated at most, eos
        included (None: the model's limit); `scores`: fill each Hypothesis's score."""
        if isinstance(texts, str):
            raise InputError("texts must be a list of strings, got one string; wrap it in a list")
        if self._codec is None:
            raise InputError(f"{self._opened[2]} has no tokenizer (no tokenizer/ and no vocab.json), so text cannot "
                             "be encoded; give token ids to Translator.generate")
        if any(not isinstance(t, str) or not t.strip() for t in texts):
            raise InputError("empty source text; give at least one symbol")
        return self._run([self._codec.encode(t) for t in texts], beam, max_new_tokens, alpha, batch_size, scores)

    def generate(self, ids: Sequence[Sequence[int]], beam: int | None = None, max_new_tokens: int | None = None,
                 alpha: float = 0.6, batch_size: int = 32, scores: bool = False) -> list[Hypothesis]:
        """Decode source token ids (used as given: include eos where the model expects it); options as `translate`."""
        sources = []
        for n, source in enumerate(ids, 1):
            source = list(source)
            if not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in source):
                raise InputError(f"source {n} must be a list of integer token ids, got {source[:8]!r}")
            sources.append([int(i) for i in source])  # numpy integers too
        return self._run(sources, beam, max_new_tokens, alpha, batch_size, scores)

    def _run(self, sources: list[list[int]], beam: int | None, max_new_tokens: int | None, alpha: float,
             batch_size: int, scores: bool) -> list[Hypothesis]:
        if self._closed:
            raise InputError("this Translator is closed; open a new one")
        check_decode_options(alpha, batch_size)
        if not sources:
            return []
        forced = self._codec.forced_bos_id if self._codec is not None else None
        with self._lock:
            outputs = list(decode_sources(self._opened, self.backend, sources, "source", beam, alpha,
                                          max_new_tokens, batch_size, forced, scores))
        found = [(out[0].tokens, out[0].score) for out in outputs] if scores else [(out, None) for out in outputs]
        return [Hypothesis(ids, self._codec.decode(ids) if self._codec is not None else None, score)
                for ids, score in found]

    def close(self) -> None:
        """Release the sessions (and torch's threads); later calls raise."""
        self._closed = True
        self._stack.close()

    def __enter__(self) -> "Translator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
