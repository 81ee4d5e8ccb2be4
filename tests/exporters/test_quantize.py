"""int8 (dynamic quantization of the fused ORT graphs): every weight MatMul becomes int8, the graph contract is
unchanged, the graphs compute what dynamic quantization of the eager model computes (planted faults fail), and
the stage refuses what it cannot quantize or has already written."""

from __future__ import annotations

import copy
import json
from collections import Counter

import numpy as np
import onnx
import pytest
import torch

from seq2trt.exporters import spec
from seq2trt.exporters.artifact_checks import load_graph
from seq2trt.exporters.fuse import Target, fuse_artifacts
from seq2trt.exporters.manifest import verify
from seq2trt.exporters.onnx_export import export
from seq2trt.exporters.quantize import (QUANTIZATION_JSON, QuantizeSettings, quantize_artifacts, quantized_dir,
                                        verify_quantized)
from seq2trt.core.errors import ArtifactError, InputError
from seq2trt.validation.parity import REPORTED, graph_parity
from seq2trt.validation.precision import judge_for
from seq2trt.runtime.runners import EagerRunner, OrtRunner

from helpers.artifacts import checkpoint_and_export
from helpers.cli import invoke


@pytest.fixture(scope="module")
def exported(make_model, tmp_path_factory):
    """A tiny model's checkpoint, its export (naming the checkpoint) and the fused ORT graphs."""
    model = make_model(seed=4, dtype=torch.float32)
    return model, checkpoint_and_export(tmp_path_factory.mktemp("quantize"), model, fuse=("ort",))[1]


@pytest.fixture(scope="module")
def quantized(exported):
    model, out = exported
    return model, out, quantize_artifacts(out)


def test_every_weight_matmul_is_int8_and_the_contract_holds(quantized):
    model, out, doc = quantized
    manifest = verify(out)
    for kind in spec.GraphKind:
        graph = load_graph(quantized_dir(out) / kind.filename, model.cfg, kind, "fp32")  # names, dtypes, heads
        ops = Counter(n.op_type for n in graph.graph.node)
        entry = doc["graphs"][kind.value]
        assert entry["quantized"] == entry["constant_weight_matmuls"] == ops["MatMulInteger"] > 0
        assert ops["MultiHeadAttention"] == sum(spec.expected_blocks(model.cfg, kind).values())  # attention stays
        assert entry["bytes_after"] < entry["bytes_before"]  # (tiny model: embeddings and norms weigh a lot)
        int8 = [i for i in graph.graph.initializer if i.data_type == onnx.TensorProto.INT8 and len(i.dims) == 2]
        assert len(int8) == entry["quantized"]
    assert doc["per_channel"] is False and manifest.dtype == "fp32"
    assert json.loads((quantized_dir(out) / QUANTIZATION_JSON).read_text()) == doc
    assert verify_quantized(out) == doc


def _int8_parity(model, out, graph_files: dict | None = None, cases=None):
    """The int8 graphs (or `graph_files`: GraphKind -> path) judged as validate judges them."""
    import contextlib

    manifest = verify(out)
    paths = graph_files or {k: quantized_dir(out) / k.filename for k in spec.GraphKind}
    judge, options = judge_for("int8", paths, model.cfg, manifest.limits, model, {"optimization": "extended"})
    candidates = tuple(OrtRunner(paths[k], model.cfg, k, "fp32", manifest.limits, **options) for k in spec.GraphKind)
    references = tuple(EagerRunner(copy.deepcopy(model).double(), k, manifest.limits) for k in spec.GraphKind)
    with contextlib.ExitStack() as stack:
        for r in candidates + references:
            stack.enter_context(r)
        return graph_parity(candidates, references, cases or spec.sweep(manifest.limits), judge=judge)


def test_int8_graphs_compute_dynamic_quantization(quantized):
    """Every output of both graphs over the spec's sweep against the float64 reference that quantizes as dynamic
    quantization does, at the fp32 tolerances; the cost against the float model is reported beside it."""
    model, out, _ = quantized
    result = _int8_parity(model, out)
    assert result, result.failures()[:3]
    judged = [o for c in result.cases for o in c.outputs if o.tolerance != REPORTED and " input of " not in o.name]
    cost = [o for c in result.cases for o in c.outputs if o.tolerance == REPORTED]
    inputs = [o for c in result.cases for o in c.outputs if o.name.startswith("int8 input of ")]
    assert judged and cost and inputs
    # int8 is not float32 in disguise: against the float model its error is orders of magnitude above float32
    # arithmetic's, and against the reference that quantizes the same way it is float32 arithmetic again
    assert max(o.max_abs for o in judged) < 1e-4 < max(o.max_abs for o in cost)
    assert {o.name.removeprefix("int8 input of ") for o in inputs} >= {"encoder_layers.0.ffn.fc1", "lm_head"}


