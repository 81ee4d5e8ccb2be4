"""Decoding a list of sources through a backend, the one way `seq2trt translate` and `seq2trt serve` share: open the
step model of a checkpoint or an export, check the sources against its limits, pick the search (greedy, GNMT beam for
models trained here, Hugging Face's beam for imported ones), and decode in padded batches of at most `rows` sources.
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
import os
from pathlib import Path
from typing import Callable, Iterator, Sequence

from seq2trt.exporters.manifest import checkpoint_folder
from seq2trt.core import layout
from seq2trt.reference_model.checkpoint import generation_config
from seq2trt.reference_model.decoding import (DecodeSettings, beam_search, greedy_decode, hf_beam_search,
                                              length_penalty_problem, option_problem)
from seq2trt.reference_model.decoding.options import (DECODE_OPTIONS, GRAPH_REFUSED_GENERATION, SAMPLING_ONLY,
                                                      backend_name, spelling)
from seq2trt.reference_model.config import beam_bytes, physical_memory
from seq2trt.core.errors import InputError
from seq2trt.reference_model.vocab import pad_batch

from seq2trt.runtime.runners import torch_threads

Decode = Callable  # (step_model, ids, mask, settings) -> list of token lists

# Far more threads than cores only slows intra-op work down, and tens of thousands crash libgomp's thread creation
# (a segmentation fault); four per core leaves room to oversubscribe on purpose.
MAX_THREADS = 4 * (os.cpu_count() or 1)


def check_threads(threads: int, flag: str = "--threads") -> None:
    """Refuse a thread count outside [1, MAX_THREADS], naming `flag`, the value and the limit."""
    if isinstance(threads, bool) or not isinstance(threads, int):
        raise InputError(f"{flag} must be an integer, got {threads!r}")
    if not 1 <= threads <= MAX_THREADS:
        raise InputError(f"{flag} must be in [1, {MAX_THREADS}], got {threads} (the limit is 4 per CPU core, "
                         f"{os.cpu_count() or 1} here); give a count in that range")


# How messages name the options by default: the CLI's flags (the options table's, and the batch size).
FLAGS = {**spelling("flag"), "batch_size": "--batch-size"}


def check_decode_options(alpha: float, batch_size: int, names: dict[str, str] = FLAGS) -> None:
    """Refuse a length penalty that is not a number and a batch size under 1, before anything is opened; `names`:
    how messages name them (the CLI's flags, or the API's keywords, `seq2trt.translator.KEYWORDS`)."""
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not alpha == alpha:
        raise InputError(f"{names['alpha']} must be a number, got {alpha!r}; give a length penalty such as 0.6")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int):
        raise InputError(f"{names['batch_size']} must be an integer, got {batch_size!r}")
    if batch_size < 1:
        raise InputError(f"{names['batch_size']} must be >= 1, got {batch_size}")


def has_tokenizer(folder: Path) -> bool:
    """Whether the checkpoint can turn text into ids (its vocab.json, or an imported Hugging Face tokenizer)."""
    return (folder / layout.VOCAB).exists() or (folder / layout.TOKENIZER_DIR).is_dir()


@dataclasses.dataclass(frozen=True)
class OpenedDecoder:
    """A checkpoint or an export opened for decoding."""

    model: object  # a StepModel, or the ORT whole-search model (runtime/ort_search.py)
    config: object  # the model's Seq2SeqConfig
    folder: Path  # the checkpoint folder: tokenizer and generation settings
    src_limit: tuple[int, str]  # (max_src_len, the name of that limit in messages)
    max_batch: int | None  # the export's max_batch; None for a checkpoint


@contextlib.contextmanager
def open_decoder(source: Path, backend: str, checkpoint: Path | None, threads: int) -> Iterator[OpenedDecoder]:
    """A checkpoint or an export opened with `backend`, with torch held to `threads` (checked against
    MAX_THREADS) while it is open."""
    check_threads(threads)
    with torch_threads(threads):
        yield from _open_decoder(source, backend, checkpoint, threads)


def _open_decoder(source: Path, backend: str, checkpoint: Path | None, threads: int):
    if (source / layout.MANIFEST).exists():
        from seq2trt.runtime.registry import open_step_model

        if backend.startswith("ort-generate"):
            _refuse_generate_dtype(source, backend)

        with open_step_model(source, backend, checkpoint, threads) as (model, manifest):
            yield OpenedDecoder(model, manifest.config, checkpoint_folder(source, manifest, checkpoint),
                                (manifest.limits.max_src_len, "the export's max_src_len"), manifest.limits.max_batch)
        return
    if backend != "eager" and not source.exists():
        raise InputError(f"{source} not found; give an export directory (or a checkpoint with --backend eager)")
    if backend != "eager":
        raise InputError(f"--backend {backend} runs exported graphs: {source} is a checkpoint, not an export "
                         f"directory; export it first (`seq2trt export {source} -o OUT`) and translate OUT")
    from seq2trt.reference_model.checkpoint import load_checkpoint
    from seq2trt.reference_model.eager import EagerStepModel

    model, _ = load_checkpoint(source)
    yield OpenedDecoder(EagerStepModel(model), model.cfg, source, (model.cfg.max_src_len, "the model's max_src_len"),
                        None)


def _refuse_generate_dtype(out: Path, backend: str) -> None:
    """An fp16/bf16 export has no generate.onnx to make (`seq2trt ort-search` and `quantize` take float32 graphs):
    say which backends do run it, rather than 'run `seq2trt ort-search` first'."""
    from seq2trt.exporters.manifest import read_manifest

    dtype = read_manifest(out).dtype
    if dtype != "fp32":
        raise InputError(f"--backend {backend} runs ONNX Runtime's BeamSearch, which takes float32 graphs, and the "
                         f"graphs of {out} are {dtype} (`seq2trt ort-search` refuses them too); translate it with "
                         f"--backend ort, ort-fused (after `seq2trt fuse {out} --target ort`), tensorrt, tensorrt-rtx "
                         f"or eager, or export with --dtype fp32 into another folder for {backend}")


def check_sources(sources: Sequence[Sequence[int]], cfg, max_src_len: int, limit_name: str, origin: str,
                  numbered: bool = True) -> None:
    """The model's source kind refuses an empty source, one over the length limit, or ids outside its vocabulary."""
    from seq2trt.reference_model.sources import source_kind

    source_kind(cfg).check(sources, max_src_len, limit_name, origin, numbered)


