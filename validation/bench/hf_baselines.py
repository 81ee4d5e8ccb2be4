"""The bench's references on the Hugging Face directory an imported checkpoint came from: what users of
these models run today, timed on the same work as our backends.

- `hf`: transformers' own model loaded from the source directory, eager PyTorch `generate` with the KV cache.
- `optimum`: Optimum's ONNX Runtime export of the same directory (`optimum.exporters.onnx.main_export`, task
  text2text-generation-with-past, cached under OUT/optimum/), run by `ORTModelForSeq2SeqLM.generate` on ONNX
  Runtime's CPU provider with the same intra-op threading as our ORT sessions (`ort_session.configure_threads`) and
  ONNX Runtime's default graph optimizations, as a user of Optimum gets them. optimum-onnx pins transformers<4.58:
  it is the `optimum` extra, installed where transformers 4.57 is; elsewhere `bench` leaves it out in one line
  (`settings.runnable`) and measures the rest.

Both decode greedily and exactly `new_tokens` per source, as every bench backend does (`min_new_tokens` =
`max_new_tokens`: eos cannot end a row), or with `bench --search beam` run generate's own beam search (K beams, the
length penalty, early_stopping=True: the semantics of our loops' `hf_beam_search`). Both are checked before timing:
with the model's own generation rules, their greedy tokens must equal our eager model's on seeded sources (a
near-tie may differ), and for a beam bench their beam tokens too.

The source directory is the one import.json names; its weights must still hash as they did at import.
"""

from __future__ import annotations

import json
import logging
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from seq2trt.core.errors import CheckFailed, CheckpointError, DependencyError, InputError
from seq2trt.core.atomic_files import atomic_write_text, sha256_file
from seq2trt.core.swap import staged_directory
from seq2trt.runtime import registry

from seq2trt.validation.bench.backends import peak_rss_mb, start_turn

logger = logging.getLogger(__name__)

HF_BACKENDS = registry.names(needs_import=True)
OPTIMUM_DIR, OPTIMUM_TASK, OPTIMUM_RECORD = "optimum", "text2text-generation-with-past", "seq2trt_source.json"
# optimum-onnx is an extra of its own: it pins a transformers older than the one seq2trt[hf] may run beside.
OPTIMUM_MISSING = ("the optimum backend needs optimum-onnx, which pins transformers<4.58; pip install "
                   "'seq2trt[optimum]' into an environment of its own")


@dataclass(frozen=True)
class ImportedSource:
    """The Hugging Face directory a checkpoint was imported from, as import.json records it."""

    checkpoint: Path
    path: Path
    family: str
    weights_sha256: dict[str, str]


def imported_source(checkpoint: Path) -> ImportedSource | None:
    """The source of an imported checkpoint (its weights checked against import.json), or None when the checkpoint
    was not imported."""
    from seq2trt.hf_import.importer import IMPORT_RECORD

    record_path = Path(checkpoint) / IMPORT_RECORD
    if not record_path.exists():
        return None
    try:
        record = json.loads(record_path.read_text())
        source = ImportedSource(Path(checkpoint), Path(record["source"]["path"]), record["family"],
                                dict(record["source"]["weights_sha256"]))
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{record_path} is not an import record ({type(exc).__name__}: {exc}); "
                              "re-import the model with `seq2trt import hf`") from None
    for name, digest in source.weights_sha256.items():
        path = source.path / name
        if not path.is_file() or sha256_file(path) != digest:
            raise CheckpointError(f"{path} is {'missing' if not path.is_file() else 'not the file imported'}: "
                                  f"{checkpoint} was imported from {source.path}, and the hf, optimum and ct2 "
                                  "backends load that directory; restore it or re-import")
    return source


def require_source(source: ImportedSource | None, checkpoint: Path | None, names: list[str]) -> ImportedSource:
    if source is None:
        raise InputError(f"{', '.join(names)}: these backends time transformers and Optimum on the Hugging Face "
                         f"directory a checkpoint was imported from, and {checkpoint} was not imported (it holds no "
                         "import.json); import the model with `seq2trt import hf SRC -o CKPT` and export CKPT, or "
                         f"drop {', '.join(names)} from --backends")
    return source