@pytest.mark.parametrize("fault", ["weight-scale-x1.1", "cross-scale-x1.1", "one-head-swapped-in-float",
                                   "bias-ramp-0.05"])
def test_int8_parity_catches_a_wrong_graph(quantized, tmp_path, fault):
    """Negative controls: a wrong weight scale in one MatMul, a wrong attention scale, and a bias shifted
    non-uniformly in the quantized decoder must each fail the int8 check."""
    from onnx import numpy_helper

    model, out, _ = quantized
    proto = onnx.load(str(quantized_dir(out) / "decoder.onnx"))
    if fault == "weight-scale-x1.1":
        mm = next(n for n in proto.graph.node if n.op_type == "MatMulInteger")
        scale = next(i for i in proto.graph.initializer if i.name == mm.input[1].replace("_quantized", "_scale"))
        scale.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(scale) * np.float32(1.1), scale.name))
    elif fault == "cross-scale-x1.1":
        node = [n for n in proto.graph.node if n.op_type == "MultiHeadAttention"][-1]
        attr = next(a for a in node.attribute if a.name == "scale")
        attr.f *= 1.1
    elif fault == "one-head-swapped-in-float":  # a float bias of a cross-attention query: heads 0 and 1 trade
        node = [n for n in proto.graph.node if n.op_type == "MultiHeadAttention"][-1]
        bias = next(i for i in proto.graph.initializer if i.name == node.input[3])
        values, hd = numpy_helper.to_array(bias).copy(), model.cfg.head_dim
        values[:hd], values[hd:2 * hd] = values[hd:2 * hd].copy() + 0.5, values[:hd].copy()
        bias.CopyFrom(numpy_helper.from_array(values, bias.name))
    else:
        bias = next(i for i in proto.graph.initializer if i.name.endswith("decoder_layers.0.ffn.fc2.bias"))
        values = numpy_helper.to_array(bias).astype(np.float64)
        bias.CopyFrom(numpy_helper.from_array((values + 0.05 * np.linspace(-1, 1, values.size)).astype(np.float32),
                                              bias.name))
    onnx.save(proto, str(tmp_path / "decoder.onnx"))
    files = {spec.GraphKind.ENCODER: quantized_dir(out) / "encoder.onnx", spec.GraphKind.DECODER: tmp_path / "decoder.onnx"}
    cases = [c for c in spec.sweep(verify(out).limits) if c.src_len > 1][:4]  # one key: the scale cannot show
    result = _int8_parity(model, out, files, cases)
    assert not result, f"{fault} passed the int8 check"
    assert all(f.startswith("decoder") for f in result.failures()), result.failures()[:3]
    if fault == "weight-scale-x1.1":
        assert any("dequantizes to no layer of the model" in f for f in result.failures())


def test_per_channel_and_force(exported):
    model, out = exported
    with pytest.raises(ArtifactError, match="already exists; pass --force"):
        quantize_artifacts(out, QuantizeSettings(per_channel=True))
    doc = quantize_artifacts(out, QuantizeSettings(per_channel=True), force=True)
    assert doc["per_channel"] is True
    graph = onnx.load(str(quantized_dir(out) / "decoder.onnx"))
    scales = [i for i in graph.graph.initializer if i.name.endswith("_scale") and i.dims]
    assert scales and all(len(i.dims) == 1 and i.dims[0] > 1 for i in scales)  # one scale per output channel
    quantize_artifacts(out, force=True)  # back to the module's default for the tests that follow


def test_refuses_what_it_cannot_quantize(make_model, tmp_path):
    model = make_model(seed=4, dtype=torch.float32)
    out = export(model, tmp_path / "out")
    with pytest.raises(InputError, match="fuse .* --target ort"):
        quantize_artifacts(out)
    half = export(model, tmp_path / "half", dtype="fp16")
    fuse_artifacts(half, Target.ORT)
    with pytest.raises(InputError, match="fp16 export; int8 dynamic quantization starts from float32"):
        quantize_artifacts(half)
    assert not quantized_dir(half).exists() and not quantized_dir(out).exists()


def test_verify_names_modified_and_stale_graphs(exported, tmp_path):
    import shutil

    _, out = exported
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    quantize_artifacts(copy, force=True)
    with open(quantized_dir(copy) / "decoder.onnx", "ab") as f:
        f.write(b"\0")
    with pytest.raises(ArtifactError, match="decoder.onnx does not match its sha256"):
        verify_quantized(copy)
    quantize_artifacts(copy, force=True)
    path = quantized_dir(copy) / QUANTIZATION_JSON
    doc = json.loads(path.read_text())
    doc["files"]["encoder.onnx"]["source_sha256"] = "0" * 64
    path.write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match="encoder.onnx was quantized from older fused graphs; re-run"):
        verify_quantized(copy)


