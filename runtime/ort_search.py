"""The `ort-generate` backend: the whole search in one ONNX Runtime session run (exporters/ort_search.py's graph).

It is not a `StepModel`: there is no step to drive from Python. `GenerateModel.decode` takes the same
(ids, mask, DecodeSettings) as the loops of `reference_model.decoding` and returns their output form (each
source's tokens without bos/eos, or its n-best Hypothesis list with scores). Its search is Hugging Face's beam
search with early_stopping=True and `length_penalty` as the exponent of the length (exporters/ort_search.py
documents the exact semantics); one beam is greedy search.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import numpy as np

from seq2trt.exporters import ort_session, spec
from seq2trt.exporters.ort_search import FILENAME, generate_dir, verify_generate
from seq2trt.exporters.manifest import Manifest
from seq2trt.reference_model.decoding import DecodeSettings, Hypothesis
from seq2trt.reference_model.decoding.options import backend_name, spelling
from seq2trt.core.errors import InputError

logger = logging.getLogger(__name__)


def optimization(int8: bool) -> str:
    """generate.onnx's optimization level: the step-graph sessions' (ort_session.OPTIMIZATION: basic for the fused fp32
    graphs, extended without SkipLayerNormFusion for the int8 ones), not ONNX Runtime's default level, whose
    SkipLayerNormalization is slower inside the subgraphs at decode sizes (benchmarks/README.md, "ONNX Runtime
    settings")."""
    return "extended" if int8 else "basic"


def session_options(ort, threads: int, int8: bool):
    """(SessionOptions, disabled optimizers) of generate.onnx's session (for scripts that open it themselves)."""
    options, disabled, _ = ort_session.session_options(optimization(int8), threads)
    return options, disabled


class GenerateModel:
    """generate.onnx of an export (checked against generate.json), in one ONNX Runtime session."""

    def __init__(self, out: Path, manifest: Manifest, threads: int = 1, int8: bool = False, device: str = "cpu",
                 device_id: int = 0):
        self.record = verify_generate(out, manifest, int8)
        self.path, self.cfg, self.limits, self.threads = generate_dir(out, int8) / FILENAME, manifest.config, manifest.limits, threads
        self.int8, self.out, self.device, self.device_id = int8, Path(out), device, device_id
        self.session = None
        self.last_inference_time: float | None = None

    def __enter__(self) -> "GenerateModel":
        self.session, _ = ort_session.open_session(self.path, device=self.device, device_id=self.device_id,
                                                   threads=self.threads, optimization=optimization(self.int8))
        return self

    def __exit__(self, *exc) -> None:
        self.session = None

    @property
    def _rebuild(self) -> str:
        return f"seq2trt ort-search {self.out}" + (" --int8" if self.int8 else "")

    def check(self, batch: int, src_len: int, settings: DecodeSettings, num_beams: int,
              flags: dict[str, str] | None = None) -> None:
        """Refuse what the graph cannot do as asked: more rows or positions than the export serves, or decoding
        rules other than the ones built into the graph. `flags`: how the caller spells the options (options.spelling;
        the CLI's flags by default), so the advice names the Python API's keywords to an API caller."""
        flags = flags or spelling("flag")
        beam, backend = flags["beam_size"], backend_name(flags)
        if num_beams < 1:
            raise InputError(f"num_beams must be >= 1, got {num_beams}")
        if batch * num_beams > self.limits.max_batch:
            raise InputError(f"batch {batch} x beam {num_beams} = {batch * num_beams} rows, over the export's max_batch "
                             f"{self.limits.max_batch}: exports for beam need max_batch >= B x K; re-export with "
                             "--max-batch >= batch x beam, or decode smaller batches")
        if settings.max_new_tokens + 1 > self.limits.max_tgt_len:
            raise InputError(f"max_new_tokens {settings.max_new_tokens} + the start token exceed the export's max_tgt_len "
                             f"{self.limits.max_tgt_len}")
        if not 1 <= src_len <= self.limits.max_src_len:
            raise InputError(f"source length {src_len} is outside [1, {self.limits.max_src_len}] (the export's limits)")
        built = self.record["semantics"]
        wanted = {"eos_id": settings.eos_id, "decoder_start_token_id": settings.bos_id,
                  "forced_bos_id": settings.forced_bos_id, "forced_eos": settings.forced_eos,
                  "suppress_ids": list(settings.suppress_ids)}
        differ = {k: (built.get(k), v) for k, v in wanted.items() if built.get(k) != v}
        if settings.repetition_penalty != 1.0 and "repetition_penalty" not in built:
            raise InputError(f"this generate.onnx was built before repetition_penalty was an input; re-run "
                             f"`{self._rebuild} --force` to decode with repetition_penalty "
                             f"{settings.repetition_penalty}")
        if settings.repetition_penalty != 1.0 and num_beams == 1:
            raise InputError(f"repetition_penalty {settings.repetition_penalty} with one beam: ONNX Runtime's greedy "
                             "search in generate.onnx does not penalise as Hugging Face's greedy search (on the raw "
                             f"logits) does; use {beam} >= 2, or {backend}ort for greedy")
        if len(settings.start) != 1 and (settings.min_length or settings.repetition_penalty != 1.0
                                         or settings.no_repeat_ngram_size):
            raise InputError("generate.onnx's sequences begin with the one start token; min_length, "
                             "repetition_penalty and no_repeat_ngram_size with a longer decoder prompt are not applied "
                             f"there: use {backend}ort")
        ngram = built.get("no_repeat_ngram_size", 0)  # graphs built before it was recorded hold 0
        if settings.no_repeat_ngram_size != ngram:
            raise InputError(f"this generate.onnx bans repeated n-grams of size {ngram} (no_repeat_ngram_size, fixed "
                             f"when the graph is built), and this decode asks {settings.no_repeat_ngram_size}; re-run "
                             f"`{self._rebuild} --no-repeat-ngram-size {settings.no_repeat_ngram_size} --force`, "
                             f"or use {backend}ort")
        n_best = settings.num_return_sequences
        if (n_best != 1 or settings.output_scores) and "num_return_sequences" not in built:
            raise InputError("this generate.onnx was built before n-best lists and scores were outputs; re-run "
                             f"`{self._rebuild} --force` to decode with num_return_sequences or scores")
        if n_best > num_beams:
            raise InputError(f"num_return_sequences {n_best} is more than the {num_beams} beams; ask for at most as "
                             "many sequences as beams")
        if settings.output_scores and num_beams == 1:
            raise InputError("scores with one beam: ONNX Runtime's greedy search in generate.onnx scores its sequence "
                             "otherwise than seq2trt's greedy search (the sum of log-probabilities); use "
                             f"{beam} >= 2 (Hugging Face's sequences_scores), or {backend}ort for greedy scores")
        if differ:
            raise InputError(f"generate.onnx applies the decoding rules it was built with; asked for others {differ} "
                             f"(built, asked): use {backend}ort-fused for these")

    def decode(self, input_ids: np.ndarray, attention_mask: np.ndarray, settings: DecodeSettings, num_beams: int = 1,
               length_penalty: float = 1.0, forced_length: bool = False) -> list[list[int]] | list[list[Hypothesis]]:
        """Each source's best hypothesis without bos/eos (num_beams 1: greedy), or, when `settings.plain` is not, its
        num_return_sequences best as Hypothesis (Hugging Face's sequences_scores as the score). `forced_length`: eos
        is masked until max_new_tokens (bench's forced-length runs: every backend does the same work)."""
        import time

        if self.session is None:
            raise RuntimeError("GenerateModel is not open: use it inside `with model:`")
        self.check(*input_ids.shape, settings, num_beams)
        spec.check_feed(self.cfg, spec.GraphKind.ENCODER, "fp32", self.limits,
                        {"input_ids": input_ids.astype(np.int64), "attention_mask": attention_mask.astype(np.int64)})
        min_length = max(settings.min_length, settings.min_new_tokens + 1)  # the start token counts (ORT and HF)
        feed = {"input_ids": input_ids.astype(np.int32), "attention_mask": attention_mask.astype(np.int32),
                "max_length": np.array([settings.max_new_tokens + 1], np.int32),
                "min_length": np.array([settings.max_new_tokens + 1 if forced_length else min_length], np.int32),
                "num_beams": np.array([num_beams], np.int32),
                "length_penalty": np.array([length_penalty], np.float32)}
        built = self.record["semantics"]
        if "repetition_penalty" in built:
            feed["repetition_penalty"] = np.array([settings.repetition_penalty], np.float32)
        if "num_return_sequences" in built:
            feed["num_return_sequences"] = np.array([settings.num_return_sequences], np.int32)
        start = time.perf_counter()
        outputs = self.session.run(None, feed)
        self.last_inference_time = time.perf_counter() - start
        eos = settings.eos_id
        cut = lambda row: row[: row.index(eos)] if eos in row else row
        sequences = outputs[0][:, :, 1:].tolist()  # (B, N, max_length - 1): the start token dropped
        if settings.plain:
            return [cut(rows[0]) for rows in sequences]
        # A hypothesis the length limit closed (no eos) is scored by ORT over its length with the start token,
        # Hugging Face's over the generated tokens: sum / (L + 1) ** lp against sum / L ** lp. Rescaled to the latter.
        limit = lambda row: 1.0 if eos in row else ((len(row) + 1) / len(row)) ** length_penalty
        return [[Hypothesis(cut(row), float(score) * limit(row)) for row, score in zip(rows, row_scores)]
                for rows, row_scores in zip(sequences, outputs[1].tolist())]


def generate_search(generation: dict | None, num_beams: int, alpha: float
                    ) -> Callable[[GenerateModel, np.ndarray, np.ndarray, DecodeSettings], list[list[int]]]:
    """decode(model, ids, mask, settings) for translate: an imported model's own length_penalty (its early_stopping
    must be True: the graph's), else `alpha` as Hugging Face's length_penalty."""
    length_penalty = alpha
    if generation is not None and num_beams > 1:
        if generation.get("early_stopping") is not True:
            raise InputError(f"this model's generation config asks early_stopping={generation.get('early_stopping')!r}; "
                             "ort-generate runs early_stopping=True only (ONNX Runtime's other heuristic is not Hugging "
                             "Face's): use --backend ort-fused")
        length_penalty = generation["length_penalty"]
    return lambda model, ids, mask, settings: model.decode(ids, mask, settings, num_beams, length_penalty)