def choose_search(generation: dict | None, beam: int | None, alpha: float,
                  settings: DecodeSettings | None = None, flags: dict | None = None) -> tuple[int, Decode]:
    """(beams, decode(step_model, ids, mask, settings)): Hugging Face's beam search with its generation settings for
    an imported model, GNMT's length penalty (`alpha`) otherwise; greedy at one beam, or sampling when `settings`
    ask it (one beam; one random stream over every batch). `beam` None: the model's num_beams, else 1. Messages name
    the options by `flags` (options.spelling: the CLI's flags by default, the API's keywords, the request inputs)."""
    flags = {**FLAGS, **(flags or {})}
    sampling = settings is not None and settings.do_sample
    if sampling and beam is not None and beam != 1:
        raise InputError(f"{flags['beam_size']} {beam} with sampling: seq2trt samples with one beam (beam sampling is "
                         f"not reproduced); drop {flags['beam_size']}, or drop {flags['do_sample']}")
    beams = beam if beam is not None else 1 if sampling else (generation or {}).get("num_beams", 1)
    if not isinstance(beams, int) or isinstance(beams, bool) or beams < 1:
        where = flags["beam_size"] if beam is not None else "the checkpoint's generation settings: num_beams"
        raise InputError(f"{where} must be an integer >= 1, got {beams!r}"
                         + ("" if beam is not None else f"; re-import the model or pass {flags['beam_size']}"))
    n_best = settings.num_return_sequences if settings is not None else 1
    if not sampling and n_best > beams:
        n_flag = flags["num_return_sequences"]
        raise InputError(f"{n_flag} {n_best} is more than the {beams} beam{'s' * (beams > 1)} searched: a beam search "
                         f"returns at most its beams; pass {flags['beam_size']} {n_best} or more, "
                         f"{flags['do_sample']}, or a smaller {n_flag}")
    if beams == 1:
        if sampling:
            generator = settings.generator()
            return 1, lambda m, ids, mask, s: greedy_decode(m, ids, mask, s, generator=generator)
        return 1, greedy_decode
    if generation is not None:
        return beams, lambda m, ids, mask, s: hf_beam_search(m, ids, mask, s, beams, generation["length_penalty"],
                                                             generation["early_stopping"])
    return beams, lambda m, ids, mask, s: beam_search(m, ids, mask, s, beam_size=beams, alpha=alpha)