def test_cli_quantize_and_validate(exported, tmp_path):
    import shutil

    _, out = exported
    copy = tmp_path / "cli"
    shutil.copytree(out, copy)
    shutil.rmtree(quantized_dir(copy), ignore_errors=True)
    result = invoke("quantize", copy)
    assert result.exit_code == 0, result.output
    assert "decoder: " in result.output and "MatMuls int8" in result.output
    result = invoke("quantize", copy)
    assert result.exit_code == 2 and "--force" in result.output
    result = invoke("validate", copy, "--graphs", "int8-ort", "--samples", "40")
    doc = json.loads((copy / "reports" / "parity-ort-int8-ort.json").read_text())
    # A random tiny model has near-ties int8 can flip (the trained demo model agrees on 1,000 of 1,000), so the
    # end-to-end verdict may go either way here; the exit code must follow it, and the graphs must pass.
    assert result.exit_code == (0 if doc["passed"] else 1), result.output
    assert doc["graph_failures"] == [] and doc["graphs_set"] == "int8-ort"
    sampled = doc["sampling"]["distribution"]  # int8 samples from its own (shifted) probabilities: tested on them
    assert doc["sampling"]["mode"] == "distribution" and sampled["null"] == "candidate" and doc["sampling"]["passed"]
    assert doc["end_to_end"]["greedy"]["token_agreement"] > 0.9
    from seq2trt.validation.parity import TOLERANCES

    # judged against the reference that quantizes as the graph does, at the fp32 bounds; the cost is reported
    assert doc["graphs"]["decoder"]["logits"]["tolerance"] == vars(TOLERANCES["fp32"]["*"])
    assert doc["graphs"]["decoder"]["logits (int8 vs float model)"]["tolerance"]["basis"] == "reported, not judged"
    assert doc["end_to_end"]["targets"]["max_logit_abs_err"] is None and doc["end_to_end"]["samples"] == 40
    (quantized_dir(copy) / "encoder.onnx").write_bytes(b"not a graph")
    result = invoke("validate", copy, "--graphs", "int8-ort", "--samples", "0")
    assert result.exit_code == 2 and "does not match its sha256" in result.output


def test_tied_output_projection_is_a_weight_and_int8(demo_checkpoint, tmp_path):
    """The demo model's tied head is exported as MatMul(h, Transpose(embedding)); the ORT fuser folds that Transpose
    into a weight so the quantizer takes it too, and the fused graph still computes the eager logits."""
    from seq2trt.reference_model.checkpoint import load_checkpoint

    model, _ = load_checkpoint(demo_checkpoint)
    assert model.cfg.tie_embeddings
    out = export(model, tmp_path / "out")
    plain = onnx.load(str(out / "decoder.onnx"))
    weights = {i.name for i in plain.graph.initializer}
    assert [n for n in plain.graph.node if n.op_type == "Transpose" and n.input[0] in weights]
    fuse_artifacts(out, Target.ORT)
    fused = onnx.load(str(out / "fused" / "ort" / "decoder.onnx"))
    weights = {i.name for i in fused.graph.initializer}
    assert not [n for n in fused.graph.node if n.op_type == "Transpose" and n.input[0] in weights]
    doc = quantize_artifacts(out)
    assert doc["graphs"]["decoder"]["quantized"] == doc["graphs"]["decoder"]["matmuls"]
    manifest = verify(out)
    pairs = [(OrtRunner(out / "fused" / "ort" / k.filename, model.cfg, k, "fp32", manifest.limits),
              EagerRunner(model.double(), k, manifest.limits)) for k in spec.GraphKind]
    for pair in pairs:
        for r in pair:
            r.__enter__()
    result = graph_parity(tuple(p[0] for p in pairs), tuple(p[1] for p in pairs), spec.sweep(manifest.limits)[:8])
    assert result, result.failures()[:3]


@pytest.mark.parametrize("machine, flags, reduced", [
    ("x86_64", {"avx2", "avx512f", "avx512_vnni"}, False), ("x86_64", {"avx2", "avx_vnni"}, False),
    ("x86_64", {"avx2", "amx_int8"}, False), ("x86_64", {"avx2", "fma"}, True), ("aarch64", {"asimd"}, False),
])
def test_reduce_range_is_chosen_for_the_cpu(monkeypatch, machine, flags, reduced):
    """x86 without VNNI sums uint8 x int8 pairs in int16 (saturating with 8-bit weights): 7-bit weights there."""
    import platform

    from seq2trt.exporters import quantize

    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setattr(quantize, "_cpu_flags", lambda: flags)
    assert QuantizeSettings().resolved().reduce_range is reduced
    assert QuantizeSettings(reduce_range=False).resolved().reduce_range is False  # a choice given is kept
