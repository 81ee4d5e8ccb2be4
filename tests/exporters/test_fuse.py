"""Fusion: every attention block becomes one node for each target, the audit counts them against the config,
and the fused graphs compute what the eager model computes (float64 reference)."""

from __future__ import annotations

import json
import math

import numpy as np
import onnx
import onnx.inliner
import onnxruntime as ort
import pytest
import torch

from seq2trt.exporters import spec
from seq2trt.exporters.fuse import FUSION_JSON, Target, fuse, fuse_artifacts, fused_dir, verify_fused
from seq2trt.exporters.manifest import read_manifest, write_manifest
from seq2trt.exporters.onnx_export import export
from seq2trt.plugins.op import DOMAIN, PLUGIN_NAME, PLUGIN_NAMESPACE, PLUGIN_VERSION, AttentionAttrs, AttentionKind
from seq2trt.plugins.plugin_cpu import for_cpu, register_reference_ops
from seq2trt.core.errors import ArtifactError, CheckFailed
from seq2trt.reference_model.sources import ordinary_ids
from seq2trt.validation.precision import RMS_FACTOR, TWIN, UNIT_ROUNDOFF, fp32_twin, peer_model, rounded_model
from seq2trt.runtime.runners import emulate_bf16

PRESET_OVERRIDES = {"post-ln": {}, "pre-ln-gelu": {"pre_norm": True, "activation": "gelu"}}


@pytest.fixture(scope="module", params=[("fp32", "post-ln"), ("fp16", "post-ln"), ("bf16", "pre-ln-gelu"),
                                        ("fp32", "pre-ln-gelu")], ids=lambda p: "-".join(p))
def artifacts(request, make_model, tmp_path_factory):
    dtype, variant = request.param
    model = make_model(seed=3, dtype=torch.float32, **PRESET_OVERRIDES[variant])
    out = export(model, tmp_path_factory.mktemp("export") / "out", dtype=dtype)
    for target in Target:
        fuse_artifacts(out, target)
    return model.double(), out, dtype


def feeds(cfg, rng, batch=3, src=7, tgt=2, past=5):
    mask = np.ones((batch, src), np.int64)
    mask[1, 4:] = 0
    mask[2, 2:] = 0
    src_ids, tgt_ids = ordinary_ids(cfg, cfg.src_vocab_size), ordinary_ids(cfg, cfg.tgt_vocab_size)
    enc = {"input_ids": src_ids[rng.randint(0, src_ids.size, (batch, src))].astype(np.int64), "attention_mask": mask}
    dec = {"input_ids": tgt_ids[rng.randint(0, tgt_ids.size, (batch, tgt))].astype(np.int64),
           "encoder_attention_mask": mask}
    for s in spec.inputs(cfg, spec.GraphKind.DECODER)[2:]:
        length = src if spec.parse_kv_name(s.name).side == "encoder" else past
        dec[s.name] = rng.randn(batch, cfg.num_heads, length, cfg.head_dim)
    return {spec.GraphKind.ENCODER: enc, spec.GraphKind.DECODER: dec}


def eager_outputs(model, kind, feed):
    dtype = next(model.parameters()).dtype
    t = {k: torch.as_tensor(v) if v.dtype == np.int64 else torch.as_tensor(v).to(dtype) for k, v in feed.items()}
    with torch.no_grad():
        if kind is spec.GraphKind.ENCODER:
            hidden = model.encode(t["input_ids"], t["attention_mask"])
            return [hidden] + [x for kv in model.cross_kv(hidden) for x in kv]
        kv = lambda side: [(t[spec.kv_name(i, side, "key", "past")], t[spec.kv_name(i, side, "value", "past")])
                           for i in range(model.cfg.num_decoder_layers)]
        logits, present = model.decode_step(t["input_ids"], t["encoder_attention_mask"], kv("encoder"), kv("decoder"))
        return [logits] + [x for pair in present for x in pair]


