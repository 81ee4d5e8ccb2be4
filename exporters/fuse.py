"""Fusion: every marked attention block becomes one node for its target, and an audit proves none was missed.

The exporter marks each attention block as one node of domain `spec.MARKED_DOMAIN` (see spec.py), so the
rewrite never depends on matching a pattern of MatMul/Softmax nodes that an exporter upgrade can reshuffle:
- `trt`: the block becomes the seq2trt plugin node (`plugins.op`: op_type PLUGIN_NAME, domain DOMAIN,
  `plugin_version` / `plugin_namespace` and the op's attributes), which TensorRT's ONNX parser resolves to
  the registered plugin;
- `ort`: the block becomes `com.microsoft.MultiHeadAttention`, which ONNX Runtime runs natively, and the folds
  only ONNX Runtime's graphs want follow (`fuse_ort`).
Then constants are folded and dead nodes, unused local functions and their opset imports removed (onnxscript's
optimizer); for ORT, T5's residual add + RMSNorm and tanh GELU chains then become single contrib nodes, counted in
the audit's `folded`, with the decoder's attention scales moved onto the queries (`fuse_ort.fold_attention_scale`).

The audit counts the blocks the model's config implies (`spec.expected_blocks`), not the ones found, and names
every expected block that is not fused. `fuse_artifacts` writes the fused graphs with fusion.json; `verify_fused`
checks them before a later stage reads them (`artifact_checks`).
"""

from __future__ import annotations

import enum
import json
import logging
from typing import Callable
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import onnx
from onnx import helper

from seq2trt.plugins.op import DOMAIN, PLUGIN_NAME, AttentionAttrs, attrs_from_node
from seq2trt.reference_model.config import Seq2SeqConfig
from seq2trt.core.errors import ArtifactError, CheckFailed, InputError, Seq2TrtError
from seq2trt.core.atomic_files import atomic_write_text
from seq2trt.core.swap import staged_directory

from seq2trt.exporters import graph_files, spec
from seq2trt.core import layout
from seq2trt.core.layout import FUSION_JSON
from seq2trt.exporters.artifact_checks import check_derived_graphs, load_graph
from seq2trt.exporters.fold_elementwise import fold_norms_and_activations
from seq2trt.exporters.fuse_ort import (MS_DOMAIN, fold_attention_scale, fold_constant_transposes,
                                        fold_projections_into_attention, ort_nodes)
from seq2trt.exporters.manifest import Manifest, verify

logger = logging.getLogger(__name__)


class Target(enum.Enum):
    TRT = "trt"
    ORT = "ort"


@dataclass
class GraphAudit:
    graph: str
    expected: dict[str, int]
    fused: dict[str, int]
    unfused_blocks: list[str]
    nodes_before: int
    nodes_after: int
    folded: dict[str, int] = field(default_factory=dict)  # ORT: chains made one node, scales moved (fuse_ort)

    @property
    def complete(self) -> bool:
        return not self.unfused_blocks and self.fused == self.expected


@dataclass
class FusionAudit:
    target: str
    graphs: list[GraphAudit] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return all(g.complete for g in self.graphs)

    def unfused(self) -> list[str]:
        return [f"{g.graph}:{name}" for g in self.graphs for name in g.unfused_blocks]

    def to_dict(self) -> dict:
        return {"target": self.target, "complete": self.complete,
                "graphs": {g.graph: {k: v for k, v in asdict(g).items() if k != "graph"} | {"complete": g.complete}
                           for g in self.graphs}}


def _plugin_node(node: onnx.NodeProto, attrs: AttentionAttrs, biases: dict[str, str]) -> list[onnx.NodeProto]:
    """The plugin node takes the marked node's inputs as they are (`plugins.op.pack_inputs`' order, a position
    bias last)."""
    return [helper.make_node(PLUGIN_NAME, list(node.input), list(node.output), name=node.name, domain=DOMAIN,
                             **attrs.onnx_attributes())]


REWRITES = {Target.TRT: (_plugin_node, DOMAIN), Target.ORT: (ort_nodes, MS_DOMAIN)}


def fuse(model: onnx.ModelProto, target: Target, cfg: Seq2SeqConfig, kind: spec.GraphKind,
         base_dir: Path | None = None) -> tuple[onnx.ModelProto, GraphAudit]:
    """Rewrite every marked attention block of `model` for `target`; returns the new model and its audit.
    `base_dir`: the folder of `model`'s external data when it was loaded as structure (`graph_files`); its weights
    are then read one at a time where a fold needs a value and never all held."""
    import onnx.inliner

    rewrite, domain = REWRITES[target]
    nodes_before = len(onnx.inliner.inline_local_functions(model).graph.node)  # attention bodies counted
    fused = onnx.ModelProto()
    fused.CopyFrom(model)
    found: Counter = Counter()
    names, biases = [], {}
    del fused.graph.node[:]
    for node in model.graph.node:
        if node.domain != spec.MARKED_DOMAIN:
            fused.graph.node.append(node)
            continue
        attrs = attrs_from_node(node)
        nodes = rewrite(node, attrs, biases)  # the block's node last, after any nodes computing its inputs
        found[attrs.kind.name] += 1
        names.append(nodes[-1].name)
        fused.graph.node.extend(nodes)
    if found:
        fused.opset_import.append(helper.make_opsetid(domain, 1))
    if target is Target.ORT:
        fold_projections_into_attention(fused, base_dir)
        fold_constant_transposes(fused, base_dir)
    fused = _optimize(fused, base_dir)
    if target is Target.ORT:  # the scale: a decoder step's queries are one row (an encoder's are the source)
        scales = fold_attention_scale(fused, base_dir) if kind is spec.GraphKind.DECODER else 0
        folded = {**fold_norms_and_activations(fused), "attention_scale": scales}
    else:
        folded = {}
    expected = spec.expected_blocks(cfg, kind)
    unfused = [spec.block_name(k, i) for k, n in expected.items() for i in range(n)
               if spec.block_name(k, i) not in names]
    audit = GraphAudit(kind.value, {k.name: n for k, n in expected.items()},
                       {k.name: found.get(k.name, 0) for k in expected}, unfused, nodes_before, len(fused.graph.node),
                       folded)
    logger.debug("fused %s for %s: %s of %s blocks, %d -> %d nodes", kind.value, target.value, audit.fused,
                audit.expected, nodes_before, audit.nodes_after)
    return fused, audit




