"""One function per pipeline stage (train, import, export, fuse, quantize, generate, build, validate, bench,
report, serve) with typed results; `serve` returns the running server (a context manager that drains it).

Each calls the same library functions, with the same checks, as the CLI verb of its name (the CLI's export, fuse
and import verbs call these). Errors are the project's typed errors (`seq2trt.InputError`, `seq2trt.CheckFailed`,
...); progress goes to the optional `progress(message)` callback, never to the terminal.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from seq2trt.core import layout
from seq2trt.exporters.spec import DEFAULT_OPSET
from seq2trt.runtime.registry import BENCH_DEFAULT

Progress = Callable[[str], None]


def _plain(value: Any) -> Any:
    """JSON-friendly copy: paths become strings, mappings and sequences are copied."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


class _Result:
    def to_dict(self) -> dict[str, Any]:
        """The fields as plain JSON values (paths as strings)."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]


@dataclass(frozen=True)
class ExportResult(_Result):
    """What `export` wrote: `out`, its graphs (graph kind -> path), the manifest.json content, dtype and limits."""

    out: Path
    graphs: dict[str, Path]
    manifest: dict[str, Any]
    dtype: str
    limits: dict[str, int]

    @property
    def manifest_path(self) -> Path:
        from seq2trt.exporters.manifest import MANIFEST

        return self.out / MANIFEST


@dataclass(frozen=True)
class FuseResult(_Result):
    """What `fuse` wrote: the folder of fused graphs, their paths, and the audit (fusion.json's counts)."""

    folder: Path
    target: str
    graphs: dict[str, Path]
    complete: bool
    audit: dict[str, Any]  # graph -> {expected, fused, unfused_blocks, nodes_before, nodes_after, complete}


@dataclass(frozen=True)
class QuantizeResult(_Result):
    """What `quantize` wrote: the folder of int8 graphs and quantization.json's content."""

    folder: Path
    graphs: dict[str, Path]
    report: dict[str, Any]


@dataclass(frozen=True)
class BuildResult(_Result):
    """What `build` wrote: the engine directory and its build.json."""

    engine_dir: Path
    build: dict[str, Any]


@dataclass(frozen=True)
class ValidationResult(_Result):
    """A validation that passed (a failing one raises `seq2trt.CheckFailed` after writing its reports)."""

    passed: bool
    cases: int  # graph-level cases of the shape sweep
    end_to_end: dict[str, Any] | None  # token_agreement, sequence_match, ... (None with samples=0)
    report: Path  # the Markdown report; parity.json beside it
    document: dict[str, Any]  # the full parity document


@dataclass(frozen=True)
class ImportResult(_Result):
    """The checkpoint `import_hf` wrote and its import record (family, source hashes, verification)."""

    checkpoint: Path
    family: str
    record: dict[str, Any]


@dataclass(frozen=True)
class BenchResult(_Result):
    """The bench's document (results, ratios per threads / backend / batch) and the reports folder."""

    reports: Path
    results: dict[str, Any]
    ratios: dict[str, Any]
    document: dict[str, Any]


def _graph_paths(folder: Path) -> dict[str, Path]:
    from seq2trt.exporters.spec import GraphKind

    return {kind.value: Path(folder) / kind.filename for kind in GraphKind}


def export(checkpoint: str | Path, out: str | Path, *, dtype: str = "fp32", max_batch: int | None = None,
           max_src_len: int | None = None, max_tgt_len: int | None = None, opset: int = DEFAULT_OPSET,
           force: bool = False, progress: Progress | None = None) -> ExportResult:
    """Export the seq2trt checkpoint to `out/encoder.onnx`, `out/decoder.onnx` and `out/manifest.json`.

    `max_batch` (None: 32), `max_src_len` / `max_tgt_len` (None: the model's) are the profiles' limits. Nothing is
    replaced without `force`, and then only an earlier export; bad arguments raise before anything is written.
    """
    from seq2trt.exporters.manifest import MANIFEST, read_manifest
    from seq2trt.exporters.onnx_export import export as export_model
    from seq2trt.exporters.spec import DTYPES, OPSETS, Limits
    from seq2trt.core.atomic_files import refuse_existing
    from seq2trt.reference_model.checkpoint import load_checkpoint, source_record
    from seq2trt.core.errors import ConfigError

    checkpoint, out = Path(checkpoint), Path(out)
    refuse_existing(out, force, "export", kind=MANIFEST, protect=(checkpoint,))  # before any work
    if dtype not in DTYPES:  # before the checkpoint is read
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if opset not in OPSETS:
        raise ConfigError(f"opset {opset} is not supported; choose {OPSETS.start}..{OPSETS.stop - 1}")
    _check_export_memory(checkpoint, dtype)
    if progress:
        progress(f"loading {checkpoint}")
    model, _ = load_checkpoint(checkpoint)
    limits = Limits.for_model(model.cfg, 32 if max_batch is None else max_batch, max_src_len, max_tgt_len)
    if progress:
        progress(f"exporting {dtype} graphs (opset {opset})")
    export_model(model, out, dtype=dtype, opset=opset, limits=limits, force=force, source=source_record(checkpoint),
                 **({"progress": progress} if progress else {}))
    data = read_manifest(out).data
    return ExportResult(out, _graph_paths(out), data, data["dtype"], dict(data["settings"]["limits"]))


def _check_export_memory(checkpoint: Path, dtype: str) -> None:
    """Refuse an export the machine cannot hold before the checkpoint is read (memory.export_peak); a checkpoint
    without a readable config is left to load_checkpoint's own error."""
    from seq2trt.reference_model import memory
    from seq2trt.reference_model.config import Seq2SeqConfig, memory_parts, physical_memory

    config = (checkpoint if checkpoint.is_dir() else checkpoint.parent) / layout.CONFIG
    try:
        cfg = Seq2SeqConfig.load(config)
    except Exception:  # missing or damaged: load_checkpoint names it
        return
    weights = sum(memory_parts(cfg).values())
    memory.check_fits(f"a {dtype} export", memory.export_peak(weights, 4 if dtype == "fp32" else 2), physical_memory(),
                      f"{checkpoint} ({weights / memory.GiB:,.1f} GiB of fp32 weights)",
                      "export on a machine with more memory (the peak is the fp32 model plus one graph's weights)")


def fuse(out: str | Path, target: str = "trt", *, allow_partial: bool = False, force: bool = False,
         progress: Progress | None = None) -> FuseResult:
    """Fuse every attention block of the export in `out` into `out/fused/<target>/` ("trt": the seq2trt plugin
    node; "ort": com.microsoft.MultiHeadAttention) and audit it; an incomplete fusion raises `CheckFailed`
    unless `allow_partial`."""
    from seq2trt.exporters.fuse import Target, fuse_artifacts, fused_dir
    from seq2trt.core.errors import InputError

    choices = [t.value for t in Target]
    if target not in choices:
        raise InputError(f"unknown fusion target {target!r}; choose one of {', '.join(choices)}")
    if progress:
        progress(f"fusing the attention blocks of {out} for {target}")
    audit = fuse_artifacts(Path(out), Target(target), allow_partial=allow_partial, force=force,
                           **({"progress": progress} if progress else {}))
    folder = fused_dir(Path(out), Target(target))
    doc = audit.to_dict()
    return FuseResult(folder, target, _graph_paths(folder), audit.complete, doc["graphs"])


def quantize(out: str | Path, *, per_channel: bool = False, reduce_range: bool | None = None, force: bool = False,
             progress: Progress | None = None) -> QuantizeResult:
    """Quantize the fused ORT graphs of `out` to int8 (dynamic) into `out/quantized/ort-int8/`.
    `reduce_range` None: chosen for this CPU (7-bit weights where int8 products saturate)."""
    from seq2trt.exporters.quantize import QuantizeSettings, quantize_artifacts, quantized_dir

    if progress:
        progress(f"quantizing the fused ORT graphs of {out} to int8")
    doc = quantize_artifacts(Path(out), QuantizeSettings(per_channel, reduce_range), force=force,
                             **({"progress": progress} if progress else {}))
    folder = quantized_dir(Path(out))
    return QuantizeResult(folder, _graph_paths(folder), doc)


def engine_request(out: str | Path, backend: str = "tensorrt-rtx", target: str | None = None,
                   dtype: str | None = None, max_batch: int | None = None, max_src_len: int | None = None,
                   max_tgt_len: int | None = None, plugin: bool = True, opt_level: int = 3,
                   workspace_mib: int | None = None, timing_cache: str | Path | None = None,
                   force: bool = False):
    """The `EngineRequest` of `build`'s arguments (the CLI's build verb uses it too): target None is the GPU here,
    or sm_86 for TensorRT-RTX without one; limits None are the export's."""
    from seq2trt.exporters import manifest, spec
    from seq2trt.exporters.tensorrt.engines import EngineRequest
    from seq2trt.exporters.tensorrt import trt_compat

    if target is None:  # only TensorRT-RTX can name a target it is not running on
        target = "current" if trt_compat.has_gpu() or backend == trt_compat.Flavour.TENSORRT.value else "sm_86"
    targets = trt_compat.parse_targets(backend, target)
    exported = manifest.read_manifest(Path(out))  # a missing or broken export is refused before the build starts
    limits = None
    if any(v is not None for v in (max_batch, max_src_len, max_tgt_len)):
        base = exported.limits
        pick = lambda given, default: default if given is None else given  # 0 is refused, not read as "default"
        limits = spec.Limits.for_model(exported.config, pick(max_batch, base.max_batch),
                                       pick(max_src_len, base.max_src_len), pick(max_tgt_len, base.max_tgt_len))
    return EngineRequest(backend, targets, dtype, limits, plugin, opt_level,
                         workspace_mib * (1 << 20) if workspace_mib else None, force,
                         Path(timing_cache) if timing_cache is not None else None)


def build(out: str | Path, backend: str = "tensorrt-rtx", target: str | None = None, *, dtype: str | None = None,
          max_batch: int | None = None, max_src_len: int | None = None, max_tgt_len: int | None = None,
          plugin: bool = True, opt_level: int = 3, workspace_mib: int | None = None,
          timing_cache: str | Path | None = None, force: bool = False,
          progress: Progress | None = None) -> BuildResult:
    """Build TensorRT engines of the export in `out` into `out/engines/<backend>-<target>-<dtype>/`
    (`target`: "sm_86,sm_89" or "current"; see `engine_request` for the defaults)."""
    from seq2trt.exporters.tensorrt.engines import build_engines, read_build

    request = engine_request(out, backend, target, dtype, max_batch, max_src_len, max_tgt_len, plugin, opt_level,
                             workspace_mib, timing_cache, force)
    report = (lambda graph, phase, done: progress(f"{graph} {phase}".strip())) if progress else None
    engine_dir = build_engines(Path(out), request, report)
    return BuildResult(Path(engine_dir), read_build(engine_dir, verify=False))


def validate(out: str | Path, *, backend: str = "ort", graphs: str | None = None, samples: int = 1000,
             beam_size: int = 4, max_new_tokens: int | None = None, checkpoint: str | Path | None = None,
             device: str = "cpu", threads: int = 1, seed: int = 0, localize: bool = False,
             localize_budget_s: float = 120.0, progress: Progress | None = None) -> ValidationResult:
    """Check `out`'s graphs (`graphs`: plain, fused-ort, fused-trt, int8-ort, generate, ...) or engines against
    the eager model and write `out/reports/parity.json` and `parity.md`. Any failure raises `seq2trt.CheckFailed`
    naming every failing check (the reports are written first)."""
    from seq2trt.validation.validate import ValidateSettings, run_validation

    settings = ValidateSettings(backend=backend, graphs=graphs, samples=samples, beam_size=beam_size,
                                max_new_tokens=max_new_tokens, device=device, threads=threads, seed=seed,
                                localize=localize, localize_budget_s=localize_budget_s)
    out = Path(out)
    doc = run_validation(out, settings, Path(checkpoint) if checkpoint is not None else None, progress=progress)
    # run_validation returns only when every check passed (it raises CheckFailed otherwise)
    return ValidationResult(bool(doc.get("passed", True)), int(doc.get("cases", 0)), doc.get("end_to_end"),
                            layout.reports_dir(out) / doc.get("report", "parity.md"), doc)


def import_hf(src: str | Path, out: str | Path, *, force: bool = False,
              progress: Progress | None = None) -> ImportResult:
    """Import the Hugging Face model directory `src` (as save_pretrained writes it; never downloads) as a seq2trt
    checkpoint in `out`, after proving it equal to transformers' model and generate (a failure raises
    `seq2trt.CheckFailed` and writes nothing)."""
    from seq2trt.core.atomic_files import refuse_existing
    from seq2trt.reference_model.checkpoint import is_checkpoint
    from seq2trt.hf_import.importer import check_source_dir, import_hf as run_import

    src, out = Path(src), Path(out)
    check_source_dir(src)  # a symlink loop must not reach the protect check's resolve()
    refuse_existing(out, force, "checkpoint", kind=is_checkpoint, protect=(src,))  # before any work
    record = run_import(src, out, force=force, progress=progress or (lambda msg: None))
    return ImportResult(out, record["family"], record)


def bench(out: str | Path, backends: str | Iterable[str] = BENCH_DEFAULT, *,
          batch_sizes: Sequence[int] = (1, 8, 32), threads: Sequence[int] = (1,), checkpoint: str | Path | None = None,
          progress: Progress | None = None, **settings: Any) -> BenchResult:
    """Time `backends` on the export in `out`; write `out/reports/latency.json`, `latency.md` and plots.
    Further keywords are `BenchSettings` fields (repeats, warmup, src_len, new_tokens, curves, search, beam, ...)."""
    from seq2trt.validation.bench.measure import run_bench
    from seq2trt.validation.bench.settings import BenchSettings, parse_backends

    names = parse_backends(backends if isinstance(backends, str) else ",".join(backends))
    run = BenchSettings(backends=names, batch_sizes=tuple(batch_sizes), threads=tuple(threads), **settings)
    out = Path(out)
    doc = run_bench(out, run, Path(checkpoint) if checkpoint is not None else None, progress)
    return BenchResult(layout.reports_dir(out), doc["results"], doc["ratios"], doc)


@dataclass(frozen=True)
class TrainResult(_Result):
    """What `train` wrote: the checkpoint folder and the training metrics (metrics.json's content)."""

    checkpoint: Path
    metrics: dict[str, Any]


def train(out: str | Path, *, task: str = "numbers", preset: str = "demo", steps: int | None = None,
          batch_size: int | None = None, lr: float | None = None, seed: int = 0, eval_examples: int | None = None,
          force: bool = False, progress: Callable[[int, float], None] | None = None) -> TrainResult:
    """Train a model on a built-in task (CPU) into the checkpoint folder `out`; `progress(step, loss)` per step.
    Unset settings take TrainSettings' defaults. A bad task or preset name, or an existing folder without
    `force`, is refused before any work."""
    import json

    from seq2trt.core.atomic_files import refuse_existing
    from seq2trt.reference_model.checkpoint import is_checkpoint, save_checkpoint
    from seq2trt.reference_model.config import preset as make_preset
    from seq2trt.reference_model.tasks import get_task
    from seq2trt.reference_model.train import TrainSettings, train as train_model

    out = Path(out)
    t = get_task(task)
    make_preset(preset)
    given = dict(steps=steps, batch_size=batch_size, lr=lr, eval_examples=eval_examples)
    settings = TrainSettings(task=task, preset=preset, seed=seed, **{k: v for k, v in given.items() if v is not None})
    refuse_existing(out, force, "checkpoint", kind=is_checkpoint)  # before any work; the write below is atomic
    model, metrics = train_model(settings, progress or (lambda step, loss: None))
    save_checkpoint(out, model, (t.source_vocab, t.target_vocab), force=True,
                    extra_files={layout.METRICS: json.dumps(metrics, indent=2) + "\n"})
    return TrainResult(out, metrics)


@dataclass(frozen=True)
class OrtSearchResult(_Result):
    """What `ort_search` wrote: generate.onnx and its record (generate.json's content; the artifacts keep their
    names, so exports made before the rename still load)."""

    graph: Path
    record: dict[str, Any]


GenerateResult = OrtSearchResult  # the old name of the result, kept for code that names it


def ort_search(out: str | Path, *, int8: bool = False, force: bool = False,
               no_repeat_ngram_size: int | None = None) -> OrtSearchResult:
    """ONNX Runtime's BeamSearch around the fused ORT graphs of `out` (or, `int8`, the int8 ones):
    OUT/generate/ort[-int8]/generate.onnx, run by the backends ort-generate / ort-generate-int8.
    `no_repeat_ngram_size` is fixed in the graph; None: the model's own generation settings, else 0."""
    from seq2trt.exporters.ort_search import FILENAME, generate_artifacts

    record = generate_artifacts(Path(out), force=force, int8=int8, no_repeat_ngram_size=no_repeat_ngram_size)
    return OrtSearchResult(layout.generate_dir(out, int8) / FILENAME, record)


def generate(out: str | Path, **options: Any) -> OrtSearchResult:
    """Deprecated: `ort_search` (a FutureWarning); "generate" also names transformers' `generate`, the served ids
    model and `Translator.generate`."""
    import warnings

    warnings.warn("seq2trt.generate is deprecated; use seq2trt.ort_search", FutureWarning, stacklevel=2)
    return ort_search(out, **options)


@dataclass(frozen=True)
class ReportResult(_Result):
    """The report `report` rendered: Markdown and HTML."""

    markdown: Path
    html: Path


def report(out: str | Path) -> ReportResult:
    """Render OUT/reports/report.md and report.html from what the stages wrote."""
    from seq2trt.validation.reports.report import write_report

    md, html = write_report(Path(out))
    return ReportResult(Path(md), Path(html))


def serve(out: str | Path, backend: str = "ort-fused", *, http_port: int = 8000, grpc_port: int = 8001,
          metrics_port: int = 8002, host: str = "127.0.0.1", max_batch: int | None = None,
          max_queue_delay_us: int = 2000, instances: int = 1, threads: int = 1, checkpoint: str | Path | None = None,
          log: str | Path | None = None, ready_timeout_s: float = 300, exit_timeout_s: int = 60):
    """Serve the export OUT with Triton Inference Server in the background, as `seq2trt serve` does (models
    `generate` and `translate`, or `transcribe` for Whisper; dynamic batching), and return the ready
    `serving.server.RunningServer`: `.endpoints` (URLs by protocol), `.models`, `.stop()` (drain; the exit code).
    Use it as a context manager to stop it at the block's end. Ports must be free; the server dies with this
    process. Raises InputError for bad settings (before anything starts), ServerError if it does not come up."""
    from seq2trt.serving.server import RunningServer, ServeSettings, check_counts
    from seq2trt.reference_model.decoding import GNMT_ALPHA
    from seq2trt.runtime import registry

    registry.declared(backend, registry.SERVE_BACKENDS)
    check_counts(threads, instances, max_batch, max_queue_delay_us)
    settings = ServeSettings(Path(out), backend, None if checkpoint is None else Path(checkpoint), threads, max_batch,
                             max_queue_delay_us, instances, GNMT_ALPHA, host, http_port, grpc_port, metrics_port)
    return RunningServer(settings, ready_timeout_s, exit_timeout_s, None if log is None else Path(log))
