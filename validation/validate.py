"""`validate`: graph-level and end-to-end parity of an export directory, written to `reports/parity.json` / `.md`.

`GRAPH_SETS` (the registry's one table, runtime/backends/graph_sets.py) maps a `--graphs` name to the folder of the
encoder/decoder files it validates. `--backend` is one of the registry's validating backends: ONNX Runtime runs those
graphs (ort-cuda: on the CUDA provider, the KV cache on the GPU; its default graphs are fused-ort); a TensorRT backend
runs the engines under OUT/engines, judged against the graphs they were built from (fused-trt, or plain for
--no-plugin engines).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from seq2trt.exporters import spec
from seq2trt.exporters.artifact_checks import load_graph
from seq2trt.exporters.manifest import Manifest, generation, verify, writing_into
from seq2trt.exporters.quantize import verify_quantized
from seq2trt.reference_model.decoding import DecodeSettings
from seq2trt.core.errors import ArtifactError, CheckFailed, InputError
from seq2trt.reference_model.sources import source_kind

from seq2trt.runtime.backends.graph_sets import GRAPH_SETS, GraphSet
from seq2trt.runtime.step_model import RunnerStepModel
from seq2trt.runtime.decode_jobs import check_threads, checkpoint_folder, generation_config
from seq2trt.validation.end_to_end import EndToEndResult, end_to_end
from seq2trt.validation.localize import localise_export
from seq2trt.validation.parity import GraphParity, graph_parity
from seq2trt.validation.precision import judge_for
from seq2trt.validation.sampling import SamplingAgreement, sampling_agreement
from seq2trt.runtime.reference_loader import e2e_sources, load_reference
from seq2trt.validation.reports.parity_table import write_reports
from seq2trt.runtime import registry
from seq2trt.runtime.runners import EagerRunner, OrtRunner

logger = logging.getLogger(__name__)


BACKENDS = registry.VALIDATE_BACKENDS


SAMPLING_SOURCES = 256  # end-to-end sources also sampled token for token (fp32); the chi-square test takes 4 of them
MAX_SAMPLES = 100_000  # end-to-end sources; the demo task's held-out class alone has ~20 M members


@dataclass(frozen=True)
class ValidateSettings:
    backend: str = "ort"
    graphs: str | None = None  # None: plain, or for a TensorRT backend the graphs its engines were built from
    samples: int = 1000
    beam_size: int = 4
    max_new_tokens: int | None = None  # None: the limits' max_tgt_len - 1 (32 for models without a task)
    device: str = "cpu"
    threads: int = 1  # small decoding calls: one thread is fastest and robust on a shared CPU
    seed: int = 0
    localize: bool = False  # also show the worst clean cases (failures and near-ties are localised anyway)
    localize_budget_s: float = 120.0  # wall-clock budget of the localisation pass (localize.py); 0 turns it off

    def __post_init__(self) -> None:
        registry.declared(self.backend, BACKENDS)
        if self.graphs is not None and self.graphs not in GRAPH_SETS:
            raise InputError(f"unknown graph set {self.graphs!r}; choose one of {', '.join(GRAPH_SETS)}")
        if self.threads != 0:  # 0: one per core
            check_threads(self.threads)
        if self.localize_budget_s < 0 or (self.localize and not self.localize_budget_s):
            raise InputError(f"--localize-budget must be > 0 with --localize and >= 0 otherwise, got "
                             f"{self.localize_budget_s}")
        if self.samples < 0 or self.beam_size < 1:
            raise InputError(f"--samples must be >= 0 and --beam-size >= 1, got {self.samples} and {self.beam_size}")
        if self.samples > MAX_SAMPLES:
            raise InputError(f"--samples {self.samples} is more than validate decodes end to end (at most "
                             f"{MAX_SAMPLES}: each source is decoded four times, greedy and beam on both models); "
                             "lower it")


def _engine_graphs(out: Path, settings: ValidateSettings) -> ValidateSettings:
    """Settings for validating TensorRT engines: the graph set they were built from (fused-trt, or plain for
    --no-plugin engines), once this machine can run them."""
    from seq2trt.exporters.tensorrt.engines import read_build
    from seq2trt.core.errors import DependencyError
    from seq2trt.core.layout import engine_dir

    why = registry.unavailable((settings.backend,)).get(settings.backend)
    if why:
        raise DependencyError(f"--backend {settings.backend}: {why}; validate the engines on a machine with an NVIDIA "
                              f"GPU, or the graphs they are built from here with `seq2trt validate {out} --graphs "
                              "fused-trt`")
    # which graphs they were built from; the plans are hashed once, when the registry opens them (verify_engines)
    plugin = read_build(engine_dir(out, settings.backend), verify=False).get("plugin", {}).get("used", True)
    built_from = "fused-trt" if plugin else "plain"
    if settings.graphs not in (None, built_from):
        raise InputError(f"--backend {settings.backend} runs engines built from the {built_from} graphs, not "
                         f"--graphs {settings.graphs}; drop --graphs (or rebuild the engines)")
    return replace(settings, graphs=built_from)


def _device_graphs(out: Path, settings: ValidateSettings) -> ValidateSettings:
    """Settings for a backend on a GPU provider (ort-cuda): its runners on that device, its declared graph set by
    default, refused in one line where the provider is missing or the graphs hold CPU-only nodes."""
    from seq2trt.core.errors import DependencyError

    backend = registry.BACKENDS[settings.backend]
    why = registry.unavailable((settings.backend,)).get(settings.backend)
    if why:
        raise DependencyError(f"--backend {settings.backend}: {why}; validate the same graphs on the CPU with "
                              f"`seq2trt validate {out} --graphs {settings.graphs or backend.graphs}`")
    graphs = settings.graphs or backend.graphs
    if graphs not in ("plain", backend.graphs):
        raise InputError(f"--backend {settings.backend} runs the plain or {backend.graphs} graphs, not --graphs "
                         f"{graphs}; drop --graphs, or validate those with --backend ort")
    return replace(settings, graphs=graphs, device=backend.device)


def check_graph_file(path: Path, cfg, kind: spec.GraphKind, dtype: str) -> None:
    """A graph file validation reads, checked before anything runs it: against the graph contract (`load_graph`:
    a valid model, input and output names and types, attention sizes), and every text field valid UTF-8. A
    damaged byte inside a name or metadata still parses, but protobuf then hands that field over as bytes, which
    the code reading names (localisation) cannot use."""
    model = load_graph(path, cfg, kind, dtype)
    field = _undecodable_text(model)
    if field is not None:
        raise ArtifactError(f"{path} is damaged: its {field} is not valid UTF-8 text, as ONNX text must be; "
                            "re-export with `seq2trt export --force` (and re-fuse)")


def _undecodable_text(message, where: str = "") -> str | None:
    """Where the first string field of a protobuf message (searched recursively) did not decode, e.g.
    `graph.node[12].metadata_props[0].value`; None when every one did."""
    for field, value in message.ListFields():
        if field.type not in (field.TYPE_STRING, field.TYPE_MESSAGE):  # numbers and bytes (weights) hold no text
            continue
        values = value if field.is_repeated else [value]
        for i, item in enumerate(values):
            at = f"{where}{'.' if where else ''}{field.name}" + (f"[{i}]" if field.is_repeated else "")
            if field.type == field.TYPE_STRING and not isinstance(item, str):
                return at
            found = _undecodable_text(item, at) if field.type == field.TYPE_MESSAGE else None
            if found is not None:
                return found
    return None


def speech_prompt(out: Path, manifest: Manifest, checkpoint: Path | None) -> tuple[int, ...]:
    """The decoder prompt of a speech model's end-to-end check (its first language, transcribe, no timestamps, as
    `reference_model.speech` builds it); () for a text model."""
    if not spec.audio_source(manifest.config):
        return ()
    from seq2trt.reference_model.speech import SpeechTokens

    speech = SpeechTokens.from_record((generation_config(checkpoint_folder(out, manifest, checkpoint)) or {}).get("speech"))
    return speech.prompt(next(iter(speech.languages), None) if speech.multilingual else None, "transcribe")


def heldout_exact_match(task_name: str, samples: int) -> tuple[str, Callable[[list[list[int]]], float]]:
    """The task's metric on greedy outputs of its first `samples` held-out sources: exact match of the text."""
    from seq2trt.reference_model.tasks import get_task

    task = get_task(task_name)
    pairs = task.heldout(samples)
    return "held-out exact match", lambda outputs: task.exact_match(outputs, pairs)


