"""`validate`: graph-level and end-to-end parity of an export directory, written to `reports/parity.json` / `.md`.

`GRAPH_SETS` maps a `--graphs` name to the folder of the encoder/decoder files it validates; `BACKENDS` maps a
`--backend` name to the runner class. Both are small lookups so later graph sets (fused ones) and backends plug in.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from seq2trt.exporters import spec
from seq2trt.exporters.fuse import Target, fused_dir, verify_fused
from seq2trt.exporters.manifest import Manifest, verify
from seq2trt.exporters.quantize import quantized_dir, verify_quantized
from seq2trt.reference_model.decoding import DecodeSettings
from seq2trt.reference_model.errors import CheckpointError, CheckFailed, InputError
from seq2trt.reference_model.io import atomic_write_text, sha256_file

from .adapter import RunnerStepModel
from .end_to_end import EndToEndResult, end_to_end
from .parity import GraphParity, graph_parity
from .runners import EagerRunner, OrtRunner, Runner

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class GraphSet:
    """The folder of one `--graphs` choice's encoder and decoder files (from the export directory), and any extra
    runner options they need for a dtype (e.g. `prepare` / `custom_op_libraries` for plugin graphs)."""

    folder: Callable[[Path], Path]
    runner_options: Callable[[str], dict] | None = None
    fused_target: Target | None = None  # fused graphs are checked against fusion.json, not the manifest
    quantized: bool = False  # int8 graphs: checked against quantization.json, judged by the int8 tolerances


def _plugin_graph_options(dtype: str) -> dict:
    """Plugin nodes run the op's PyTorch reference inside ONNX Runtime (bf16: on the graph's fp32 twin)."""
    from seq2trt.plugins.plugin_cpu import for_cpu, register_reference_ops
    from .runners import emulate_bf16

    prepare = (lambda m: for_cpu(emulate_bf16(m), "fp32")) if dtype == "bf16" else (lambda m: for_cpu(m, dtype))
    return {"prepare": prepare, "custom_op_libraries": (register_reference_ops(),)}


def _fused(target: Target, runner_options: Callable[[str], dict] | None = None) -> GraphSet:
    return GraphSet(lambda out: fused_dir(out, target), runner_options, target)


GRAPH_SETS: dict[str, GraphSet] = {
    "plain": GraphSet(Path),
    "fused-ort": _fused(Target.ORT),
    "fused-trt": _fused(Target.TRT, _plugin_graph_options),
    "int8-ort": GraphSet(quantized_dir, lambda dtype: {"optimization": "extended"}, quantized=True),
}
# --backend name -> runner class taking (graph path, cfg, kind, dtype, limits, **options).
BACKENDS: dict[str, Callable[..., Runner]] = {"ort": OrtRunner}


@dataclass(frozen=True)
class ValidateSettings:
    backend: str = "ort"
    graphs: str = "plain"
    samples: int = 1000
    beam_size: int = 4
    max_new_tokens: int | None = None  # None: the limits' max_tgt_len - 1 (32 for models without a task)
    device: str = "cpu"
    threads: int = 1  # small decoding calls: one thread is fastest and robust on a shared CPU
    seed: int = 0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise InputError(f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if self.graphs not in GRAPH_SETS:
            raise InputError(f"unknown graph set {self.graphs!r}; choose one of {', '.join(GRAPH_SETS)}")
        if self.samples < 0 or self.beam_size < 1:
            raise InputError(f"--samples must be >= 0 and --beam >= 1, got {self.samples} and {self.beam_size}")


def load_reference(manifest: Manifest, checkpoint: Path | None):
    """The eager model the export came from: `checkpoint`, or the one the manifest names (hash-checked)."""
    from seq2trt.reference_model.checkpoint import load_checkpoint, weights_path

    source = manifest.data.get("source") or {}
    path = Path(checkpoint) if checkpoint else (Path(source["checkpoint"]) if source.get("checkpoint") else None)
    if path is None:
        raise InputError(f"{manifest.root} records no source checkpoint; pass --checkpoint")
    model, vocabs = load_checkpoint(path)
    weights = weights_path(path)
    if source.get("weights_sha256") and sha256_file(weights) != source["weights_sha256"]:
        raise CheckpointError(f"{weights} is not the checkpoint {manifest.root} was exported from (sha256 differs); "
                              "pass the right --checkpoint or re-export")
    if model.cfg != manifest.config:
        raise CheckpointError(f"{path}'s config differs from the one recorded in {manifest.root}/manifest.json")
    return model, source.get("task")


def e2e_sources(cfg, task_name: str | None, samples: int, seed: int) -> tuple[list[list[int]], str]:
    """Held-out sources of the checkpoint's task (eos included), or seeded random ids for a model without one."""
    if task_name:
        from seq2trt.reference_model.tasks import get_task

        task = get_task(task_name)
        pairs = task.heldout(samples)
        return [task.source_vocab.encode(s) + [cfg.eos_id] for s, _ in pairs], f"held-out {task_name}"
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, min(16, cfg.max_src_len - 1) + 1, size=samples)
    return [[int(t) for t in rng.integers(3, cfg.src_vocab_size, size=n)] + [cfg.eos_id] for n in lengths], "random ids"


