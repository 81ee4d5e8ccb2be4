"""Localisation names the layer and sub-block of a fault planted in one layer of a fused graph, and nothing on a clean
graph. The planted fault's place is the independent truth: the code under test never sees it."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from seq2trt.exporters import spec
from seq2trt.exporters.fuse import Target, fuse
from seq2trt.exporters.onnx_export import export
from seq2trt.validation.localize import GraphLocaliser, localise, replay_feeds
from seq2trt.validation.parity import tolerance_for
from seq2trt.validation.precision import twin_tolerance
from seq2trt.validation.validate import GRAPH_SETS

from helpers.cli import invoke

E, D = spec.GraphKind.ENCODER, spec.GraphKind.DECODER


@pytest.fixture(scope="module")
def exported(tmp_path_factory, make_model):
    """A tiny random model exported in fp32, its plain graphs and both fused targets (in memory)."""
    model = make_model(seed=3)
    out = export(model.float(), tmp_path_factory.mktemp("loc") / "export", limits=spec.Limits(4, 16, 16))
    plain = {kind: onnx.load(out / kind.filename) for kind in spec.GraphKind}
    fused = {target: {kind: fuse(plain[kind], target, model.cfg, kind)[0] for kind in spec.GraphKind}
             for target in Target}
    return model, plain, fused, spec.Limits(4, 16, 16)


def _matmul_weight(graph: onnx.ModelProto, module: str) -> onnx.TensorProto:
    """The weight initializer of the MatMul traced in `module` (e.g. `decoder_layers.1.ffn.fc1`)."""
    inits = {i.name: i for i in graph.graph.initializer}
    for node in graph.graph.node:
        scopes = next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.name_scopes"), "")
        if node.op_type == "MatMul" and f"'model.{module}'" in scopes and node.input[1] in inits:
            return inits[node.input[1]]
    raise LookupError(module)


def scale_weight(graph: onnx.ModelProto, module: str, factor: float = 1.5) -> onnx.ModelProto:
    faulty = onnx.ModelProto()
    faulty.CopyFrom(graph)
    init = _matmul_weight(faulty, module)
    w = numpy_helper.to_array(init)
    init.CopyFrom(numpy_helper.from_array((w * factor).astype(w.dtype), init.name))
    return faulty


def swap_heads(graph: onnx.ModelProto, module: str, head_dim: int) -> onnx.ModelProto:
    """Swap the output columns of heads 0 and 1 of a projection's weight (MatMul weight is (in, out))."""
    faulty = onnx.ModelProto()
    faulty.CopyFrom(graph)
    init = _matmul_weight(faulty, module)
    w = numpy_helper.to_array(init).copy()
    w[:, :head_dim], w[:, head_dim:2 * head_dim] = w[:, head_dim:2 * head_dim].copy(), w[:, :head_dim].copy()
    init.CopyFrom(numpy_helper.from_array(w, init.name))
    return faulty


def _localiser(exported, graphs: str, kind, candidate):
    model, plain, _, limits = exported
    options = GRAPH_SETS[graphs].runner_options("fp32") if GRAPH_SETS[graphs].runner_options else {}
    return GraphLocaliser(candidate, plain[kind], model, kind, "fp32", limits, "fp32", options)


def _feeds(exported, kind, past_lens=(0, 1, 15)):
    model, _, _, limits = exported
    cases = [spec.ShapeCase(2, 9, 1, p, padded=True) for p in past_lens]
    return [f for f in replay_feeds(model, limits, cases, "fp32", seed=1) if f[0] is kind]


@pytest.mark.parametrize("graphs", ["plain", "fused-ort", "fused-trt"])
def test_clean_graph_localises_nothing(exported, graphs):
    _, plain, fused, _ = exported
    for kind in spec.GraphKind:
        candidate = plain[kind] if graphs == "plain" else fused[GRAPH_SETS[graphs].fused_target][kind]
        found, unchecked = localise({kind: _localiser(exported, graphs, kind, candidate)}, _feeds(exported, kind))
        assert found == [] and unchecked == 0