def _with_graph_set(out: Path, settings: ValidateSettings) -> ValidateSettings:
    """`settings` naming the graph set its backend reads: the one its engines were built from, the one its device
    runs, else the one asked for (the plain graphs by default)."""
    backend = registry.BACKENDS[settings.backend]
    if backend.runs == "tensorrt":
        return _engine_graphs(out, settings)
    if backend.device != "cpu":
        return _device_graphs(out, settings)
    return replace(settings, graphs="plain") if settings.graphs is None else settings


def _checked_export(out: Path, settings: ValidateSettings, graph_set: GraphSet):
    """The export's verified manifest, once the graph set's folder (and the plain graphs, which localisation reads)
    holds graphs of the export's model and the asked new-token count fits its limits."""
    manifest = verify(out, [kind.filename for kind in spec.GraphKind])  # every graph set derives from the export
    graph_set.verified_folder(out, manifest)
    cfg, dtype, limits = manifest.config, manifest.dtype, manifest.limits
    folders = [graph_set.folder(out)] + ([out] if settings.localize_budget_s > 0 else [])  # localisation reads both
    for folder in dict.fromkeys(folders):
        for kind in spec.GraphKind:
            check_graph_file(folder / kind.filename, cfg, kind, dtype)
    if settings.max_new_tokens is not None and not 1 <= settings.max_new_tokens <= limits.max_tgt_len - 1:
        raise InputError(f"--max-new-tokens {settings.max_new_tokens} is outside [1, {limits.max_tgt_len - 1}] (the "
                         f"export's max_tgt_len {limits.max_tgt_len}, bos included); lower it or re-export with a "
                         "larger --max-tgt-len")
    return manifest


