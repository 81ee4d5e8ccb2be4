"""Fusion: every marked attention block becomes one node for its target, and an audit proves none was missed.

The exporter marks each attention block as one node of domain `spec.MARKED_DOMAIN` (see spec.py), so the
rewrite never depends on matching a pattern of MatMul/Softmax nodes that an exporter upgrade can reshuffle:
- `trt`: the block becomes the seq2trt plugin node (`plugins.op`: op_type PLUGIN_NAME, domain DOMAIN,
  `plugin_version` / `plugin_namespace` and the op's attributes), which TensorRT's ONNX parser resolves to
  the registered plugin;
- `ort`: the block becomes `com.microsoft.MultiHeadAttention`, which ONNX Runtime runs natively (with the past
  K/V and `unidirectional` for decoder self-attention, BNSH cross K/V and a key padding mask otherwise).
Then constants are folded and dead nodes, unused local functions and their opset imports removed (onnxscript's
optimizer).

The audit counts the blocks the model's config implies (`spec.expected_blocks`), not the ones found, and names
every expected block that is not fused.
"""

from __future__ import annotations

import enum
import json
import logging
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import onnx
from onnx import helper

from seq2trt.plugins.op import DOMAIN, PLUGIN_NAME, AttentionAttrs, AttentionKind
from seq2trt.reference_model.config import Seq2SeqConfig
from seq2trt.reference_model.errors import ArtifactError, CheckFailed, Seq2TrtError
from seq2trt.reference_model.io import atomic_write_text, sha256_file, staged_directory

from . import spec
from .manifest import Manifest, verify

logger = logging.getLogger(__name__)

MS_DOMAIN = "com.microsoft"


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


