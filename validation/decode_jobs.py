"""Decoding a list of sources through a backend, the one way `seq2trt translate` and `seq2trt serve` share: open the
step model of a checkpoint or an export, check the sources against its limits, pick the search (greedy, GNMT beam for
models trained here, Hugging Face's beam for imported ones), and decode in padded batches of at most `rows` sources.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from pathlib import Path
from typing import Callable, Iterator, Sequence

from seq2trt.reference_model.decoding import DecodeSettings, beam_search, greedy_decode, hf_beam_search
from seq2trt.reference_model.errors import InputError
from seq2trt.reference_model.vocab import pad_batch

from .runners import torch_threads

Decode = Callable  # (step_model, ids, mask, settings) -> list of token lists

# Far more threads than cores only slows intra-op work down, and tens of thousands crash libgomp's thread creation
# (a segmentation fault); four per core leaves room to oversubscribe on purpose.
MAX_THREADS = 4 * (os.cpu_count() or 1)


def check_threads(threads: int, flag: str = "--threads") -> None:
    """Refuse a thread count outside [1, MAX_THREADS], naming `flag`, the value and the limit."""
    if not 1 <= threads <= MAX_THREADS:
        raise InputError(f"{flag} must be in [1, {MAX_THREADS}], got {threads} (the limit is 4 per CPU core, "
                         f"{os.cpu_count() or 1} here); give a count in that range")


def checkpoint_folder(out: Path, manifest, checkpoint: Path | None = None) -> Path:
    """The folder holding an export's tokenizer and generation settings: the one given, else the one it was exported
    from."""
    recorded = (manifest.data.get("source") or {}).get("checkpoint")
    return Path(checkpoint or recorded or out)


def has_tokenizer(folder: Path) -> bool:
    """Whether the checkpoint can turn text into ids (its vocab.json, or an imported Hugging Face tokenizer)."""
    return (folder / "vocab.json").exists() or (folder / "tokenizer").is_dir()


@contextlib.contextmanager
def open_decoder(source: Path, backend: str, checkpoint: Path | None, threads: int):
    """(StepModel, config, checkpoint folder, (max_src_len, its name), max_batch or None) for a checkpoint or an
    export, with torch held to `threads` (checked against MAX_THREADS) while it is open."""
    check_threads(threads)
    with torch_threads(threads):
        yield from _open_decoder(source, backend, checkpoint, threads)


def _open_decoder(source: Path, backend: str, checkpoint: Path | None, threads: int):
    if (source / "manifest.json").exists():
        from .backends import open_step_model

        if backend.startswith("ort-generate"):
            _refuse_generate_dtype(source, backend)

        with open_step_model(source, backend, checkpoint, threads) as (model, manifest):
            yield (model, manifest.config, checkpoint_folder(source, manifest, checkpoint), (manifest.limits.max_src_len, "the export's max_src_len"),
                   manifest.limits.max_batch)
        return
    if backend != "eager":
        raise InputError(f"--backend {backend} runs exported graphs: {source} is a checkpoint, not an export "
                         f"directory; export it first (`seq2trt export {source} -o OUT`) and translate OUT")
    from seq2trt.reference_model.checkpoint import load_checkpoint
    from seq2trt.reference_model.eager import EagerStepModel

    model, _ = load_checkpoint(source)
    yield EagerStepModel(model), model.cfg, source, (model.cfg.max_src_len, "the model's max_src_len"), None


def _refuse_generate_dtype(out: Path, backend: str) -> None:
    """An fp16/bf16 export has no generate.onnx to make (`seq2trt generate` and `quantize` take float32 graphs):
    say which backends do run it, rather than 'run `seq2trt generate` first'."""
    from seq2trt.exporters.manifest import read_manifest

    dtype = read_manifest(out).dtype
    if dtype != "fp32":
        raise InputError(f"--backend {backend} runs ONNX Runtime's BeamSearch, which takes float32 graphs, and the graphs "
                         f"of {out} are {dtype} (`seq2trt generate` refuses them too); translate it with --backend ort, "
                         f"ort-fused (after `seq2trt fuse {out} --target ort`), tensorrt, tensorrt-rtx or eager, or "
                         f"export with --dtype fp32 into another folder for {backend}")


def check_sources(sources: Sequence[Sequence[int]], cfg, max_src_len: int, limit_name: str, origin: str,
                  numbered: bool = True) -> None:
    """Refuse an empty source, one over the length limit, or ids outside the source vocabulary, naming which
    (`origin` and its number, or `origin` alone)."""
    for n, ids in enumerate(sources, 1):
        where = f"{origin} {n}" if numbered else origin
        if not len(ids):
            raise InputError(f"{where} is empty; give at least one token")
        if len(ids) > max_src_len:
            raise InputError(f"{where} is {len(ids)} tokens, over {limit_name} {max_src_len}; shorten it")
        bad = [i for i in ids if not 0 <= i < cfg.src_vocab_size]
        if bad:
            raise InputError(f"{where} holds ids outside the source vocabulary [0, {cfg.src_vocab_size}): "
                             f"{bad[:5]}")


def generation_config(folder: Path) -> dict | None:
    """An imported model's generation settings (num_beams, length_penalty, early_stopping), or None."""
    from seq2trt.reference_model.hf_import import GENERATION

    return json.loads((folder / GENERATION).read_text()) if (folder / GENERATION).exists() else None