def _decoding_parity(out: Path, manifest, checkpoint: Path | None, settings: ValidateSettings, task_name,
                     candidates: tuple, references: tuple, precision: str, progress):
    """(end-to-end parity, sampling agreement, where the sources came from) of the candidate runners' step model
    against the eager one on `settings.samples` sources."""
    cfg, limits = manifest.config, manifest.limits
    sources, origin = e2e_sources(cfg, task_name, settings.samples, settings.seed)
    prompt = speech_prompt(out, manifest, checkpoint)
    cap = limits.max_tgt_len - 1 if task_name else min(32, limits.max_tgt_len - 1 - len(prompt))
    decode = replace(DecodeSettings.for_model(cfg, settings.max_new_tokens or cap), prompt=prompt)
    candidate = registry.step_model_of(settings.backend, *candidates)  # ort-cuda: the cache on the device
    eager = RunnerStepModel(*references)
    e2e = end_to_end(candidate, eager, sources, decode, precision,
                     beam_size=settings.beam_size, batch_size=limits.max_batch, progress=progress,
                     task_metric=heldout_exact_match(task_name, settings.samples) if task_name else None,
                     source_kind=source_kind(cfg))
    if progress:
        progress("sampling agreement")
    sampled = sampling_agreement(candidate, eager, sources[:SAMPLING_SOURCES], decode, precision,
                                 batch_size=limits.max_batch, seed=settings.seed, pad=source_kind(cfg).pad)
    return e2e, sampled, origin