@pytest.mark.parametrize("graphs, kind, fault, module, block", [
    ("fused-ort", E, "scale", "encoder_layers.1.ffn.fc1", "encoder_layers.1.ffn_block"),
    ("fused-trt", E, "swap", "encoder_layers.0.self_attn.v_proj", "encoder_layers.0.attn_block"),
    ("fused-ort", D, "scale", "decoder_layers.1.ffn.fc2", "decoder_layers.1.ffn_block"),
    ("fused-ort", D, "swap", "decoder_layers.1.cross_attn.q_proj", "decoder_layers.1.cross_block"),
    ("fused-trt", D, "swap", "decoder_layers.0.self_attn.v_proj", "decoder_layers.0.self_block"),
])
def test_planted_fault_is_named(exported, graphs, kind, fault, module, block):
    model, _, fused, _ = exported
    graph = fused[GRAPH_SETS[graphs].fused_target][kind]
    faulty = scale_weight(graph, module) if fault == "scale" else swap_heads(graph, module, model.cfg.head_dim)
    feeds = _feeds(exported, kind)
    found, _ = localise({kind: _localiser(exported, graphs, kind, faulty)}, feeds)
    assert len(found) == len(feeds)  # every case (each past length for the decoder) fails and is localised
    tol = tolerance_for("fp32", spec.debug_output_name(block))
    for result in found:
        assert result.reason == "failure" and result.first_divergent == block, (result.case, result.to_dict())
        order = [b.name for b in result.blocks]
        assert all(b.max_abs <= tol.atol for b in result.blocks[:order.index(block)])
        if fault == "scale":
            assert "MatMul" in result.op_types
        if graphs == "fused-trt" and "attn" in module:
            assert "seq2trt.Seq2TrtAttention" in result.op_types or any("Attention" in op for op in result.op_types)


def test_growth_is_reported_for_every_block(exported):
    model, plain, _, _ = exported
    found, _ = localise({D: _localiser(exported, "plain", D, plain[D])}, _feeds(exported, D, (1,)), requested=True)
    assert len(found) == 1 and found[0].reason == "requested" and found[0].first_divergent is None
    assert [b["block"] for b in found[0].to_dict()["blocks"]] == spec.sub_block_paths(model.cfg, D)


@pytest.fixture(scope="module")
def narrow(tmp_path_factory, make_model):
    """fp16 and bf16 exports of a tiny random model (plain graphs and the fused ones of both targets)."""
    model = make_model(seed=5)
    limits = spec.Limits(4, 16, 16)
    graphs = {}
    for dtype in ("fp16", "bf16"):
        out = export(model.float(), tmp_path_factory.mktemp("loc") / dtype, dtype=dtype, limits=limits)
        plain = {kind: onnx.load(out / kind.filename) for kind in spec.GraphKind}
        graphs[dtype] = {"plain": plain, **{GRAPH_SETS_BY_TARGET[t]: {
            kind: fuse(plain[kind], t, model.cfg, kind)[0] for kind in spec.GraphKind} for t in Target}}
    return model, graphs, limits


GRAPH_SETS_BY_TARGET = {Target.ORT: "fused-ort", Target.TRT: "fused-trt"}


def _narrow_localiser(narrow, dtype, graphs, kind, candidate=None):
    model, all_graphs, limits = narrow
    options = GRAPH_SETS[graphs].runner_options(dtype) if GRAPH_SETS[graphs].runner_options else {}
    twin = GRAPH_SETS[graphs].runner_options("fp32") if GRAPH_SETS[graphs].runner_options else {}
    return GraphLocaliser(candidate or all_graphs[dtype][graphs][kind], all_graphs[dtype]["plain"][kind], model,
                          kind, dtype, limits, dtype, options, twin)


