"""T5-style models (config-built, random) through export, fusion, int8 and generate.onnx, judged by the float64 eager
model: T5 v1.1 (gated tanh-GELU FFN, tied embeddings with the logits rescale, one relative bias table shared by a
stack) and UMT5 (relu here, untied, a table in every layer), both with heads x d_kv != d_model, bias-free
projections, RMSNorm and no attention scaling. Buckets saturate at max_distance 12 while the sweep reaches 32
positions, so sources and pasts longer than max_distance and padded batches are in every parity run.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from onnx import helper

from seq2trt.exporters import attention_functions, fuse_ort, spec
from seq2trt.exporters.fuse import Target, fuse_artifacts
from seq2trt.exporters.onnx_export import export
from seq2trt.plugins.op import DOMAIN, POSITION_BIAS, AttentionKind, input_names
from seq2trt.reference_model.checkpoint import save_checkpoint, source_record
from seq2trt.reference_model.config import preset
from seq2trt.core.errors import CheckFailed, ConfigError
from seq2trt.reference_model.model import Seq2SeqTransformer
from seq2trt.validation.validate import ValidateSettings, run_validation

T5_COMMON = dict(src_vocab_size=48, tgt_vocab_size=48, pad_id=0, bos_id=0, eos_id=1, positions="none", norm="rms",
                 pre_norm=True, bias=False, scale_attention=False, d_kv=16, layer_norm_eps=1e-6,
                 relative_buckets=8, relative_max_distance=12)
FAMILIES = {
    "t5": dict(relative_bias="shared", gated_ffn=True, activation="gelu_tanh", tie_embeddings=True,
               share_vocab=True, scale_logits=True),
    "umt5": dict(relative_bias="per_layer", gated_ffn=False, activation="relu", tie_embeddings=False),
}


def t5_model(family: str, seed: int = 0) -> Seq2SeqTransformer:
    """A tiny random T5-style model; its bias tables drawn wide (std 2) so a wrong distance moves the scores."""
    torch.manual_seed(seed)
    model = Seq2SeqTransformer(preset("tiny", **T5_COMMON, **FAMILIES[family])).eval()
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "relative_bias", None) is not None:
                module.relative_bias.weight.normal_(0.0, 2.0)
    return model


def save_and_export(root, model, dtype: str = "fp32", fuse: tuple[str, ...] = ()):
    ckpt = save_checkpoint(root / "ckpt", model, None)
    out = export(model, root / "out", dtype=dtype, source=source_record(ckpt))
    for target in fuse:
        fuse_artifacts(out, Target(target))
    return out


def validate(out, graphs: str) -> dict:
    return run_validation(out, ValidateSettings(graphs=graphs, samples=3, beam_size=3, localize_budget_s=0))


@pytest.fixture(scope="module", params=list(FAMILIES))
def t5_export(request, tmp_path_factory):
    model = t5_model(request.param)
    return request.param, model, save_and_export(tmp_path_factory.mktemp(request.param), model, fuse=("ort",))


def test_config_reaches_past_max_distance():
    cfg = t5_model("t5").cfg
    limits = spec.Limits.for_model(cfg)  # T5 has no maximum position: the export's limits are the config's lengths
    cases = spec.sweep(limits)
    assert (limits.max_src_len, limits.max_tgt_len) == (cfg.max_src_len, cfg.max_tgt_len)
    assert cfg.inner_dim != cfg.d_model
    assert max(c.src_len for c in cases) > cfg.relative_max_distance
    assert max(c.past_len + c.tgt_len for c in cases) > cfg.relative_max_distance
    assert any(c.padded for c in cases)
    with pytest.raises(ConfigError, match="exceed"):
        spec.Limits.for_model(cfg, max_src_len=cfg.max_src_len + 1)


def test_graph_bias_is_transformers_bucket_lookup(t5_export):
    """The (H, 2M - 1) bias each stack's graph holds reads, at every signed distance r = key - query within the
    export's limits, the table row of transformers' own bucket of r (bidirectional in the encoder, causal in the
    decoder): buckets beyond max_distance included."""
    from transformers.models.t5.modeling_t5 import T5Attention

    from onnx import numpy_helper

    family, model, out = t5_export
    cfg = model.cfg
    for kind, layers, length, both in ((spec.GraphKind.ENCODER, model.encoder_layers, cfg.max_src_len, True),
                                       (spec.GraphKind.DECODER, model.decoder_layers, cfg.max_tgt_len, False)):
        r = torch.arange(-(length - 1), length)
        buckets = T5Attention._relative_position_bucket(r, bidirectional=both, num_buckets=cfg.relative_buckets,
                                                        max_distance=cfg.relative_max_distance)
        want = [layer.self_attn.relative_bias.weight.detach()[buckets].t().numpy() for layer in layers
                if layer.self_attn.relative_bias is not None]  # (H, 2M - 1) per table
        proto = onnx.load(out / kind.filename)
        held = [numpy_helper.to_array(i) for i in proto.graph.initializer
                if list(i.dims) == [cfg.num_heads, 2 * length - 1]]
        assert len(want) == (1 if family == "t5" else len(layers)) and len(held) == len(want)
        assert buckets.max() == cfg.relative_buckets - 1 and length > cfg.relative_max_distance  # saturated
        for table in want:
            assert any(np.array_equal(table, h) for h in held)


@pytest.mark.parametrize("graphs", ["plain", "fused-ort"])
def test_graphs_match_the_float64_model(t5_export, graphs):
    """Every graph output over the sweep, and greedy and beam tokens end to end."""
    _, _, out = t5_export
    doc = validate(out, graphs)
    assert doc["passed"] and not doc["graph_failures"]
    assert doc["end_to_end"]["greedy"]["sequence_match"] == 1.0
    assert doc["end_to_end"]["beam"]["sequence_match"] == 1.0


def test_plain_graphs_carry_the_biased_blocks(t5_export):
    family, model, out = t5_export
    for kind in spec.GraphKind:
        proto = onnx.load(out / kind.filename)
        marked = [n for n in proto.graph.node if n.domain == spec.MARKED_DOMAIN]
        for node in marked:
            found_kind, biased = attention_functions.marked_kind(node.op_type)
            assert biased == (found_kind is not AttentionKind.CROSS)
            assert len(node.input) == len(input_names(found_kind, biased))
        biases = {n.input[-1] for n in marked if attention_functions.marked_kind(n.op_type)[1]}
        layers = model.cfg.num_encoder_layers if kind is spec.GraphKind.ENCODER else model.cfg.num_decoder_layers
        assert len(biases) == (1 if family == "t5" else layers)
        bodies = [proto.graph.node] + [f.node for f in proto.functions]
        assert not any(n.op_type == "Log" for nodes in bodies for n in nodes)  # the buckets are a lookup, not a log
        assert not [i.name for i in proto.graph.initializer if i.name.endswith("proj.bias")]  # bias-free


def test_fused_ort_blocks_take_the_bias(t5_export):
    """fusion.json counts every block; each self-attention block is a MultiHeadAttention reading attention_bias
    (input 5) with scale 1.0; one expansion per stack for a shared table, one per layer for UMT5."""
    family, model, out = t5_export
    record = json.loads((out / "fused" / "ort" / "fusion.json").read_text())
    assert record["complete"]
    cfg = model.cfg
    for kind in spec.GraphKind:
        audit = record["graphs"][kind.value]
        assert audit["fused"] == audit["expected"] == {
            k.name: n for k, n in spec.expected_blocks(cfg, kind).items()} and not audit["unfused_blocks"]
        proto = onnx.load(out / "fused" / "ort" / kind.filename)
        mha = [n for n in proto.graph.node if n.op_type == "MultiHeadAttention"]
        assert all(helper.get_attribute_value(next(a for a in n.attribute if a.name == "scale")) == 1.0 for n in mha)
        self_attn = [n for n in mha if n.name.endswith("self_attn")]
        assert all(len(n.input) > 5 and n.input[5] for n in self_attn)
        assert all(len(n.input) <= 5 or not n.input[5] for n in mha if n.name.endswith("cross_attn"))
        layers = len(self_attn)
        assert len({n.input[5] for n in self_attn}) == (1 if family == "t5" else layers)
        packed = [n for n in proto.graph.node if n.op_type == "MatMul" and n.input[1].endswith("packed_qkv.weight")]
        assert len(packed) == layers and not any(n.input[3] for n in mha)  # bias-free q/k/v packed, no bias added
        readers = {}
        for n in proto.graph.node:
            for name in n.input:
                readers.setdefault(name, set()).add(n.op_type)
        matmuls = [n.output[0] for n in proto.graph.node if n.op_type == "MatMul"]
        assert all(readers.get(out, {"graph output"}) - {"Shape"} for out in matmuls)  # no projection kept for a shape


def test_fused_ort_folds_residual_norms_and_gelu(t5_export):
    """The ORT target makes every residual add + RMSNorm one SkipSimplifiedLayerNormalization (all but each stack's
    first norm, which reads the embedding) and, for the gated tanh-GELU FFN, every GELU one FastGelu; fusion.json
    counts them, and the graphs' parity is test_graphs_match_the_float64_model's."""
    family, model, out = t5_export
    record = json.loads((out / "fused" / "ort" / "fusion.json").read_text())
    cfg = model.cfg
    for kind, layers, norms in ((spec.GraphKind.ENCODER, cfg.num_encoder_layers, 2),
                                (spec.GraphKind.DECODER, cfg.num_decoder_layers, 3)):
        gelu = layers if cfg.activation == "gelu_tanh" else 0
        assert record["graphs"][kind.value]["folded"] == {"skip_rms_norm": norms * layers, "fast_gelu": gelu,
                                                          "attention_scale": 0}  # T5 scales by 1
        ops = [n.op_type for n in onnx.load(out / "fused" / "ort" / kind.filename).graph.node]
        assert ops.count("SkipSimplifiedLayerNormalization") == norms * layers and ops.count("FastGelu") == gelu
        assert ops.count("ReduceMean") == 1 and "Tanh" not in ops  # the first norm alone keeps its chain


def test_localisation_names_a_fault_in_the_folded_graph(t5_export):
    """The folded ORT decoder keeps every sub-block's output tensor (a SkipSimplifiedLayerNormalization's sum keeps
    the residual Add's name): a clean graph localises nothing, a weight scaled in layer 1's FFN is named there."""
    from onnx import numpy_helper

    from seq2trt.validation.localize import GraphLocaliser, localise, replay_feeds
    from seq2trt.validation.validate import GRAPH_SETS

    _, model, out = t5_export
    kind, limits = spec.GraphKind.DECODER, spec.Limits(4, 16, 16)
    plain, fused = onnx.load(out / kind.filename), onnx.load(out / "fused" / "ort" / kind.filename)
    runner_options = GRAPH_SETS["fused-ort"].runner_options
    options = runner_options("fp32") if runner_options else {}
    feeds = [f for f in replay_feeds(model, limits, [spec.ShapeCase(2, 9, 1, p, padded=True) for p in (0, 14)],
                                     "fp32", seed=1) if f[0] is kind]

    def found(graph):
        return localise({kind: GraphLocaliser(graph, plain, model, kind, "fp32", limits, "fp32", options)}, feeds)[0]

    assert found(fused) == []
    weights = {i.name: i for i in fused.graph.initializer}
    fc2 = next(n for n in fused.graph.node if n.op_type == "MatMul" and n.input[1] in weights and any(
        "'model.decoder_layers.1.ffn.fc2'" in p.value for p in n.metadata_props))
    w = numpy_helper.to_array(weights[fc2.input[1]])
    weights[fc2.input[1]].CopyFrom(numpy_helper.from_array(w * 1.5, fc2.input[1]))
    results = found(fused)
    assert len(results) == len(feeds)
    assert all(r.reason == "failure" and r.first_divergent == "decoder_layers.1.ffn_block" for r in results)


def _reversed_distance(original):
    """bias_by_distance reading distance query - key: the bias mirrored, a wrong direction."""
    def plant(*args, **kwargs):
        nodes = original(*args, **kwargs)
        sub = next(n for n in nodes if n.op_type == "Sub" and n.output[0].endswith("bias_distance"))
        sub.input[0], sub.input[1] = sub.input[1], sub.input[0]
        return nodes
    return plant


def test_a_mirrored_bias_fails_parity(tmp_path, monkeypatch):
    """The control: the graphs' bias with the direction reversed (plain and fused) must fail validation."""
    monkeypatch.setattr(attention_functions, "bias_by_distance",
                        _reversed_distance(attention_functions.bias_by_distance))
    monkeypatch.setattr(fuse_ort, "bias_by_distance", _reversed_distance(fuse_ort.bias_by_distance))
    out = save_and_export(tmp_path, t5_model("t5", seed=1), fuse=("ort",))
    for graphs in ("plain", "fused-ort"):
        with pytest.raises(CheckFailed, match="parity failed"):
            validate(out, graphs)
        failures = json.loads((out / "reports" / "parity.json").read_text())["graph_failures"]
        assert failures  # the graph outputs themselves, not only the tokens