def _attributes(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _plugin_node(node: onnx.NodeProto, attrs: AttentionAttrs) -> onnx.NodeProto:
    return helper.make_node(PLUGIN_NAME, list(node.input), list(node.output), name=node.name, domain=DOMAIN,
                            **attrs.onnx_attributes())


def _ort_node(node: onnx.NodeProto, attrs: AttentionAttrs) -> onnx.NodeProto:
    """com.microsoft.MultiHeadAttention inputs: query, key, value, bias, key_padding_mask, attention_bias,
    past_key, past_value; the op's inputs map onto them by kind."""
    inputs = list(node.input)
    if attrs.kind is AttentionKind.DECODER_SELF:
        q, k, v, past_k, past_v = inputs
        ms_inputs, extra = [q, k, v, "", "", "", past_k, past_v], {"unidirectional": 1}
    else:
        q, k, v, mask = inputs
        ms_inputs, extra = [q, k, v, "", mask], {}
    return helper.make_node("MultiHeadAttention", ms_inputs, list(node.output), name=node.name, domain=MS_DOMAIN,
                            num_heads=attrs.num_heads, scale=attrs.scale, **extra)


REWRITES = {Target.TRT: (_plugin_node, DOMAIN), Target.ORT: (_ort_node, MS_DOMAIN)}


def _linear(name: str, producers: dict, weights: dict) -> tuple[str, str, str] | None:
    """(activation, weight, bias) when `name` is Add(MatMul(x, W), b) with W (D_in, D_out) and b initializers."""
    add = producers.get(name)
    if add is None or add.op_type != "Add":
        return None
    for matmul_out, bias in (add.input, add.input[::-1]):
        matmul = producers.get(matmul_out)
        if bias in weights and matmul is not None and matmul.op_type == "MatMul" and matmul.input[1] in weights:
            return matmul.input[0], matmul.input[1], bias
    return None


def fold_projections_into_attention(model: onnx.ModelProto) -> int:
    """ORT target: move the input projections' work into MultiHeadAttention where it is cheaper for a one-token step.

    Self-attention: the q/k/v projections of one input become one MatMul (x @ [Wq | Wk | Wv]) and a Split, their
    biases MultiHeadAttention's `bias` input — 2 GEMMs and 3 Adds fewer per block. Cross-attention: the query
    bias moves into `bias` (zero for the precomputed K/V) — 1 Add fewer. Returns how many blocks changed; the old
    nodes die in the optimizer's dead-code pass.
    """
    from onnx import numpy_helper

    import numpy as np

    graph = model.graph
    producers = {out: n for n in graph.node for out in n.output}
    weights = {i.name: i for i in graph.initializer}
    changed, nodes = 0, []
    for node in graph.node:
        unbiased_mha = node.op_type == "MultiHeadAttention" and node.domain == MS_DOMAIN and node.input[3] == ""
        parts = [_linear(name, producers, weights) for name in node.input[:3]] if unbiased_mha else [None] * 3
        if parts[0] is None:
            nodes.append(node)
            continue
        prefix = f"{node.name}.packed_qkv"
        if None not in parts and len({x for x, _, _ in parts}) == 1:  # self-attention: pack q, k, v
            w = np.concatenate([numpy_helper.to_array(weights[p[1]]) for p in parts], axis=1)  # (D, 3D)
            b = np.concatenate([numpy_helper.to_array(weights[p[2]]) for p in parts])  # (3D,)
            graph.initializer.extend([
                numpy_helper.from_array(w, f"{prefix}.weight"),
                numpy_helper.from_array(np.array([w.shape[1] // 3] * 3, np.int64), f"{prefix}.split")])
            q, k, v = (f"{prefix}.{part}" for part in "qkv")
            nodes += [helper.make_node("MatMul", [parts[0][0], f"{prefix}.weight"], [f"{prefix}.out"],
                                       name=f"{prefix}.matmul"),
                      helper.make_node("Split", [f"{prefix}.out", f"{prefix}.split"], [q, k, v], axis=-1,
                                       name=f"{prefix}.split")]
            node.input[0], node.input[1], node.input[2] = q, k, v
        elif parts[1] is None and parts[2] is None:  # cross-attention: only the query is projected here
            bias = numpy_helper.to_array(weights[parts[0][2]])
            b = np.concatenate([bias, np.zeros_like(bias), np.zeros_like(bias)])
            node.input[0] = producers[node.input[0]].input[0] if producers[node.input[0]].input[1] == parts[0][2] \
                else producers[node.input[0]].input[1]  # the MatMul's output, the Add's other input
        else:
            nodes.append(node)
            continue
        graph.initializer.append(numpy_helper.from_array(b, f"{node.name}.bias"))
        node.input[3] = f"{node.name}.bias"
        nodes.append(node)
        changed += 1
    del graph.node[:]
    graph.node.extend(nodes)
    return changed


def fold_constant_transposes(model: onnx.ModelProto) -> int:
    """ORT target: a Transpose of a weight becomes a transposed weight.

    The tied output projection is exported as MatMul(h, Transpose(embedding)) — the embedding stays shared with
    the Gather — and onnxscript's optimizer leaves that Transpose alone. ONNX Runtime folds it at load time
    anyway (the same extra copy), but only an initializer second input lets `seq2trt quantize` make the MatMul
    int8: for the `base` preset that projection is 40% of the decoder's weight bytes. Returns how many folded.
    """
    from onnx import numpy_helper

    import numpy as np

    weights = {i.name: i for i in model.graph.initializer}
    folded = 0
    for node in model.graph.node:
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx") or node.input[0] not in weights:
            continue
        array = numpy_helper.to_array(weights[node.input[0]])
        perm = _attributes(node).get("perm") or list(range(array.ndim))[::-1]
        model.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(array.transpose(perm)),
                                                               f"{node.input[0]}.transposed"))
        node.op_type, node.input[0] = "Identity", f"{node.input[0]}.transposed"
        del node.attribute[:]
        folded += 1
    return folded


def fuse(model: onnx.ModelProto, target: Target, cfg: Seq2SeqConfig,
         kind: spec.GraphKind) -> tuple[onnx.ModelProto, GraphAudit]:
    """Rewrite every marked attention block of `model` for `target`; returns the new model and its audit."""
    import onnx.inliner
    import onnxscript.optimizer

    rewrite, domain = REWRITES[target]
    nodes_before = len(onnx.inliner.inline_local_functions(model).graph.node)  # attention bodies counted
    fused = onnx.ModelProto()
    fused.CopyFrom(model)
    found: Counter = Counter()
    names = []
    del fused.graph.node[:]
    for node in model.graph.node:
        if node.domain == spec.MARKED_DOMAIN:
            attrs = AttentionAttrs.from_onnx(_attributes(node))
            node = rewrite(node, attrs)
            found[attrs.kind.name] += 1
            names.append(node.name)
        fused.graph.node.append(node)
    if found:
        fused.opset_import.append(helper.make_opsetid(domain, 1))
    if target is Target.ORT:
        fold_projections_into_attention(fused)
        fold_constant_transposes(fused)
    fused = onnxscript.optimizer.optimize(fused)
    expected = spec.expected_blocks(cfg, kind)
    unfused = [spec.block_name(k, i) for k, n in expected.items() for i in range(n)
               if spec.block_name(k, i) not in names]
    audit = GraphAudit(kind.value, {k.name: n for k, n in expected.items()},
                       {k.name: found.get(k.name, 0) for k in expected}, unfused, nodes_before, len(fused.graph.node))
    logger.debug("fused %s for %s: %s of %s blocks, %d -> %d nodes", kind.value, target.value, audit.fused,
                audit.expected, nodes_before, audit.nodes_after)
    return fused, audit


FUSION_JSON = "fusion.json"


def fused_dir(out: Path, target: Target) -> Path:
    return Path(out) / "fused" / target.value


def fuse_artifacts(out: Path, target: Target, allow_partial: bool = False, force: bool = False) -> FusionAudit:
    """Fuse both graphs of the export in `out` into `out/fused/<target>/`, with `fusion.json`.

    Verifies the manifest hashes of the graphs it reads; an incomplete fusion raises `CheckFailed` naming the
    unfused blocks (and writes nothing) unless `allow_partial`.
    """
    manifest = verify(out, [kind.filename for kind in spec.GraphKind])
    audit = FusionAudit(target.value)
    with staged_directory(fused_dir(out, target), force, f"fused {target.value}") as tmp:
        files = {}
        for kind in spec.GraphKind:
            model, graph_audit = _fuse_file(manifest.path(kind.filename), target, manifest, kind)
            audit.graphs.append(graph_audit)
            onnx.save(model, tmp / kind.filename)
            files[kind.filename] = {"sha256": sha256_file(tmp / kind.filename),
                                    "source_sha256": manifest.data["files"][kind.filename]["sha256"]}
        if not audit.complete and not allow_partial:
            raise CheckFailed(f"fusion for {target.value} is incomplete: {len(audit.unfused())} attention block(s) "
                              f"not fused: {', '.join(audit.unfused())}; re-export with this seq2trt version "
                              "(blocks are marked at export), or pass --allow-partial for experiments")
        report = audit.to_dict() | {"allow_partial": allow_partial, "files": files}
        atomic_write_text(tmp / FUSION_JSON, json.dumps(report, indent=2) + "\n")
    return audit


def load_graph(path: Path, cfg: Seq2SeqConfig, kind: spec.GraphKind, dtype: str) -> onnx.ModelProto:
    """Parse and check a graph of the contract: a corrupt file, another model's graph, inputs or outputs of the
    wrong type (`dtype`: the export's) or attention nodes sized for another model are an ArtifactError.
    TensorRT's parser can crash the process on such graphs instead of failing."""
    fix = "re-export with `seq2trt export --force` (and re-fuse)"
    try:
        model = onnx.load(str(path))
        onnx.checker.check_model(model)
    except Exception as exc:  # protobuf's DecodeError, onnx's ValidationError, ...: the file is not a valid model
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
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
                attrs = AttentionAttrs.from_onnx(_attributes(node))
            except (KeyError, ValueError, TypeError) as exc:
                problems.append(f"attention node {node.name} has unusable attributes ({exc!r})")
                continue
            if (attrs.num_heads, attrs.head_dim) != (cfg.num_heads, cfg.head_dim):
                problems.append(f"attention node {node.name} has {attrs.num_heads} heads of {attrs.head_dim}, the "
                                f"model {cfg.num_heads} of {cfg.head_dim}")
    if problems:
        raise ArtifactError(f"{path} breaks the graph contract: {'; '.join(problems)}; {fix}")
    return model


def _fuse_file(path: Path, target: Target, manifest: Manifest,
               kind: spec.GraphKind) -> tuple[onnx.ModelProto, GraphAudit]:
    model = load_graph(path, manifest.config, kind, manifest.dtype)
    try:
        return fuse(model, target, manifest.config, kind)
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
    sources = {kind.filename: manifest.data["files"][kind.filename]["sha256"] for kind in spec.GraphKind}
    return check_derived_graphs(fused_dir(out, target), FUSION_JSON, sources, "fusion", "fused from an older export",
                                f"seq2trt fuse {out} --target {target.value}")


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
        elif sha256_file(graph) != entry.get("sha256"):
            problems.append(f"{name} does not match its sha256 in {record} (modified since {stage})")
        elif entry.get("source_sha256") != source_sha256:
            problems.append(f"{name} was {stale}")
    if problems:
        raise ArtifactError(f"{folder} failed its check: " + "; ".join(problems) + f"; re-run `{command} --force`")
    return report