@pytest.mark.parametrize("graphs", ["plain", "fused-trt"])
def test_fp16_near_ties_stay_within_tolerance_at_every_layer(narrow, graphs):
    """fp16 of a random model: the sweep finds near-ties (top-2 logits closer than fp16 rounding can move them); each
    is reported as a near-tie with every sub-block of the fp32 twin inside its bound, not as a fault."""
    model, _, limits = narrow
    localisers = {kind: _narrow_localiser(narrow, "fp16", graphs, kind) for kind in spec.GraphKind}
    found, _ = localise(localisers, replay_feeds(model, limits, spec.sweep(limits), "fp16", seed=0))
    assert found, "the random model's sweep has no near-tie: the test proves nothing"
    for result in found:
        assert result.reason == "near-tie" and result.graph == "decoder" and result.near_ties >= result.token_flips
        for block in result.blocks:  # the fp32 twin's blocks, judged as precision.twin_tolerance says
            assert block.passed and block.tolerance == twin_tolerance("fp16"), (result.case, block)


@pytest.mark.parametrize("dtype, graphs, kind, fault, module, block", [
    ("fp16", "fused-trt", E, "swap", "encoder_layers.1.self_attn.v_proj", "encoder_layers.1.attn_block"),
    ("fp16", "fused-ort", D, "scale", "decoder_layers.0.ffn.fc1", "decoder_layers.0.ffn_block"),
    ("fp16", "fused-trt", D, "swap", "decoder_layers.1.cross_attn.q_proj", "decoder_layers.1.cross_block"),
    # bf16's tolerance (atol 0.4) is wider than some cases' head-swap error: a larger fault there
    ("bf16", "fused-trt", D, "scale", "decoder_layers.1.ffn.fc2", "decoder_layers.1.ffn_block"),
    ("bf16", "fused-ort", E, "scale", "encoder_layers.0.ffn.fc2", "encoder_layers.0.ffn_block"),
])
def test_planted_fault_is_named_in_fp16_and_bf16(narrow, dtype, graphs, kind, fault, module, block):
    model, all_graphs, limits = narrow
    graph = all_graphs[dtype][graphs][kind]
    faulty = scale_weight(graph, module, 3.0) if fault == "scale" else swap_heads(graph, module, model.cfg.head_dim)
    cases = [spec.ShapeCase(2, 9, 1, p, padded=True) for p in (0, 1, 15)]
    feeds = [f for f in replay_feeds(model, limits, cases, dtype, seed=1) if f[0] is kind]
    found, _ = localise({kind: _narrow_localiser(narrow, dtype, graphs, kind, faulty)}, feeds)
    assert [r.first_divergent for r in found] == [block] * len(feeds)
    assert all(r.reason == "failure" for r in found)


def test_int8_fault_is_named(exported, tmp_path):
    """int8-ort: the fault planted in the fused graph before quantization is found in the int8 graph."""
    from seq2trt.exporters.artifact_checks import load_graph
    from seq2trt.exporters.quantize import QuantizeSettings, quantize_graph

    model, plain, fused, limits = exported
    faulty = scale_weight(fused[Target.ORT][D], "decoder_layers.1.ffn.fc2", 4.0)
    onnx.save(faulty, tmp_path / "decoder-fused.onnx")
    quantize_graph(tmp_path / "decoder-fused.onnx", tmp_path / "decoder.onnx", QuantizeSettings(), onnx.load)
    int8 = onnx.load(tmp_path / "decoder.onnx")
    assert any(n.op_type == "MatMulInteger" for n in int8.graph.node)
    localiser = GraphLocaliser(int8, plain[D], model, D, "fp32", limits, "int8",
                               GRAPH_SETS["int8-ort"].runner_options("fp32"))
    found, _ = localise({D: localiser}, _feeds(exported, D))
    assert [r.first_divergent for r in found] == ["decoder_layers.1.ffn_block"] * 3
    assert any(op.startswith("MatMulInteger") or op == "DynamicQuantizeLinear" for op in found[0].op_types)