def heldout_exact_match(task_name: str, samples: int) -> tuple[str, Callable[[list[list[int]]], float]]:
    """The task's metric on greedy outputs of its first `samples` held-out sources: exact match of the text."""
    from seq2trt.reference_model.tasks import get_task

    task = get_task(task_name)
    pairs = task.heldout(samples)
    return "held-out exact match", lambda outputs: task.exact_match(outputs, pairs)


def run_validation(out: Path, settings: ValidateSettings, checkpoint: Path | None = None,
                   progress: Callable[[str], None] | None = None) -> dict:
    """Validate `out`, write its reports, and return the parity document; raise CheckFailed when anything fails."""
    out = Path(out)
    graph_set = GRAPH_SETS[settings.graphs]
    manifest = verify(out, [kind.filename for kind in spec.GraphKind])  # every graph set derives from the export
    if graph_set.quantized:
        verify_quantized(out, manifest)
    elif graph_set.fused_target:
        verify_fused(out, graph_set.fused_target, manifest)
    cfg, dtype, limits = manifest.config, manifest.dtype, manifest.limits
    if settings.max_new_tokens is not None and not 1 <= settings.max_new_tokens <= limits.max_tgt_len - 1:
        raise InputError(f"--max-new-tokens {settings.max_new_tokens} is outside [1, {limits.max_tgt_len - 1}] (the "
                         f"export's max_tgt_len {limits.max_tgt_len}, bos included); lower it or re-export with a "
                         "larger --max-tgt-len")
    model, task_name = load_reference(manifest, checkpoint)
    runner = BACKENDS[settings.backend]
    options = {"device": settings.device, "intra_op_threads": settings.threads,
               **(graph_set.runner_options(dtype) if graph_set.runner_options else {})}
    candidates = tuple(runner(graph_set.folder(out) / kind.filename, cfg, kind, dtype, limits, **options)
                       for kind in spec.GraphKind)
    reference = model.double()
    references = tuple(EagerRunner(reference, kind, limits, name="eager-fp64") for kind in spec.GraphKind)
    with contextlib.ExitStack() as stack:  # runners leave in reverse order, restoring thread settings
        for r in candidates + references:
            stack.enter_context(r)
        if progress:
            progress("graph-level parity over the spec sweep")
        precision = "int8" if graph_set.quantized else dtype  # which tolerances and targets judge the graphs
        graphs = graph_parity(candidates, references, spec.sweep(limits), seed=settings.seed, tolerances=precision)
        e2e = None
        if settings.samples:
            sources, origin = e2e_sources(cfg, task_name, settings.samples, settings.seed)
            cap = limits.max_tgt_len - 1 if task_name else min(32, limits.max_tgt_len - 1)
            decode = DecodeSettings(cfg.bos_id, cfg.eos_id, cfg.pad_id, settings.max_new_tokens or cap)
            e2e = end_to_end(RunnerStepModel(*candidates), RunnerStepModel(*references), sources, decode, precision,
                             beam_size=settings.beam_size, batch_size=limits.max_batch, progress=progress,
                             task_metric=heldout_exact_match(task_name, settings.samples) if task_name else None)
    document = parity_document(manifest, settings, graphs, e2e, origin if settings.samples else None)
    write_reports(out, document)
    failures = graphs.failures() + (e2e.failures() if e2e is not None else [])
    if failures:
        raise CheckFailed(f"parity failed for {out} ({len(failures)} failing checks; see "
                          f"{out}/reports/parity.md):\n  " + "\n  ".join(failures))
    return document


