"""What a served request gets: the decoding behind `seq2trt serve`'s models `generate` (ids in, ids out) and
`translate` (text in, text out), without Triton in it so that it can be tested alone.

A batch of requests, as Triton's dynamic batcher hands it over, is checked request by request (a bad one gets its own
error, the others go on), then grouped by what changes the search — beams, max_new_tokens, the forced target
language, the search options — and each group is decoded by `decode_jobs.decode_batches`, the same function
`seq2trt translate` runs, in padded batches the export's max_batch allows. So every request gets what
`translate --ids-file` gives for its ids.

A request's search options (REQUEST_OPTIONS: optional scalar inputs, each the `translate` flag of the same meaning,
made from the one options table, reference_model/decoding/options.py) are checked by `decode_jobs.decode_settings` /
`choose_search`, their errors naming the request parameter:

  sample BOOL                sample (one beam) instead of searching            translate --sample
  temperature, top_p FP32    sampling's temperature, nucleus mass              --temperature, --top-p
  top_k INT32, seed INT64    sampling's top-k (0: all), its seed               --top-k, --seed
  min_new_tokens INT32       no eos before this many tokens                    --min-new-tokens
  no_repeat_ngram_size INT32, repetition_penalty FP32                          --no-repeat-ngram-size, ...
  n_best INT32, output_scores BOOL  hypotheses a source, their scores      --n-best, --scores
  token_logprobs BOOL        each hypothesis's per-token log-probabilities     --token-logprobs
  fast_sampling BOOL         sample by the inverse CDF (not transformers' stream)  --fast-sampling

`do_sample` and `output_token_logprobs` are the deprecated spellings of `sample` and `token_logprobs` (as `num_beams`
is of `beam_size`): still read, logged, and named as sent in the request's errors (`served_input`).

Without them a request gets the model's stored settings, searched (one deterministic output), as before. A seeded
sampling request is decoded alone, so that its output is `translate --sample --seed S` on its ids alone whatever
else the batch holds. FP32 values are read as the shortest decimal that rounds to them (0.7, not 0.699999988), the
value the same flag gives translate.
"""

from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from seq2trt.reference_model.decoding import GNMT_ALPHA, DecodeSettings, Hypothesis
from seq2trt.reference_model.decoding.options import DECODE_OPTIONS, OPTIONS, SETTING_FIELDS, spelling
from seq2trt.core.errors import InputError

from seq2trt.runtime.decode_jobs import (batch_rows, check_sources, choose_search, decode_batches, decode_settings,
                                         generation_config, has_tokenizer, open_decoder, OpenedDecoder)
from seq2trt.runtime.transcription import refuse_speech_model

logger = logging.getLogger(__name__)

# Each request input of a search option: (the DecodeSettings field it sets, its Triton data type); a view of the
# options table.
REQUEST_OPTIONS = {o.served: (o.field, o.triton_type) for o in DECODE_OPTIONS
                   if o.served is not None and o.field in SETTING_FIELDS}
# What decode_jobs' messages call each option in a request.
PARAMETER_NAMES = spelling("served")
# The flags of translate and transcribe that library messages name, and the request inputs of the same meaning: a
# served request's error names what the request holds (`request_message`), never a flag it cannot pass.
FLAG_INPUTS = {**{flag: o.served for o in DECODE_OPTIONS if o.served for flag in (o.flag, *o.old_flags)},
               "--src-lang": "src_lang", "--tgt-lang": "tgt_lang", "--ids-file": "the generate model's input_ids",
               "--language": "language", "--task": "task", "--timestamps": "timestamps",
               "--condition-on-prev-tokens": "condition_on_prev_tokens",
               "--compression-ratio-threshold": "compression_ratio_threshold",
               "--logprob-threshold": "logprob_threshold"}
_FLAG = re.compile(r"--[a-z][a-z-]*")


def served_input(get, field: str, read=None) -> tuple[object, str]:
    """A request's value of the option `field` (None: not sent) and the input that gave it: its served name, or a
    deprecated spelling (`old_served`, accepted with a warning in the server's log naming the new one); both at once
    is refused. `read` turns the input's array into the value (default `option_value`)."""
    row, read = OPTIONS[field], read or option_value
    given = {name: read(get(name), name) for name in (row.served, *row.old_served)}
    given = {name: value for name, value in given.items() if value is not None}
    if len(given) > 1:
        raise InputError(f"{' and '.join(given)} are one option; send {row.served} alone")
    for name in set(given) - {row.served}:
        logger.warning("request input %s is deprecated; send %s", name, row.served)
    name, value = next(iter(given.items()), (row.served, None))
    return value, name


def beam_size_input(get) -> tuple[int | None, str]:
    """A request's beam size and the input that gave it: `beam_size`, or its deprecated spelling `num_beams`."""
    return served_input(get, "beam_size", scalar)


def request_options(get) -> tuple[dict[str, object], dict[str, str]]:
    """(a request's search options {DecodeSettings field: value}, {field: the deprecated input that gave it}) from
    `get(input name)` (its array, or None when absent)."""
    options, spelled = {}, {}
    for served, (field, _) in REQUEST_OPTIONS.items():
        value, name = served_input(get, field)
        if value is not None:
            options[field] = value
        if name != served:
            spelled[field] = name
    return options, spelled