@pytest.fixture(scope="module")
def cli_export(tmp_path_factory, make_model):
    """A tiny random model's checkpoint exported in fp16 and fused for TensorRT, through the CLI."""
    import torch

    from seq2trt.reference_model.checkpoint import save_checkpoint

    root = tmp_path_factory.mktemp("loc-cli")
    save_checkpoint(root / "ckpt", make_model(seed=5, dtype=torch.float32))
    for args in (["export", str(root / "ckpt"), "-o", str(root / "out"), "--dtype", "fp16", "--max-batch", "4",
                  "--max-src-len", "16", "--max-tgt-len", "16"], ["fuse", str(root / "out"), "--target", "trt"]):
        result = invoke(*args)
        assert result.exit_code == 0, result.output
    return root / "out"


def test_validate_localises_near_ties_and_reports_them(cli_export):
    """`seq2trt validate` localises on its own (fp16 near-ties of a random model): parity.json's list, parity.md's
    table and the plot; `--localize-budget 0` turns it off."""
    import json

    result = invoke("validate", cli_export, "--graphs", "fused-trt", "--samples", "0")
    assert result.exit_code == 0, result.output
    doc = json.loads((cli_export / "reports" / "parity.json").read_text())
    assert doc["localisation"] and doc["localisation_unchecked"] == 0
    assert {item["reason"] for item in doc["localisation"]} == {"near-tie"}
    assert all(item["first_divergent"] is None for item in doc["localisation"])
    markdown = (cli_export / "reports" / "parity.md").read_text()
    assert "Where it diverged" in markdown and "decoder_layers" not in markdown.split("Where it diverged")[0]
    assert (cli_export / "reports" / "localisation-ort-fused-trt.png").stat().st_size > 1000
    result = invoke("validate", cli_export, "--graphs", "fused-trt", "--samples", "0", "--localize-budget", "0")
    assert result.exit_code == 0, result.output
    assert json.loads((cli_export / "reports" / "parity.json").read_text())["localisation"] == []


def test_validate_localize_on_a_clean_export(cli_export):
    """run_validation(localize=True) on the plain graphs of a clean export: cases are localised, none diverges."""
    from seq2trt.validation.validate import ValidateSettings, run_validation

    doc = run_validation(cli_export, ValidateSettings(graphs="plain", samples=0, localize=True, seed=7))
    items = doc["localisation"]
    assert {i["graph"] for i in items} <= {"encoder", "decoder"} and "decoder" in {i["graph"] for i in items}
    assert all(i["first_divergent"] is None for i in items)


def test_failing_validation_is_localised(cli_export, monkeypatch):
    """With the fp32 twin held to no error at all every graph fails: validate still writes the localisation,
    failures first, each naming the first sub-block over that bound, with the block's op types, and then fails."""
    import json

    from seq2trt.core.errors import CheckFailed
    from seq2trt.validation import precision
    from seq2trt.validation.parity import Tolerance
    from seq2trt.validation.validate import ValidateSettings, run_validation

    monkeypatch.setattr(precision, "twin_tolerance", lambda dtype: Tolerance(atol=0.0, rtol=0.0, min_cosine=1.0))
    with pytest.raises(CheckFailed):
        run_validation(cli_export, ValidateSettings(graphs="fused-trt", samples=0))
    doc = json.loads((cli_export / "reports" / "parity.json").read_text())
    items = doc["localisation"]
    assert {i["graph"] for i in items} == {"encoder", "decoder"} and items[0]["reason"] == "failure"
    for item in (i for i in items if i["reason"] == "failure"):
        at = [b["block"] for b in item["blocks"]].index(item["first_divergent"])
        named = item["blocks"][at]
        assert not named["passed"] and named["max_abs"] > 0
        assert all(b["passed"] for b in item["blocks"][:at]) and item["op_types"]
    assert "| failure |" in (cli_export / "reports" / "parity.md").read_text()