def test_plugin_nodes_take_the_bias_last(t5_export, tmp_path):
    """The TensorRT target: each self-attention plugin node's inputs are the op's (`pack_inputs`), bias last; the
    plugin graphs match the float64 model on CPU through the plugin's reference."""
    _, _, out = t5_export
    fuse_artifacts(out, Target.TRT, force=True)
    for kind in spec.GraphKind:
        plain = {n.name: n for n in onnx.load(out / kind.filename).graph.node if n.domain == spec.MARKED_DOMAIN}
        for node in (n for n in onnx.load(out / "fused" / "trt" / kind.filename).graph.node if n.domain == DOMAIN):
            attn_kind = AttentionKind(helper.get_attribute_value(next(a for a in node.attribute if a.name == "kind")))
            biased = attn_kind is not AttentionKind.CROSS
            assert len(node.input) == len(input_names(attn_kind, biased))
            assert (input_names(attn_kind, biased)[-1] == POSITION_BIAS) == biased
            assert list(node.input) == list(plain[node.name].input)
    assert validate(out, "fused-trt")["passed"]


def test_int8_and_generate(t5_export):
    """int8 of the fused ORT graphs against the float64 reference that quantizes alike; generate.onnx (ORT's
    BeamSearch, decoder start = pad) against the eager model's greedy and beam tokens."""
    from seq2trt.exporters.ort_search import generate_artifacts
    from seq2trt.exporters.quantize import quantize_artifacts

    _, model, out = t5_export
    assert model.cfg.bos_id == model.cfg.pad_id
    quantize_artifacts(out, force=True)
    assert validate(out, "int8-ort")["passed"]
    generate_artifacts(out, force=True)
    doc = validate(out, "generate")
    assert doc["passed"]