def request_message(message: str) -> str:
    """A library message with the CLI's flags named as the request inputs of the same meaning."""
    return _FLAG.sub(lambda m: FLAG_INPUTS.get(m.group(0), m.group(0)), message)


@dataclass(frozen=True)
class Job:
    """One request: source ids, and the request's own search settings (None: the model's defaults)."""
    ids: tuple[int, ...]
    max_new_tokens: int | None = None
    beam_size: int | None = None
    forced_bos_id: int | None = None
    # The request's search options as sorted (DecodeSettings field, value) pairs; a dict given is sorted.
    options: tuple[tuple[str, object], ...] = ()
    beam_input: str = "beam_size"  # the input that gave the beam size (num_beams: its deprecated spelling)
    # The options the request sent by a deprecated input, as sorted (field, that input) pairs: its errors name them so.
    spelled: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        for name in ("options", "spelled"):
            if isinstance(getattr(self, name), dict):
                object.__setattr__(self, name, tuple(sorted(getattr(self, name).items())))


class DecodeService:
    """The export's step model opened once; `run(jobs)` decodes a batch of jobs, one result or error per job."""

    def __init__(self, out: Path, backend: str, checkpoint: Path | None = None, threads: int = 1, alpha: float = GNMT_ALPHA,
                 opened: OpenedDecoder | None = None):
        """Opens `backend` on the export `out`, or takes `opened` (as `decode_jobs.open_decoder` yields it)."""
        self._stack = contextlib.ExitStack()
        if opened is None:
            opened = self._stack.enter_context(open_decoder(Path(out), backend, checkpoint, threads))
        self.model, self.cfg, self.folder = opened.model, opened.config, opened.folder
        if getattr(self.cfg, "audio", False):  # a speech model is served as transcribe
            self._stack.close()
            refuse_speech_model(self.cfg, "the generate and translate models")
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
        from seq2trt.hf_import.text import load_codec

        key = (src_lang, tgt_lang)
        if key not in self._codecs:
            self._codecs[key] = load_codec(self.folder, self.cfg.eos_id, src_lang, tgt_lang)
        return self._codecs[key]

    def check(self, job: Job) -> DecodeSettings:
        """The job's decode settings; raise an InputError naming what is wrong with the job."""
        check_sources([job.ids], self.cfg, *self.src_limit, "the source", numbered=False)
        if job.beam_size is not None and not 1 <= job.beam_size <= self.max_beams:
            raise InputError(f"{job.beam_input} must be in [1, {self.max_beams}] (the export's max_batch), got "
                             f"{job.beam_size}")
        names = {**PARAMETER_NAMES, **dict(job.spelled), "beam_size": job.beam_input}  # as the request spelled them
        # the model's stored generation options, as translate applies them; searched, one output, unless asked
        options = {"do_sample": False, "num_return_sequences": 1, **dict(job.options)}
        settings = decode_settings(self.cfg, job.max_new_tokens, job.forced_bos_id, name="max_new_tokens",
                                   generation=self.generation, options=options, flags=names)
        beams, _ = choose_search(self.generation, job.beam_size, self.alpha, settings, flags=names)
        samples = settings.num_return_sequences if settings.do_sample else 1  # a sampled source takes n rows
        if samples > self.max_beams:
            raise InputError(f"{names['num_return_sequences']} with {names['do_sample']} must be in "
                             f"[1, {self.max_beams}] (the export's max_batch: one row a sample), got {samples}")
        return settings

    def run(self, jobs: list[Job]) -> list[list[int] | list[Hypothesis] | Exception]:
        """Each job's generated ids (without bos/eos), its Hypothesis list when it asked n_best > 1 or scores, or
        the error that refused it, in order."""
        results: list[list | Exception | None] = [None] * len(jobs)
        groups: dict[tuple, list[int]] = {}
        plans: dict[tuple, DecodeSettings] = {}
        for n, job in enumerate(jobs):
            try:
                settings = self.check(job)
            except InputError as exc:
                results[n] = exc
                continue
            key = (job.beam_size, job.max_new_tokens, job.forced_bos_id, job.options)
            if settings.do_sample and settings.seed is not None:
                # The sampler draws noise for every row of the batch each step, so a row's draws depend on the
                # batch it is in: a seeded request is decoded alone, as translate decodes one source.
                key += (n,)
            groups.setdefault(key, []).append(n)
            plans[key] = settings
        for key, members in groups.items():
            try:
                settings = plans[key]
                beams, decode = choose_search(self.generation, key[0], self.alpha, settings)
                samples = settings.num_return_sequences if settings.do_sample else 0
                rows = batch_rows(len(members), self.max_batch, max(beams, samples))
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


def option_value(array: np.ndarray | None, name: str) -> bool | int | float | None:
    """The one value of an optional search-option input ([1, 1] once batched), or None when absent: a bool, an
    integer, or a float (an FP32 one as the shortest decimal that rounds to it)."""
    if array is None:
        return None
    if array.size != 1:
        raise InputError(f"{name} must hold one value per request, got shape {list(array.shape)}")
    value = array.reshape(-1)[0]
    if array.dtype.kind == "b":
        return bool(value)
    if array.dtype.kind == "f":
        return float(str(value)) if array.dtype == np.float32 else float(value)
    return int(value)


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