def run_graph(path, feed, dtype, plugin=False, twin=False):
    """ONNX Runtime CPU; bf16 graphs run as their fp32 twin with bf16 rounding (the OrtRunner's emulation);
    `twin`: the graph's exact fp32 twin (validation/precision.py), fed the dtype's values as float32."""
    rounded = {k: v if v.dtype == np.int64 else v.astype(spec.numpy_dtype(dtype)) for k, v in feed.items()}
    np_dtype = np.float32 if dtype == "bf16" or twin else spec.numpy_dtype(dtype)
    feed = {k: v if v.dtype == np.int64 else v.astype(np_dtype) for k, v in rounded.items()}
    options = ort.SessionOptions()
    data = path.read_bytes()
    if twin:
        data = fp32_twin(data)
    elif dtype == "bf16":
        data = emulate_bf16(data)
    if plugin:
        options.register_custom_ops_library(register_reference_ops())
        data = for_cpu(data, "fp32" if dtype == "bf16" or twin else dtype)
    session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    return [o.astype(np.float64) for o in session.run(None, feed)]


def test_every_block_is_fused_and_audited(artifacts):
    model, out, dtype = artifacts
    cfg = model.cfg
    for target in Target:
        report = json.loads((fused_dir(out, target) / FUSION_JSON).read_text())
        assert report["complete"]
        assert report["graphs"]["encoder"]["fused"] == {"ENCODER_SELF": cfg.num_encoder_layers}
        assert report["graphs"]["decoder"]["fused"] == {"DECODER_SELF": cfg.num_decoder_layers,
                                                        "CROSS": cfg.num_decoder_layers}
        for kind in spec.GraphKind:
            graph = onnx.load(fused_dir(out, target) / kind.filename)
            assert not [n for n in graph.graph.node if n.domain == spec.MARKED_DOMAIN]
            assert not graph.functions
            assert report["graphs"][kind.value]["nodes_after"] == len(graph.graph.node)
            assert report["graphs"][kind.value]["nodes_before"] > len(graph.graph.node)
        verify_fused(out, target)
    for kind, blocks in ((spec.GraphKind.ENCODER, cfg.num_encoder_layers), (spec.GraphKind.DECODER, cfg.num_decoder_layers)):
        graph = onnx.load(fused_dir(out, Target.ORT) / kind.filename).graph
        packed = [n for n in graph.node if n.op_type == "MatMul" and n.input[1].endswith("packed_qkv.weight")]
        biased = [n for n in graph.node if n.op_type == "MultiHeadAttention" and n.input[3]]
        assert len(packed) == blocks, f"{kind.value}: self-attention q/k/v projections not packed"
        assert len(biased) == sum(spec.expected_blocks(cfg, kind).values()), f"{kind.value}: biases not folded"
        # a decoder's scales moved onto the queries: float32 always, float16/bfloat16 where it is a power of two
        scales = [onnx.helper.get_attribute_value(a) for n in graph.node if n.op_type == "MultiHeadAttention"
                  for a in n.attribute if a.name == "scale"]
        moved = kind is spec.GraphKind.DECODER and (dtype == "fp32" or math.frexp(cfg.head_dim ** -0.5)[0] == 0.5)
        report = json.loads((fused_dir(out, Target.ORT) / FUSION_JSON).read_text())
        assert report["graphs"][kind.value]["folded"]["attention_scale"] == (len(biased) if moved else 0)
        assert scales == pytest.approx([1.0 if moved else cfg.head_dim ** -0.5] * len(biased), rel=1e-7)