def _transformers():
    try:
        import transformers
    except ImportError:
        raise DependencyError("the hf and optimum backends need transformers; pip install 'seq2trt[hf]'") from None
    return transformers


def load_transformers(src: Path):
    """transformers' model for `src`, fp32, its default attention, local files only."""
    import torch

    from seq2trt.hf_import.text import quiet_transformers

    transformers = _transformers()
    with quiet_transformers():  # transformers 5 draws a progress bar over the bench's own
        return transformers.AutoModelForSeq2SeqLM.from_pretrained(str(src), local_files_only=True,
                                                                 dtype=torch.float32).eval()


def export_optimum(source: ImportedSource, folder: Path, task: str = OPTIMUM_TASK) -> dict:
    """Optimum's ONNX export of the source for `task` (a Whisper source: automatic-speech-recognition-with-past)
    into `folder`, kept while its record names the same weights, task and Optimum version; returns the build's
    figures (seconds None when the cached export was reused)."""
    from importlib.metadata import version

    try:
        from optimum.exporters.onnx import main_export
    except ImportError:
        raise DependencyError(OPTIMUM_MISSING) from None
    record = {"source": str(source.path), "weights_sha256": source.weights_sha256, "task": task,
              "optimum_onnx": version("optimum-onnx")}
    try:
        cached = json.loads((folder / OPTIMUM_RECORD).read_text()) == record
    except (OSError, json.JSONDecodeError):
        cached = False
    seconds = None
    if not cached:
        start = time.perf_counter()
        with staged_directory(folder, force=True, what="Optimum export") as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tracer warnings of the PyTorch export, one per traced branch
            main_export(str(source.path), output=tmp, task=task, local_files_only=True, do_validation=False)
            atomic_write_text(tmp / OPTIMUM_RECORD, json.dumps(record, indent=2) + "\n")
        seconds = round(time.perf_counter() - start, 3)
    return {"convert_seconds": seconds, "file": "*.onnx" + (" (cached)" if cached else ""), "cached": cached,
            "model_bytes": sum(p.stat().st_size for p in folder.glob("*.onnx*"))}


def load_optimum(folder: Path, threads: int):
    """(ORTModelForSeq2SeqLM on `folder`, how its sessions thread) on the CPU provider."""
    from seq2trt.exporters.ort_session import session_options

    try:
        from optimum.onnxruntime import ORTModelForSeq2SeqLM
    except ImportError:
        raise DependencyError(OPTIMUM_MISSING) from None
    options, _, threading = session_options(None, threads, shared_pool=True)  # Optimum opens its sessions itself
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = ORTModelForSeq2SeqLM.from_pretrained(str(folder), session_options=options,
                                                     provider="CPUExecutionProvider")
    merged = "merged decoder" if model.decoder.is_merged else "decoder + decoder with past"
    return model, f"{threading}, ONNX Runtime default optimizations, {merged}"


def _torch(ids: np.ndarray, mask: np.ndarray):
    import torch

    return torch.as_tensor(ids, dtype=torch.int64), torch.as_tensor(mask, dtype=torch.int64)


def generate_tokens(model, input_ids: np.ndarray, attention_mask: np.ndarray, max_new_tokens: int, eos_id: int,
                    beam: int = 1, length_penalty: float = 1.0, n_best: int = 1, sampling=None) -> list[list[int]]:
    """`generate` with the model's own generation rules, greedy or `beam` beams (early_stopping=True), `n_best`
    sequences a source (with their scores when more than one), or sampling (`settings.Sampling`, seeded through
    torch.manual_seed, its n samples a source): every returned sequence's tokens after the start, without eos."""
    import torch

    ids, mask = _torch(input_ids, attention_mask)
    beams = {} if beam == 1 else {"length_penalty": length_penalty, "early_stopping": True}
    options = {"do_sample": False, "num_return_sequences": n_best} if sampling is None else sampling.hf()
    if options["num_return_sequences"] > 1:
        options.update(return_dict_in_generate=True, output_scores=True)
    with torch.inference_mode():
        if sampling is not None:
            torch.manual_seed(sampling.seed)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, num_beams=beam,
                             **beams, **options)
    rows = (out.sequences if hasattr(out, "sequences") else out)[:, 1:].tolist()
    return [row[: row.index(eos_id)] if eos_id in row else row for row in rows]