def parity_document(manifest: Manifest, settings: ValidateSettings, graphs: GraphParity,
                    e2e: EndToEndResult | None, e2e_origin: str | None) -> dict:
    e2e_doc = None if e2e is None else {**e2e.to_dict(), "inputs": e2e_origin}
    return {
        "passed": bool(graphs) and (e2e is None or bool(e2e)),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "backend": settings.backend, "graphs_set": settings.graphs, "dtype": manifest.dtype,
        "settings": {k: v for k, v in vars(settings).items()},
        "reference": "eager PyTorch, float64",
        "graphs": graphs.summary(),
        "graph_failures": graphs.failures(),
        "cases": len(graphs.cases),
        "end_to_end": e2e_doc,
    }


def _markdown(doc: dict) -> str:
    lines = [f"# Parity: {'PASSED' if doc['passed'] else 'FAILED'}", "",
             f"backend `{doc['backend']}`, graphs `{doc['graphs_set']}`, dtype `{doc['dtype']}`, reference "
             f"{doc['reference']}, {doc['cases']} graph cases", "", "## Graph level (worst case per output)", "",
             "| graph | output | max abs | max rel | mean abs | p99 abs | min cosine | NaN/Inf | atol / rtol | failed |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for graph, outputs in doc["graphs"].items():
        for name, s in outputs.items():
            tol = s["tolerance"]
            lines.append(f"| {graph} | {name} | {s['max_abs']:.3g} | {s['max_rel']:.3g} | {s['mean_abs']:.3g} | "
                         f"{s['p99_abs']:.3g} | {s['min_cosine']:.7f} | {s['nan']}/{s['inf']} | "
                         f"{tol['atol']:g} / {tol['rtol']:g} | {len(s['failed_cases'])}/{s['cases']} |")
    e2e = doc["end_to_end"]
    if e2e:
        lines += ["", f"## End to end ({e2e['samples']} {e2e['inputs']} sources)", "",
                  "| search | token agreement | sequence match | first divergent step |", "|---|---|---|---|"]
        for name in ("greedy", "beam"):
            a = e2e[name]
            lines.append(f"| {name}{'' if name == 'greedy' else ' ' + str(e2e['beam_size'])} | "
                         f"{a['token_agreement']:.6f} | {a['sequence_match']:.6f} | {a['first_divergent_step']} |")
        metric = e2e.get("task_metric")
        if metric:
            lines += ["", f"{metric['name']} (greedy): {metric['candidate']:.4f} on these graphs, "
                          f"{metric['reference']:.4f} for the eager reference (reported, not judged)"]
        t = e2e["targets"]
        lines += ["", f"max_logit_abs_err along the eager greedy path: {e2e['max_logit_abs_err']:.3g} "
                      f"(target <= {t['max_logit_abs_err']:g}); along the eager beam search: "
                      f"{e2e['beam_max_logit_abs_err']:.3g} (reported); targets: token agreement >= "
                      f"{t['token_agreement']}, sequence match >= {t['sequence_match']}"]
    failures = doc["graph_failures"] + ([] if not e2e or e2e["passed"] else ["end to end below target"])
    if failures:
        lines += ["", "## Failures", ""] + [f"- {f}" for f in failures]
    return "\n".join(lines) + "\n"


def write_reports(out: Path, doc: dict) -> None:
    """`parity.json`/`.md` hold the latest run; `parity-<backend>-<graphs>.*` keep each graph set's own."""
    reports = Path(out) / "reports"
    for stem in ("parity", f"parity-{doc['backend']}-{doc['graphs_set']}"):
        atomic_write_text(reports / f"{stem}.json", json.dumps(doc, indent=2) + "\n")
        atomic_write_text(reports / f"{stem}.md", _markdown(doc))