def test_plugin_nodes_carry_what_tensorrt_needs(artifacts):
    model, out, _ = artifacts
    graph = onnx.load(fused_dir(out, Target.TRT) / "decoder.onnx")
    plugins = [n for n in graph.graph.node if n.op_type == PLUGIN_NAME]
    assert len(plugins) == 2 * model.cfg.num_decoder_layers
    assert {(o.domain, o.version) for o in graph.opset_import if o.domain == DOMAIN} == {(DOMAIN, 1)}
    for node in plugins:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert node.domain == DOMAIN
        assert attrs["plugin_version"] == PLUGIN_VERSION.encode() and attrs["plugin_namespace"] == PLUGIN_NAMESPACE.encode()
        op = AttentionAttrs.from_onnx(attrs)
        assert (op.num_heads, op.head_dim) == (model.cfg.num_heads, model.cfg.head_dim)
        assert op.scale == pytest.approx(model.cfg.head_dim ** -0.5)
        assert len(node.output) == (3 if op.kind is AttentionKind.DECODER_SELF else 1)


# Relative error ||got - ref|| / ||ref|| (an RMS ratio) of each output against float64. fp32: 1e-5, far above float32
# arithmetic (about 5e-7 here). fp16 / bf16 are judged as validation/precision.py judges them: the graph's exact fp32
# twin against the float64 model holding the same rounded values, at fp32's bound plus one unit roundoff for the
# constants the graph stores in the dtype (structure), and the graph as it runs within RMS_FACTOR times the error of
# the eager model computing in the same dtype (precision).
FP32_BOUND = 1e-5