def test_fp16_refused_for_gated_t5_and_bf16_passes(tmp_path):
    gated = t5_model("t5")
    with pytest.raises(ConfigError, match="bf16"):
        export(gated, tmp_path / "fp16", dtype="fp16")
    assert not (tmp_path / "fp16").exists()
    out = save_and_export(tmp_path / "bf16", gated, dtype="bf16", fuse=("ort",))
    for graphs in ("plain", "fused-ort"):
        assert validate(out, graphs)["passed"]


def test_fp16_of_relu_t5(tmp_path):
    """A relu T5 (v1.0-like) is not refused; its fp16 graphs are judged as the other families'."""
    out = save_and_export(tmp_path, t5_model("umt5"), dtype="fp16")
    assert validate(out, "plain")["passed"]


def test_tensorrt_rtx_engines_build_from_a_t5_export(t5_export):
    """`seq2trt build` on a T5 export: every attention block is one plugin layer of the engine, its bias input
    accepted by the plugin (TensorRT-RTX builds without a GPU; running the engines needs one)."""
    from seq2trt.exporters.tensorrt.engines import EngineRequest, build_engines, verify_engines

    family, model, out = t5_export
    fuse_artifacts(out, Target.TRT, force=True)
    engines = build_engines(out, EngineRequest("tensorrt-rtx", (86,), force=True))
    info = verify_engines(engines)
    cfg = model.cfg
    assert info["plugin"]["layers"] == {"encoder": cfg.num_encoder_layers, "decoder": 2 * cfg.num_decoder_layers}
    assert all(info["graphs"][kind.value]["plan_bytes"] > 10_000 for kind in spec.GraphKind)