def _optimize(model: onnx.ModelProto, base_dir: Path | None) -> onnx.ModelProto:
    """onnxscript's optimizer (constant folding, dead code, unused functions) on the IR, its external tensors read
    from `base_dir` should it fold one; they stay references in the result."""
    import onnx_ir as ir
    import onnxscript.optimizer

    if base_dir is None or not graph_files.external_ranges(model):
        return onnxscript.optimizer.optimize(model)
    ir_model = ir.serde.deserialize_model(model)
    ir.external_data.set_base_dir(ir_model.graph, str(base_dir))
    onnxscript.optimizer.optimize(ir_model)
    return ir.serde.serialize_model(ir_model)


def fused_dir(out: Path, target: Target) -> Path:
    return layout.fused_dir(out, target.value)


def fuse_artifacts(out: Path, target: Target, allow_partial: bool = False, force: bool = False,
                   progress: Callable[[str], None] = logger.info) -> FusionAudit:
    """Fuse both graphs of the export in `out` into `out/fused/<target>/`, with `fusion.json`.

    Verifies the manifest hashes of the graphs it reads; an incomplete fusion raises `CheckFailed` naming the
    unfused blocks (and writes nothing) unless `allow_partial`. Plugin graphs of a head_dim the kernels do not take
    are refused (`InputError`, nothing written): they would validate on CPU and then fail at build.
    """
    manifest = verify(out, [kind.filename for kind in spec.GraphKind])
    if target is Target.TRT:
        from seq2trt.plugins.kernels.launch_plan import kernel_head_dim_problem

        if problem := kernel_head_dim_problem(manifest.config.head_dim, out):
            raise InputError(f"cannot fuse for TensorRT: {problem}")
    audit = FusionAudit(target.value)
    with staged_directory(fused_dir(out, target), force, f"fused {target.value}", kind=FUSION_JSON) as tmp:
        files = {}
        for kind in spec.GraphKind:
            progress(f"fusing the {kind.value} graph for {target.value}")
            model, graph_audit = _fuse_file(manifest.path(kind.filename), target, manifest, kind)
            audit.graphs.append(graph_audit)
            progress(f"writing the fused {kind.value} graph ({sum(graph_audit.fused.values())} of "
                     f"{sum(graph_audit.expected.values())} attention blocks fused)")
            graph_files.save_graph(model, tmp / kind.filename, base_dir=manifest.root)
            del model
            files.update(graph_files.file_records(
                tmp / kind.filename, source_sha256=graph_files.graph_sha256(manifest.data["files"], kind.filename)))
        if not audit.complete and not allow_partial:
            raise CheckFailed(f"fusion for {target.value} is incomplete: {len(audit.unfused())} attention block(s) "
                              f"not fused: {', '.join(audit.unfused())}; re-export with this seq2trt version "
                              "(blocks are marked at export), or pass --allow-partial for experiments")
        report = audit.to_dict() | {"allow_partial": allow_partial, "files": files}
        atomic_write_text(tmp / FUSION_JSON, json.dumps(report, indent=2) + "\n")
    return audit


def _fuse_file(path: Path, target: Target, manifest: Manifest,
               kind: spec.GraphKind) -> tuple[onnx.ModelProto, GraphAudit]:
    model = load_graph(path, manifest.config, kind, manifest.dtype)
    try:
        return fuse(model, target, manifest.config, kind, base_dir=path.parent)
    except Seq2TrtError:
        raise
    except Exception as exc:  # the optimizer or an attention node's attributes choke on a damaged graph
        raise ArtifactError(f"cannot fuse {path} ({type(exc).__name__}: {exc}); the graph is damaged: re-export "
                            "with `seq2trt export --force`") from exc


def verify_fused(out: Path, target: Target, manifest: Manifest | None = None) -> dict:
    """Check the fused graphs against `fusion.json`, and that they were fused from the current export (`manifest`:
    the export's, already verified with both graphs by the caller; else verified here)."""
    if manifest is None:
        manifest = verify(out, [kind.filename for kind in spec.GraphKind])
    sources = {kind.filename: graph_files.graph_sha256(manifest.data["files"], kind.filename) for kind in spec.GraphKind}
    return check_derived_graphs(fused_dir(out, target), FUSION_JSON, sources, "fusion", "fused from an older export",
                                f"seq2trt fuse {out} --target {target.value}")