def rel_error(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def worst_error(model, folder, dtype, plugin) -> tuple[float, str]:
    """The largest error of any output of both graphs in `folder`, as a multiple of its bound (> 1 fails)."""
    worst = (0.0, "")
    rounded = rounded_model(model, dtype) if dtype != "fp32" else None
    peer = peer_model(model, dtype) if dtype != "fp32" else None
    for kind, feed in feeds(model.cfg, np.random.RandomState(0)).items():
        names = [s.name for s in spec.outputs(model.cfg, kind)]
        got = run_graph(folder / kind.filename, feed, dtype, plugin=plugin)
        cast = {k: v if v.dtype == np.int64 else v.astype(spec.numpy_dtype(dtype)).astype(np.float64)
                for k, v in feed.items()}
        want = [r.numpy() for r in eager_outputs(model, kind, cast)]
        if dtype == "fp32":
            for name, a, ref in zip(names, got, want):
                worst = max(worst, (rel_error(a, ref) / FP32_BOUND, f"{kind.value} {name}"))
            continue
        twin = run_graph(folder / kind.filename, feed, dtype, plugin=plugin, twin=True)
        exact = [r.numpy() for r in eager_outputs(rounded, kind, cast)]
        same = [r.float().numpy().astype(np.float64) for r in eager_outputs(peer, kind, cast)]
        for name, a, t, ref, ex, pe in zip(names, got, twin, want, exact, same):
            worst = max(worst, (rel_error(t, ex) / (FP32_BOUND + UNIT_ROUNDOFF[dtype]), f"{kind.value} {name} ({TWIN})"),
                        (rel_error(a, ref) / (RMS_FACTOR * max(rel_error(pe, ref), UNIT_ROUNDOFF[dtype])),
                         f"{kind.value} {name}"))
    return worst


@pytest.mark.parametrize("graphs", ["plain", "fused-ort", "fused-trt"])
def test_graphs_match_eager_float64(artifacts, graphs):
    model, out, dtype = artifacts
    folder = out if graphs == "plain" else fused_dir(out, Target(graphs.split("-")[1]))
    err, where = worst_error(model, folder, dtype, plugin=graphs == "fused-trt")
    assert err <= 1, f"{graphs} {where}: {err:.3g} times its bound"


@pytest.mark.parametrize("target", list(Target))
def test_fused_graphs_catch_a_fault(artifacts, fault, target, tmp_path):
    """Negative controls: a fault planted in the export (before fusing, as an exporter bug would be) must put the
    fused graphs of every target outside their bounds, in every dtype."""
    import shutil

    model, out, dtype = artifacts
    name, filename, plant = fault
    broken = tmp_path / "out"
    shutil.copytree(out, broken, ignore=shutil.ignore_patterns("fused"))
    proto = onnx.load(broken / filename)
    plant(proto, model.cfg)
    onnx.save(proto, broken / filename)
    manifest = read_manifest(broken)
    write_manifest(broken, manifest.config, manifest.data["settings"], list(manifest.data["files"]),
                   source=manifest.data.get("source"))
    fuse_artifacts(broken, target)
    err, where = worst_error(model, fused_dir(broken, target), dtype, plugin=target is Target.TRT)
    assert err > 1, f"{name} passed ({where}: {err:.3g} times its bound)"


def test_fused_equals_unfused(artifacts):
    """The fused graphs compute what the plain ones do: their fp32 twins (the graphs themselves for fp32) agree to
    float32 arithmetic."""
    model, out, dtype = artifacts
    rng = np.random.RandomState(1)
    twin = dtype != "fp32"
    for kind, feed in feeds(model.cfg, rng).items():
        plain = run_graph(out / kind.filename, feed, dtype, twin=twin)
        for target in Target:
            fused = run_graph(fused_dir(out, target) / kind.filename, feed, dtype, plugin=target is Target.TRT,
                              twin=twin)
            for a, b in zip(plain, fused):
                assert rel_error(b, a) <= FP32_BOUND, (target, kind, rel_error(b, a))


def _unmark(out, kind_to_unmark):
    """Inline one kind's marked blocks into standard ops (as if the exporter had not marked them)."""
    path = out / "decoder.onnx"
    model = onnx.load(path)
    model = onnx.inliner.inline_selected_functions(model, [(spec.MARKED_DOMAIN, spec.MARKED_OP_TYPES[kind_to_unmark])])
    onnx.save(model, path)
    manifest = read_manifest(out)
    write_manifest(out, manifest.config, manifest.data["settings"], list(manifest.data["files"]),
                   source=manifest.data.get("source"))


def test_partial_fusion_fails_and_names_the_blocks(make_model, tmp_path):
    model = make_model(seed=1, dtype=torch.float32)
    out = export(model, tmp_path / "out")
    _unmark(out, AttentionKind.CROSS)
    with pytest.raises(CheckFailed, match=r"decoder:decoder_layers\.0\.cross_attn, decoder:decoder_layers\.1\.cross_attn"):
        fuse_artifacts(out, Target.TRT)
    assert not (out / "fused" / "trt").exists()
    audit = fuse_artifacts(out, Target.TRT, allow_partial=True)
    assert not audit.complete and audit.graphs[1].fused == {"DECODER_SELF": 2, "CROSS": 0}


def test_tampered_export_and_fused_graphs_are_refused(make_model, tmp_path):
    model = make_model(seed=2, dtype=torch.float32)
    out = export(model, tmp_path / "out")
    fuse_artifacts(out, Target.ORT)
    with open(fused_dir(out, Target.ORT) / "encoder.onnx", "ab") as f:
        f.write(b"\0")
    with pytest.raises(ArtifactError, match="encoder.onnx does not match its sha256"):
        verify_fused(out, Target.ORT)
    with pytest.raises(ArtifactError, match="--force"):
        fuse_artifacts(out, Target.ORT)
    with open(out / "decoder.onnx", "ab") as f:
        f.write(b"\0")
    with pytest.raises(ArtifactError, match="decoder.onnx does not match its sha256"):
        fuse_artifacts(out, Target.TRT)


def test_fuse_on_a_graph_without_markers_reports_all_blocks(make_model, tmp_path):
    model = make_model(seed=4, dtype=torch.float32)
    out = export(model, tmp_path / "out")
    plain = onnx.inliner.inline_local_functions(onnx.load(out / "encoder.onnx"))
    _, audit = fuse(plain, Target.ORT, model.cfg, spec.GraphKind.ENCODER)
    assert audit.unfused_blocks == ["encoder_layers.0.self_attn", "encoder_layers.1.self_attn"]