def decode_settings(cfg, max_new_tokens: int | None, forced_bos_id: int | None = None,
                    name: str = "--max-new-tokens", generation: dict | None = None,
                    options: dict | None = None, flags: dict | None = None) -> DecodeSettings:
    """The model's settings; `max_new_tokens` checked against its decoder length; a language's forced first token;
    an imported model's stored generation options (`generation`: generation.json), overridden by `options`
    (options.SETTING_FIELDS; None values keep the model's), each checked by DecodeSettings and named by its flag
    (`flags` renames them: options.spelling of the API or of served requests)."""
    flags = {**spelling("flag"), **(flags or {})}
    limit = cfg.max_tgt_len - 1
    if max_new_tokens is not None and (option_problem("max_new_tokens", max_new_tokens) is not None
                                       or not 1 <= max_new_tokens <= limit):
        raise InputError(f"{name} must be an integer in [1, {limit}], got {max_new_tokens!r}")
    settings = DecodeSettings.for_model(cfg, max_new_tokens, generation)
    if forced_bos_id is not None:
        settings = dataclasses.replace(settings, forced_bos_id=forced_bos_id)
    given = {k: v for k, v in (options or {}).items() if v is not None}
    settings = settings.with_options(given, flags)  # DecodeSettings' rules, named by the flag that set the value
    _check_length_floors(settings, given, flags, name, max_new_tokens)
    if not settings.do_sample:
        stray = [flags[k] for k in SAMPLING_ONLY if k in given]
        if stray:
            raise InputError(f"{', '.join(stray)} set{'s' * (len(stray) == 1)} how sampling draws, and this decode "
                             f"does not sample; add {flags['do_sample']}, or drop " + ", ".join(stray))
    return settings


def _check_length_floors(settings: DecodeSettings, given: dict, flags: dict, name: str,
                         max_new_tokens: int | None) -> None:
    """A length floor given above what the decode may generate would never hold (transformers only warns, and
    stops at the limit): refused, naming both."""
    limit = f"{name} {max_new_tokens}" if max_new_tokens is not None else "the model's own limit"
    room = {"min_new_tokens": settings.max_new_tokens, "min_length": settings.max_new_tokens + len(settings.start)}
    for key, most in room.items():
        if key in given and given[key] > most:
            counted = "" if key == "min_new_tokens" else f", {most} with the start token, which it counts"
            raise InputError(f"{flags[key]} {given[key]} is more than the decode may generate ({limit}: "
                             f"{settings.max_new_tokens} tokens{counted}); give a smaller {flags[key]} or a larger "
                             f"{name}")


def check_beam_memory(cfg, beams: int, flag: str = "--beam-size") -> None:
    """Refuse a beam count whose logits and K/V for one source would take over half the machine's memory (the
    import's estimate for num_beams: config.beam_bytes), before anything is allocated."""
    need, total = beams * beam_bytes(cfg), physical_memory()
    if need > total // 2:
        raise InputError(f"{flag} {beams} needs about {need / 2**30:,.0f} GiB for one source's beams, over half this "
                         f"machine's {total / 2**30:,.0f} GiB of memory; give a smaller {flag}")


def unsupported_in_graph(settings: DecodeSettings) -> list[str]:
    """The options of `settings` that a search inside an exported graph (ONNX Runtime's BeamSearch: the model's
    forced and suppressed ids, beams, length penalty, min_length / min_new_tokens, repetition_penalty,
    no_repeat_ngram_size, n-best lists and their scores: options.DECODE_OPTIONS' `in_graph`) would not apply, as
    NAME=VALUE. The graph checks the values it applies (runtime.ort_search.GenerateModel.check: no_repeat_ngram_size
    is fixed when it is built)."""
    neutral = DecodeSettings(settings.bos_id, settings.eos_id, settings.pad_id, settings.max_new_tokens)
    keys = [o.field for o in DECODE_OPTIONS if not o.in_graph] + list(GRAPH_REFUSED_GENERATION)
    return [f"{k}={getattr(settings, k)!r}" for k in keys if getattr(settings, k) != getattr(neutral, k)]


