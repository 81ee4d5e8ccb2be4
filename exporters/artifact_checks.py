"""Checks every stage runs on the graphs it reads: a graph file against the graph contract (`load_graph`), and the
graphs a stage derived from others against that stage's record (`check_derived_graphs`: fuse's fusion.json,
quantize's quantization.json).
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx

from seq2trt.plugins.op import DOMAIN, attrs_from_node
from seq2trt.reference_model.config import Seq2SeqConfig
from seq2trt.core.errors import ArtifactError, first_line

from seq2trt.exporters import graph_files, spec


def load_graph(path: Path, cfg: Seq2SeqConfig, kind: spec.GraphKind, dtype: str) -> onnx.ModelProto:
    """Parse and check a graph of the contract: a corrupt file, another model's graph, inputs or outputs of the
    wrong type (`dtype`: the export's), attention nodes sized for another model or a missing or short data file are
    an ArtifactError. The graph comes as structure: external tensors stay references (`graph_files`).
    TensorRT's parser can crash the process on such graphs instead of failing."""
    fix = "re-export with `seq2trt export --force` (and re-fuse)"
    try:
        model = graph_files.load_structure(path, fix)
        if graph_files.external_ranges(model):
            graph_files.check_model_file(path)  # the checker on the path: it reads the data file's references
        else:
            onnx.checker.check_model(model)
    except ArtifactError:
        raise
    except Exception as exc:  # protobuf's DecodeError, onnx's ValidationError, ...: the file is not a valid model
        first = first_line(exc)
        raise ArtifactError(f"{path} is not a valid ONNX model ({first}); {fix}") from exc
    problems = []
    for io, want, have in (("inputs", spec.inputs(cfg, kind), model.graph.input),
                           ("outputs", spec.outputs(cfg, kind), model.graph.output)):
        if [s.name for s in want] != [v.name for v in have]:
            raise ArtifactError(f"{path} is not a seq2trt {kind.value} graph of this model: its {io} "
                                f"{[v.name for v in have][:6]} differ from the contract's "
                                f"{[s.name for s in want][:6]}; {fix}")
        for s, v in zip(want, have):
            elem = onnx.TensorProto.INT64 if s.dtype == "int64" else spec.DTYPES[dtype][1]
            if v.type.tensor_type.elem_type != elem:
                problems.append(f"{s.name} has ONNX type {v.type.tensor_type.elem_type}, the contract's is {elem}")
    for node in model.graph.node:
        if node.domain in (DOMAIN, spec.MARKED_DOMAIN):
            try:
                attrs = attrs_from_node(node)
            except (KeyError, ValueError, TypeError) as exc:
                problems.append(f"attention node {node.name} has unusable attributes ({exc!r})")
                continue
            if (attrs.num_heads, attrs.head_dim) != (cfg.num_heads, cfg.head_dim):
                problems.append(f"attention node {node.name} has {attrs.num_heads} heads of {attrs.head_dim}, the "
                                f"model {cfg.num_heads} of {cfg.head_dim}")
    if problems:
        raise ArtifactError(f"{path} breaks the graph contract: {'; '.join(problems)}; {fix}")
    return model


def check_derived_graphs(folder: Path, record: str, sources: dict[str, str], stage: str, stale: str,
                         command: str) -> dict:
    """Check graphs a stage derived from others (fuse from the export, quantize from the fused graphs) against the
    stage's record in `folder`: each file's sha256, and that it was made from the file whose sha256 `sources`
    holds now. Returns the record; anything missing, modified, stale or malformed is an ArtifactError naming
    `command` (the stage's CLI call) as the fix."""
    path = folder / record
    if not path.exists():
        raise ArtifactError(f"{path} not found; run `{command}` first")
    try:
        report = json.loads(path.read_text())
        files = report["files"]
        if not isinstance(files, dict) or not all(isinstance(e, dict) for e in files.values()):
            raise TypeError("'files' must map each graph to an object")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise ArtifactError(f"{path} is malformed ({exc!r}); re-run `{command} --force`") from None
    problems = []
    for name, source_sha256 in sources.items():
        entry, graph = files.get(name), folder / name
        if entry is None or not graph.is_file():
            problems.append(f"{name} is missing")
        elif found := graph_files.record_problems(folder, files, name, record, stage):
            problems += found
        elif entry.get("source_sha256") != source_sha256:
            problems.append(f"{name} was {stale}")
    if problems:
        raise ArtifactError(f"{folder} failed its check: " + "; ".join(problems) + f"; re-run `{command} --force`")
    return report