def run_validation(out: Path, settings: ValidateSettings, checkpoint: Path | None = None,
                   progress: Callable[[str], None] | None = None) -> dict:
    """Validate `out`, write its reports, and return the parity document; raise CheckFailed when anything fails."""
    out = Path(out)
    started = generation(out)  # before anything is read: the reports must describe this export
    engines = registry.BACKENDS[settings.backend].runs == "tensorrt"
    settings = _with_graph_set(out, settings)
    graph_set = GRAPH_SETS[settings.graphs]
    if graph_set.whole_search:
        from seq2trt.validation.ort_search_parity import run_generate_validation

        return run_generate_validation(out, settings, checkpoint, progress, int8=graph_set.quantized)
    manifest = _checked_export(out, settings, graph_set)
    cfg, dtype, limits = manifest.config, manifest.dtype, manifest.limits
    model, task_name = load_reference(manifest, checkpoint)
    base = {"device": settings.device, "intra_op_threads": settings.threads}
    options = {**base, **(graph_set.runner_options(dtype) if graph_set.runner_options else {})}
    fp32_options = {**base, **(graph_set.runner_options("fp32") if graph_set.runner_options else {})}
    paths = {kind: graph_set.folder(out) / kind.filename for kind in spec.GraphKind}
    if engines:
        candidates, _ = registry.engine_runners(out, settings.backend, manifest)
    else:
        candidates = tuple(OrtRunner(paths[kind], cfg, kind, dtype, limits, **options) for kind in spec.GraphKind)
    precision = "int8" if graph_set.quantized else dtype  # how the graphs are judged (validation/precision.py)
    judge, judged_options = judge_for(precision, paths, cfg, limits, model, options, fp32_options)
    judged = candidates if judged_options == options else tuple(
        OrtRunner(paths[kind], cfg, kind, dtype, limits, name=f"onnxruntime-{precision}-judged", **judged_options)
        for kind in spec.GraphKind)
    reference = model.double()
    references = tuple(EagerRunner(reference, kind, limits, name="eager-fp64") for kind in spec.GraphKind)
    with contextlib.ExitStack() as stack:  # runners leave in reverse order, restoring thread settings
        for r in dict.fromkeys(candidates + judged + references):
            stack.enter_context(r)
        if progress:
            progress("graph-level parity over the spec sweep")
        graphs = graph_parity(judged, references, spec.sweep(limits, cfg=cfg), seed=settings.seed, judge=judge)
        e2e = sampled = origin = None
        if settings.samples:
            e2e, sampled, origin = _decoding_parity(out, manifest, checkpoint, settings, task_name, candidates,
                                                    references, precision, progress)
    document = parity_document(manifest, settings, graphs, e2e, origin, sampled)
    document["localisation"] = []
    if engines and settings.localize_budget_s > 0:  # localisation reads ONNX graphs' intermediate values
        document["localisation_skipped"] = "engines: localise the graphs they were built from with --backend ort"
    elif settings.localize_budget_s > 0:
        if progress:
            progress(f"localising failures and near-ties per layer (budget {settings.localize_budget_s:g} s)")
        document.update(localise_export(graph_set.folder(out), out, reference, dtype, limits, precision, options,
                                        graphs, settings.seed, settings.localize_budget_s, settings.localize,
                                        fp32_options))
    with writing_into(out, started, "validate"):
        write_reports(out, document)
    failures = graphs.failures() + (e2e.failures() if e2e is not None else []) + (
        sampled.failures() if sampled is not None else [])
    if failures:
        raise CheckFailed(f"parity failed for {out} ({len(failures)} failing checks; see "
                          f"{out}/reports/parity.md):\n  " + "\n  ".join(failures) + _int8_hint(out, graph_set))
    return document


def _int8_hint(out: Path, graph_set: GraphSet) -> str:
    """Why full-range int8 graphs fail on an x86 CPU without VNNI, and the fix."""
    from seq2trt.exporters.quantize import saturating_int8_dot

    if not graph_set.quantized or not saturating_int8_dot() or verify_quantized(out).get("reduce_range"):
        return ""
    return (f"\nthis CPU has no VNNI: ONNX Runtime's uint8 x int8 products saturate with the 8-bit weights of these "
            f"graphs; re-quantize for it with `seq2trt quantize {out} --reduce-range --force`")


def parity_document(manifest: Manifest, settings: ValidateSettings, graphs: GraphParity,
                    e2e: EndToEndResult | None, e2e_origin: str | None,
                    sampled: SamplingAgreement | None = None) -> dict:
    e2e_doc = None if e2e is None else {**e2e.to_dict(), "inputs": e2e_origin}
    return {
        "passed": bool(graphs) and (e2e is None or bool(e2e)) and (sampled is None or bool(sampled)),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "backend": settings.backend, "graphs_set": settings.graphs, "dtype": manifest.dtype,
        "settings": {k: v for k, v in vars(settings).items()},
        "reference": "eager PyTorch, float64",
        "graphs": graphs.summary(),
        "graph_failures": graphs.failures(),
        "cases": len(graphs.cases),
        "end_to_end": e2e_doc,
        "sampling": None if sampled is None else sampled.to_dict(),
    }