def batch_rows(batch_size: int, max_batch: int | None, beams: int, flag: str = "--beam-size") -> int:
    """Sources per decoder batch: `batch_size`, fewer when beams (or samples: `flag` --n-best) x sources would pass
    the export's max_batch; `flag` as the caller spells the option (a flag, a keyword, a request input)."""
    rows = batch_size if max_batch is None else min(batch_size, max_batch // beams)
    if rows < 1:
        raise InputError(f"{flag} {beams} needs batches of {beams} rows, over the export's max_batch {max_batch}; "
                         f"re-export with --max-batch >= batch x {flag.lstrip('-')}, or use a smaller {flag}")
    return rows


SORT_WINDOW = 16  # batches sorted by source length together (CTranslate2's translate_iterable reads 16 batches)


def decode_batches(step_model, sources: Sequence[Sequence[int]], pad_id: int, decode: Decode,
                   settings: DecodeSettings, rows: int) -> Iterator[list]:
    """Each source's generated ids (without bos/eos), or its Hypothesis list when `settings.plain` is not, in input
    order, decoded in padded batches of `rows` sources.

    When the sources fill more than one batch they are batched by length, longest first, within windows of
    SORT_WINDOW batches (as CTranslate2's translate_iterable does): a batch pads to its longest source and runs
    until its longest output, and similar lengths waste less of both. Outputs still come in input order, a window
    at a time, so a long input streams and at most one window's outputs are held. A sampling search keeps the
    input order: its random stream follows the batch's rows, as transformers' does, so the same seed gives the same
    samples as `generate` on the same batch."""
    if len(sources) <= rows or settings.do_sample:
        for start in range(0, len(sources), rows):
            ids, mask = pad_batch([list(s) for s in sources[start: start + rows]], pad_id)
            yield from decode(step_model, ids, mask, settings)
        return
    window = rows * SORT_WINDOW
    for first in range(0, len(sources), window):
        part = range(first, min(first + window, len(sources)))
        order = sorted(part, key=lambda i: -len(sources[i]))  # stable: equal lengths keep input order
        done: dict[int, list] = {}
        for start in range(0, len(order), rows):
            chunk = order[start: start + rows]
            ids, mask = pad_batch([list(sources[i]) for i in chunk], pad_id)
            done.update(zip(chunk, decode(step_model, ids, mask, settings)))
        yield from (done[i] for i in part)


def decode_job(opened: OpenedDecoder, backend: str, sources: Sequence[Sequence[int]], origin: str,
               beam_size: int | None,
               alpha: float, max_new_tokens: int | None, batch_size: int, forced_bos_id: int | None = None,
               options: dict | None = None, flags: dict | None = None) -> tuple[DecodeSettings, Iterator[list]]:
    """(settings, each source's output as `decode_batches` yields it) for `opened` (what `open_decoder` yields),
    everything checked before the first decode: the sources (errors name `origin` and the number), the search
    options (an imported model's generation settings, overridden by `options`: options.SETTING_FIELDS), the search,
    the length limit and penalty, the memory the beams take, the batch. ONNX Runtime's BeamSearch graph refuses the
    options it would not apply. `flags` renames the options in messages (options.spelling: the CLI's flags by
    default, the Python API's keywords)."""
    step_model, cfg, folder, src_limit, max_batch = (opened.model, opened.config, opened.folder, opened.src_limit,
                                                     opened.max_batch)
    flags = {**FLAGS, **(flags or {})}
    check_sources(sources, cfg, *src_limit, origin)
    generation = generation_config(folder)
    settings = decode_settings(cfg, max_new_tokens, forced_bos_id, flags["max_new_tokens"], generation, options,
                               flags)
    beams, decode = choose_search(generation, beam_size, alpha, settings, flags)
    if beams > 1 and (problem := length_penalty_problem(alpha, settings.max_new_tokens)) is not None:
        raise InputError(f"{flags['alpha']} must be {problem}, got {alpha!r}")
    check_beam_memory(cfg, beams, flags["beam_size"])
    if backend.startswith("ort-generate"):  # the search runs inside the graph (Hugging Face's; alpha: length_penalty)
        from seq2trt.runtime.ort_search import generate_search

        missing = unsupported_in_graph(settings)
        if missing:
            given = backend_name(flags)
            raise InputError(f"{given}{backend} runs ONNX Runtime's BeamSearch graph, which does not apply "
                             f"{', '.join(missing)} (from the options or the model's generation settings); use "
                             f"{given}ort (the same graphs through seq2trt's search), or leave those options at their "
                             "defaults")
        decode = generate_search(generation_config(folder), beams, alpha)
        step_model.check(1, 1, settings, beams, flags)  # the rules built into the graph, before the first batch
    samples = settings.num_return_sequences if settings.do_sample else 0  # a sampled source takes that many rows
    rows = batch_rows(batch_size, max_batch, *((samples, flags["num_return_sequences"]) if samples > beams else
                                               (beams, flags["beam_size"])))
    return settings, decode_batches(step_model, sources, cfg.pad_id, decode, settings, rows)
