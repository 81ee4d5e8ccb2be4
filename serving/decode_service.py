"""What a served request gets: the decoding behind `seq2trt serve`'s models `generate` (ids in, ids out) and
`translate` (text in, text out), without Triton in it so that it can be tested alone.

A batch of requests, as Triton's dynamic batcher hands it over, is checked request by request (a bad one gets its own
error, the others go on), then grouped by what changes the search — beams, max_new_tokens, the forced target
language — and each group is decoded by `decode_jobs.decode_batches`, the same function `seq2trt translate` runs, in
padded batches the export's max_batch allows. So every request gets what `translate --ids-file` gives for its ids.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from seq2trt.reference_model.decoding import GNMT_ALPHA
from seq2trt.reference_model.errors import InputError

from seq2trt.runtime.decode_jobs import (batch_rows, check_sources, choose_search, decode_batches, decode_settings, generation_config,
                          has_tokenizer, open_decoder, OpenedDecoder)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    """One request: source ids, and the request's own search settings (None: the model's defaults)."""
    ids: tuple[int, ...]
    max_new_tokens: int | None = None
    num_beams: int | None = None
    forced_bos_id: int | None = None


class DecodeService:
    """The export's step model opened once; `run(jobs)` decodes a batch of jobs, one result or error per job."""

    def __init__(self, out: Path, backend: str, checkpoint: Path | None = None, threads: int = 1, alpha: float = GNMT_ALPHA,
                 opened: OpenedDecoder | None = None):
        """Opens `backend` on the export `out`, or takes `opened` (as `decode_jobs.open_decoder` yields it)."""
        self._stack = contextlib.ExitStack()
        if opened is None:
            opened = self._stack.enter_context(open_decoder(Path(out), backend, checkpoint, threads))
        self.model, self.cfg, self.folder = opened.model, opened.config, opened.folder
        self.src_limit, self.max_batch = opened.src_limit, opened.max_batch
        self.generation = generation_config(self.folder)
        self.alpha = alpha
        self._codecs: dict[tuple[str | None, str | None], object] = {}

    def close(self) -> None:
        self._stack.close()

    @property
    def max_beams(self) -> int:
        return self.max_batch or 64

    @property
    def has_text(self) -> bool:
        return has_tokenizer(self.folder)

    def codec(self, src_lang: str | None = None, tgt_lang: str | None = None):
        """The checkpoint's text codec for a language pair, loaded once."""
        from seq2trt.reference_model.text import load_codec

        key = (src_lang, tgt_lang)
        if key not in self._codecs:
            self._codecs[key] = load_codec(self.folder, self.cfg.eos_id, src_lang, tgt_lang)
        return self._codecs[key]

    def check(self, job: Job) -> None:
        """Raise an InputError naming what is wrong with the job."""
        check_sources([job.ids], self.cfg, *self.src_limit, "the source", numbered=False)
        if job.num_beams is not None and not 1 <= job.num_beams <= self.max_beams:
            raise InputError(f"num_beams must be in [1, {self.max_beams}] (the export's max_batch), got {job.num_beams}")
        decode_settings(self.cfg, job.max_new_tokens, name="max_new_tokens")

    def run(self, jobs: list[Job]) -> list[list[int] | Exception]:
        """Each job's generated ids (without bos/eos) or the error that refused it, in order."""
        results: list[list[int] | Exception | None] = [None] * len(jobs)
        groups: dict[tuple, list[int]] = {}
        for n, job in enumerate(jobs):
            try:
                self.check(job)
            except InputError as exc:
                results[n] = exc
                continue
            groups.setdefault((job.num_beams, job.max_new_tokens, job.forced_bos_id), []).append(n)
        for (beam, max_new_tokens, forced), members in groups.items():
            try:
                beams, decode = choose_search(self.generation, beam, self.alpha)
                # the model's stored generation options, as translate applies them (one deterministic output a job)
                settings = decode_settings(self.cfg, max_new_tokens, forced, generation=self.generation,
                                           options=dict(do_sample=False, num_return_sequences=1))
                rows = batch_rows(len(members), self.max_batch, beams)
                outputs = decode_batches(self.model, [jobs[n].ids for n in members], self.cfg.pad_id, decode,
                                         settings, rows)
                for n, out in zip(members, outputs):
                    results[n] = out
            except Exception as exc:  # a failed group must not take the batch's other groups with it
                logger.exception("decoding %d requests failed", len(members))
                for n in members:
                    if results[n] is None:
                        results[n] = exc
        return results


def scalar(array: np.ndarray | None, name: str) -> int | None:
    """The one integer of an optional [1, 1] INT32 input, or None when absent."""
    if array is None:
        return None
    if array.size != 1:
        raise InputError(f"{name} must hold one value per request, got shape {list(array.shape)}")
    return int(array.reshape(-1)[0])


def source_ids(array: np.ndarray | None) -> tuple[int, ...]:
    """One request's input_ids ([1, L] once batched) as a tuple; one source per request."""
    if array is None:
        raise InputError("input 'input_ids' is missing; give the source's token ids as INT64 [1, L]")
    if array.ndim != 2 or array.shape[0] != 1:
        raise InputError(f"input_ids must hold one source per request (shape [1, L]), got shape {list(array.shape)}")
    return tuple(int(i) for i in array[0])


def text_of(array: np.ndarray | None, name: str, required: bool = True) -> str | None:
    """The one UTF-8 string of a BYTES [1] input."""
    if array is None:
        if required:
            raise InputError(f"input {name!r} is missing")
        return None
    if array.size != 1:
        raise InputError(f"{name} must hold one string per request, got shape {list(array.shape)}")
    value = array.reshape(-1)[0]
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(f"{name} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return str(value)