class _Marks:
    """A `generate` streamer that only notes the time of each put: after the encoder, then after every step."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class TransformersBackend:
    """A model with Hugging Face's `generate` (transformers or Optimum) in this process, timed as the bench times
    every backend. Step times are the gaps between `generate`'s per-token streamer calls (each step with its
    logits processing), N of them for N tokens."""

    scope = "process"

    def __init__(self, name: str, model, threads: int, threading: str, set_threads=None):
        self.name, self.model, self.threads, self._threading = name, model, threads, threading
        self._set_threads = set_threads

    def activate(self) -> None:
        start_turn(self.threads, self._set_threads)

    def decode(self, input_ids: np.ndarray, attention_mask: np.ndarray, new_tokens: int
               ) -> tuple[float, list[float]]:
        import torch

        ids, mask = _torch(input_ids, attention_mask)
        marks = _Marks()
        with torch.inference_mode():
            start = time.perf_counter()
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, num_beams=1, do_sample=False, streamer=marks)
            seconds = time.perf_counter() - start
        if out.shape[1] != new_tokens + 1:  # the decoder start, then exactly new_tokens
            raise CheckFailed(f"{self.name}: generate returned {out.shape[1] - 1} new tokens, not {new_tokens}; "
                              "its time would not be comparable")
        return seconds, list(np.diff(marks.times))

    def sample(self, input_ids: np.ndarray, attention_mask: np.ndarray, new_tokens: int, sampling
               ) -> tuple[float, list[float], list[list[int]]]:
        """`bench --search sample`: generate(do_sample=True) with the warpers, exactly `new_tokens` a row, `sampling.n`
        samples a source (num_return_sequences; with output_scores when more than one), seeded by torch.manual_seed."""
        import torch

        ids, mask = _torch(input_ids, attention_mask)
        marks = _Marks()
        options = sampling.hf()
        if sampling.n > 1:
            options.update(return_dict_in_generate=True, output_scores=True)
        with torch.inference_mode():
            torch.manual_seed(sampling.seed)
            start = time.perf_counter()
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, num_beams=1, streamer=marks, **options)
            seconds = time.perf_counter() - start
        rows = (out.sequences if hasattr(out, "sequences") else out)[:, 1:]
        if rows.shape != (len(ids) * sampling.n, new_tokens):
            raise CheckFailed(f"{self.name}: generate returned {tuple(rows.shape)} sampled tokens, not "
                              f"{(len(ids) * sampling.n, new_tokens)}; its time would not be comparable")
        return seconds, list(np.diff(marks.times)), rows.tolist()

    def search(self, input_ids: np.ndarray, attention_mask: np.ndarray, settings, beam: int,
               length_penalty: float) -> tuple[float, list[list[int]]]:
        """`bench --search beam`: generate's own search, eos stops, at most `settings.max_new_tokens`, its
        num_return_sequences hypotheses a source."""
        start = time.perf_counter()
        outputs = generate_tokens(self.model, input_ids, attention_mask, settings.max_new_tokens, settings.eos_id,
                                  beam, length_penalty, settings.num_return_sequences)
        return time.perf_counter() - start, outputs

    def encode_seconds(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> float:
        import torch

        ids, mask = _torch(input_ids, attention_mask)
        with torch.inference_mode():
            start = time.perf_counter()
            self.model.get_encoder()(input_ids=ids, attention_mask=mask)
            return time.perf_counter() - start

    def step_seconds(self, input_ids, attention_mask, past_len, calls):
        return None  # generate owns its cache: no single step on a chosen past

    def steps_by_past(self, input_ids, attention_mask, new_tokens):
        return None

    def memory(self) -> dict:
        return {"peak_rss_mb": round(peak_rss_mb(), 1), "scope": "process (shared by the in-process backends)"}

    def threading(self) -> str:
        return self._threading

    def close(self) -> None:
        self.model = None


def open_backend(name: str, source: ImportedSource, out: Path, threads: int) -> TransformersBackend:
    """The `hf` or `optimum` backend on `source` (Optimum's export already under OUT/optimum)."""
    if name == "hf":
        import torch

        transformers = _transformers()
        model = load_transformers(source.path)
        threading = (f"{threads} thread(s), transformers {transformers.__version__}, "
                     f"{model.config._attn_implementation} attention")
        return TransformersBackend(name, model, threads, threading, set_threads=torch.set_num_threads)
    if name == "optimum":
        model, threading = load_optimum(Path(out) / OPTIMUM_DIR, threads)
        return TransformersBackend(name, model, threads, threading)
    raise InputError(f"unknown Hugging Face backend {name!r}; choose one of {', '.join(HF_BACKENDS)}")


def prepare(name: str, source: ImportedSource, out: Path, reference, input_ids: np.ndarray,
            attention_mask: np.ndarray, max_new_tokens: int, want: dict) -> tuple[dict, dict | None]:
    """Export (optimum) and check one backend before timing against our eager `reference` model on the same
    sources, with the model's generation rules. `want`: the eager model's outputs, {"greedy": eager_greedy(...)}
    and, for a beam bench, {"beam": (K, length_penalty, n-best, every hypothesis of hf_beam_search with
    early_stopping=True)}, for a sampling bench {"sample": (settings.Sampling, the eager samples under its seed)}.
    Greedy tokens must agree (near-ties aside), beam tokens and samples exactly (sampling with the same seed draws
    the same q: reference_model/decoding/greedy.py). Returns (the check, the build or None)."""
    from seq2trt.validation.ties import compare_greedy

    build = export_optimum(source, Path(out) / OPTIMUM_DIR) if name == "optimum" else None
    backend = open_backend(name, source, out, threads=1)
    eos = reference.cfg.eos_id
    try:
        backend.activate()
        got = generate_tokens(backend.model, input_ids, attention_mask, max_new_tokens, eos)
        if "beam" in want:
            beam, length_penalty, n_best, beam_want = want["beam"]
            beam_got = generate_tokens(backend.model, input_ids, attention_mask, max_new_tokens, eos, beam,
                                       length_penalty, n_best)
        if "sample" in want:
            sampling, sample_want = want["sample"]
            sample_got = generate_tokens(backend.model, input_ids, attention_mask, max_new_tokens, eos,
                                         sampling=sampling)
    finally:
        backend.close()
    comparison = compare_greedy(want["greedy"], got, eos)
    check = comparison.to_dict()
    failures = []
    if not comparison:
        wrong = comparison.sequences - comparison.identical - comparison.ties
        failures.append(f"greedy: {wrong} of {comparison.sequences} sequences differ (" +
                        "; ".join(comparison.mismatches[:5]) + ")")
    if "beam" in want:
        differ = [i for i, (a, b) in enumerate(zip(beam_want, beam_got)) if a != b]
        check["beam"] = {"beam": beam, "length_penalty": length_penalty, "n_best": n_best,
                         "identical": len(beam_want) - len(differ), "sequences": len(beam_want), "mismatches": differ[:10]}
        if differ:
            failures.append(f"beam {beam}: sequences {differ[:10]} differ from hf_beam_search")
    if "sample" in want:
        differ = [i for i, (a, b) in enumerate(zip(sample_want, sample_got)) if a != b]
        check["sample"] = {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
                           "n": sampling.n, "seed": sampling.seed, "identical": len(sample_want) - len(differ),
                           "sequences": len(sample_want), "mismatches": differ[:10]}
        if differ or len(sample_want) != len(sample_got):
            failures.append(f"sampling (seed {sampling.seed}): samples {differ[:10]} differ from the eager model's")
    if failures:
        raise CheckFailed(f"{name} disagrees with the eager model: {'; '.join(failures)}; its timings would not be "
                          "comparable")
    logger.debug("%s agrees with the eager model on %d sequences", name, comparison.sequences)
    return check, build