def choose_search(generation: dict | None, beam: int | None, alpha: float) -> tuple[int, Decode]:
    """(beams, decode(step_model, ids, mask, settings)): Hugging Face's beam search with its generation settings for
    an imported model, GNMT's length penalty (`alpha`) otherwise; greedy at one beam. `beam` None: the model's
    num_beams, else 1."""
    beams = beam if beam is not None else (generation or {}).get("num_beams", 1)
    if not isinstance(beams, int) or isinstance(beams, bool) or beams < 1:
        where = "--beam" if beam is not None else "the checkpoint's generation settings: num_beams"
        raise InputError(f"{where} must be an integer >= 1, got {beams!r}"
                         + ("" if beam is not None else "; re-import the model or pass --beam"))
    if beams == 1:
        return 1, greedy_decode
    if generation is not None:
        return beams, lambda m, ids, mask, s: hf_beam_search(m, ids, mask, s, beams, generation["length_penalty"],
                                                             generation["early_stopping"])
    return beams, lambda m, ids, mask, s: beam_search(m, ids, mask, s, beam_size=beams, alpha=alpha)


def decode_settings(cfg, max_new_tokens: int | None, forced_bos_id: int | None = None,
                    name: str = "--max-new-tokens") -> DecodeSettings:
    """The model's settings; `max_new_tokens` checked against its decoder length; a language's forced first token."""
    limit = cfg.max_tgt_len - 1
    if max_new_tokens is not None and not 1 <= max_new_tokens <= limit:
        raise InputError(f"{name} must be in [1, {limit}], got {max_new_tokens}")
    settings = DecodeSettings.for_model(cfg, max_new_tokens)
    if forced_bos_id is not None:
        settings = dataclasses.replace(settings, forced_bos_id=forced_bos_id)
    return settings


def batch_rows(batch_size: int, max_batch: int | None, beams: int) -> int:
    """Sources per decoder batch: `batch_size`, fewer when beams x sources would pass the export's max_batch."""
    rows = batch_size if max_batch is None else min(batch_size, max_batch // beams)
    if rows < 1:
        raise InputError(f"--beam {beams} needs batches of {beams} rows, over the export's max_batch {max_batch}; "
                         "re-export with --max-batch >= batch x beam, or use a smaller --beam")
    return rows


def decode_batches(step_model, sources: Sequence[Sequence[int]], pad_id: int, decode: Decode,
                   settings: DecodeSettings, rows: int) -> Iterator[list[int]]:
    """Each source's generated ids (without bos/eos), in order, decoded in padded batches of `rows` sources."""
    for start in range(0, len(sources), rows):
        ids, mask = pad_batch([list(s) for s in sources[start: start + rows]], pad_id)
        yield from decode(step_model, ids, mask, settings)
