"""Export: the graphs keep the contract (names, dynamic axes, no control flow, every attention block marked),
and ONNX Runtime matches the float64 eager model over the spec's whole sweep in every dtype."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from seq2trt.exporters import spec
from seq2trt.exporters.manifest import MANIFEST, read_manifest, verify
from seq2trt.exporters.onnx_export import export, export_copy, marked_core
from seq2trt.plugins.op import AttentionAttrs
from seq2trt.core.errors import ArtifactError
from seq2trt.reference_model.model import MultiHeadAttention, attention_core
from seq2trt.reference_model.sources import ordinary_ids
from seq2trt.validation.parity import graph_parity
from seq2trt.validation.precision import judge_for
from seq2trt.runtime.runners import EagerRunner, OrtRunner


@pytest.fixture(scope="module")
def model(make_model):
    return make_model(seed=1, dtype=torch.float32)


@pytest.fixture(scope="module")
def exports(model, tmp_path_factory):
    """dtype -> export directory, each exported once per module."""
    done = {}

    def get(dtype: str):
        if dtype not in done:
            done[dtype] = export(model, tmp_path_factory.mktemp("export") / "out", dtype=dtype)
        return done[dtype], dtype

    return get


@pytest.fixture(params=["fp32", "fp16", "bf16"])
def exported(request, exports):
    """(export dir, dtype) in each dtype, without a checkpoint: these tests judge the graphs the exporter writes."""
    return exports(request.param)


def _dims(value: onnx.ValueInfoProto) -> list:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def test_graph_io_follows_the_spec_with_named_dynamic_axes(exported, model):
    out, dtype = exported
    cfg = model.cfg
    for kind in spec.GraphKind:
        proto = onnx.load(out / kind.filename)
        assert [v.name for v in proto.graph.input] == [s.name for s in spec.inputs(cfg, kind)]
        assert [v.name for v in proto.graph.output] == [s.name for s in spec.outputs(cfg, kind)]
        for value, s in zip(list(proto.graph.input) + list(proto.graph.output),
                            spec.inputs(cfg, kind) + spec.outputs(cfg, kind)):
            dims = _dims(value)
            for axis, dim in zip(s.axes, dims):
                if isinstance(axis, int):
                    assert dim == axis, (s.name, dims)
                else:  # an example size must never have frozen an axis into a number
                    assert isinstance(dim, str), (s.name, dims)
            if s.dtype == "float":
                assert value.type.tensor_type.elem_type == spec.DTYPES[dtype][1]
    decoder = onnx.load(out / "decoder.onnx")
    assert _dims(decoder.graph.input[-1]) == ["batch", cfg.num_heads, "past_len", cfg.head_dim]


def test_no_control_flow_and_every_block_marked(exported, model):
    out, _ = exported
    cfg = model.cfg
    for kind in spec.GraphKind:
        proto = onnx.load(out / kind.filename)
        all_nodes = list(proto.graph.node) + [n for f in proto.functions for n in f.node]
        assert not {"If", "Loop", "Scan"} & {n.op_type for n in all_nodes}
        marked = [n for n in proto.graph.node if n.domain == spec.MARKED_DOMAIN]
        kinds = {}
        for node in marked:
            attrs = AttentionAttrs.from_onnx({a.name: onnx.helper.get_attribute_value(a) for a in node.attribute})
            assert node.op_type == spec.MARKED_OP_TYPES[attrs.kind]
            assert (attrs.num_heads, attrs.head_dim) == (cfg.num_heads, cfg.head_dim)
            assert attrs.scale == pytest.approx(cfg.head_dim ** -0.5)
            kinds[attrs.kind] = kinds.get(attrs.kind, 0) + 1
        assert kinds == spec.expected_blocks(cfg, kind)
        want_names = {spec.block_name(k, i) for k, n in spec.expected_blocks(cfg, kind).items() for i in range(n)}
        assert {n.name for n in marked} == want_names
        assert {f.name for f in proto.functions} >= {spec.MARKED_OP_TYPES[k] for k in kinds}


def test_marked_inputs_are_in_the_fused_op_layout(exported, model):
    out, _ = exported
    cfg = model.cfg
    proto = onnx.shape_inference.infer_shapes(onnx.load(out / "decoder.onnx"))
    shapes = {v.name: _dims(v) for v in list(proto.graph.value_info) + list(proto.graph.input)}
    for node in (n for n in proto.graph.node if n.domain == spec.MARKED_DOMAIN):
        assert shapes[node.input[0]][-1] == cfg.d_model  # query (B, T, D)
        if node.op_type == "CrossAttention":
            assert node.input[1].startswith("past_key_values.") and ".encoder." in node.input[1]
        if node.op_type == "DecoderSelfAttention":
            assert node.input[3].endswith(".decoder.key") and node.output[1].startswith("present.")


def test_ort_matches_float64_eager_over_the_sweep(exported, model):
    out, dtype = exported
    manifest = verify(out)
    limits, cfg = manifest.limits, model.cfg
    reference = _double(model)
    judge, options = judge_for(dtype, {k: out / k.filename for k in spec.GraphKind}, cfg, limits, model, {})
    candidates = tuple(OrtRunner(out / k.filename, cfg, k, dtype, limits, **options) for k in spec.GraphKind)
    references = tuple(EagerRunner(reference, k, limits) for k in spec.GraphKind)
    with contextlib.ExitStack() as stack:
        for r in candidates + references:
            stack.enter_context(r)
        result = graph_parity(candidates, references, spec.sweep(limits), judge=judge)
    assert result, result.failures()
    labels = {c.case for c in result.cases}
    assert any("-P0" in label and label.startswith("B1-") for label in labels)
    assert any(f"-P{cfg.max_tgt_len - 1}" in label for label in labels)
    if dtype == "fp32":
        logits = result.summary()["decoder"]["logits"]
        assert logits["max_abs"] < 1e-4 and logits["min_cosine"] > 0.999999


def _double(model):
    import copy

    return copy.deepcopy(model).double()


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_parity_catches_a_wrong_graph(exports, model, tmp_path, dtype, fault):
    """Negative controls: each planted fault (tests/exporters/conftest.py: attention scale x1.1 in the cross, the
    decoder self or the encoder self attention, one head swapped, one bias ramped) must fail parity in every dtype
    as validation/precision.py judges it — the clean graphs pass in test_ort_matches_float64_eager_over_the_sweep."""
    name, filename, plant = fault
    out, _ = exports(dtype)
    proto = onnx.load(out / filename)
    plant(proto, model.cfg)
    onnx.save(proto, tmp_path / filename)
    limits = read_manifest(out).limits
    paths = {k: tmp_path / k.filename if k.filename == filename else out / k.filename for k in spec.GraphKind}
    judge, options = judge_for(dtype, paths, model.cfg, limits, model, {})
    candidates = tuple(OrtRunner(paths[k], model.cfg, k, dtype, limits, **options) for k in spec.GraphKind)
    references = tuple(EagerRunner(_double(model), k, limits) for k in spec.GraphKind)
    with contextlib.ExitStack() as stack:
        for r in candidates + references:
            stack.enter_context(r)
        result = graph_parity(candidates, references, control_cases(limits), judge=judge)
    graph = filename.split(".")[0]
    assert not result, f"{name} passed {dtype} parity"
    assert all(f.startswith(graph) for f in result.failures()), result.failures()


def control_cases(limits):
    """A slice of the sweep (the controls need one failing case; the clean graphs are swept in full)."""
    return [c for c in spec.sweep(limits) if c.src_len > 1][:4]


def test_marking_is_confined_to_the_export_copy(model):
    copied = export_copy(model, "fp32")
    blocks = lambda m: [b for b in m.modules() if isinstance(b, MultiHeadAttention)]
    assert blocks(copied) and all(b.core is marked_core for b in blocks(copied))
    assert all(b.core is attention_core for b in blocks(model))  # the user's model still computes attention
    assert [b.kind for b in blocks(copied)] == [b.kind for b in blocks(model)]


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_the_export_copy_holds_no_second_fp32_copy_of_the_weights(make_model, dtype):
    """The memory of an export is the model plus its weights in the export dtype: an fp32 copy shares every
    weight with the model; an fp16/bf16 copy holds only narrow weights of its own (the LayerNorms and an audio
    front end excepted: kept fp32 on purpose), equal to `.to(dtype)` of the model's, while the model keeps its fp32
    weights untouched; a tied embedding stays one tensor."""
    model = make_model(seed=2, dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    copied = export_copy(model, dtype)
    ours = {t.data_ptr() for t in (*model.parameters(), *model.buffers())}
    norms = {id(t) for m in copied.modules() if type(m).__name__ in ("Float32LayerNorm", "Float32FrontEnd")
             for t in (*m.parameters(), *m.buffers())}
    narrow = spec.DTYPES[dtype][0]
    for name, tensor in (*copied.named_parameters(), *copied.named_buffers()):
        if not tensor.is_floating_point() or id(tensor) in norms:
            continue
        if dtype == "fp32":
            assert tensor.data_ptr() in ours, name
        else:
            assert str(tensor.dtype).removeprefix("torch.") == narrow and tensor.data_ptr() not in ours, name
    if dtype != "fp32":
        state = model.state_dict()
        for name, tensor in copied.state_dict().items():
            if tensor.dtype == getattr(torch, narrow) and name in state:
                assert torch.equal(tensor, state[name].to(tensor.dtype)), name
    assert all(torch.equal(v, before[k]) and v.dtype == torch.float32 for k, v in model.state_dict().items())
    if model.cfg.tie_embeddings:
        assert copied.lm_head.weight is copied.tgt_embed.weight


def test_existing_output_is_refused_without_force(exports, model):
    out, dtype = exports("fp32")
    before = (out / MANIFEST).read_bytes()
    with pytest.raises(ArtifactError, match="--force"):
        export(model, out, dtype=dtype)
    assert (out / MANIFEST).read_bytes() == before


def test_manifest_detects_tampering(exports, tmp_path):
    out, dtype = exports("fp16")
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    assert verify(copy).dtype == "fp16"
    data = bytearray((copy / "decoder.onnx").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (copy / "decoder.onnx").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="decoder.onnx does not match its sha256"):
        verify(copy)
    (copy / "encoder.onnx").unlink()
    with pytest.raises(ArtifactError, match="encoder.onnx is missing"):
        verify(copy)


@pytest.mark.parametrize("broken", [False, True], ids=["clean", "cross-scale-x1.1"])
def test_polygraphy_compares_the_decoder_with_eager(exports, model, tmp_path, broken):
    """polygraphy run with two result sets: ONNX Runtime, and the float64 eager model's outputs (--load-outputs) on
    the same inputs (--load-inputs), compared at the fp32 target; a decoder with a wrong scale must FAIL."""
    from polygraphy.comparator import RunResults
    from polygraphy.json import save_json

    out, dtype = exports("fp32")
    cfg, rng = model.cfg, np.random.default_rng(0)
    path = out / "decoder.onnx"
    if broken:
        proto = onnx.load(path)
        node = next(n for n in proto.graph.node if n.op_type == "CrossAttention")
        next(a for a in node.attribute if a.name == "scale").f *= 1.1
        path = tmp_path / "decoder.onnx"
        onnx.save(proto, path)
    tgt_ids = ordinary_ids(cfg, cfg.tgt_vocab_size)
    feed = {"input_ids": tgt_ids[rng.integers(0, tgt_ids.size, (2, 1))],
            "encoder_attention_mask": np.array([[1] * 5, [1, 1, 1, 0, 0]], np.int64)}
    for s in spec.inputs(cfg, spec.GraphKind.DECODER)[2:]:
        length = 5 if spec.parse_kv_name(s.name).side == "encoder" else 3
        feed[s.name] = rng.standard_normal((2, cfg.num_heads, length, cfg.head_dim)).astype(np.float32)
    with EagerRunner(_double(model), spec.GraphKind.DECODER) as eager:
        want = {k: v.astype(np.float32) for k, v in eager.infer(feed).items()}
    save_json([feed], tmp_path / "inputs.json")
    results = RunResults()
    results.add([want], runner_name="eager-float64")
    results.save(str(tmp_path / "eager.json"))
    polygraphy = Path(sys.executable).parent / "polygraphy"  # this environment's, activated or not
    cmd = (f"{polygraphy} run {path} --onnxrt --load-inputs {tmp_path / 'inputs.json'} "
           f"--load-outputs {tmp_path / 'eager.json'} --atol 1e-4 --rtol 1e-4")
    done = subprocess.run(cmd.split(), capture_output=True, text=True, timeout=240)
    log = done.stdout + done.stderr
    assert "eager-float64" in log and "logits" in log, log[-2000:]  # a comparison ran, against the eager outputs
    if broken:
        assert done.returncode != 0 and "FAILED" in log, log[-2000:]
    else:
        assert done.returncode == 0 and "PASSED" in log, log[-2000:]


def test_the_reused_torchlib_registry_changes_no_graph(make_model, monkeypatch):
    """onnx_export traces with one torchlib registry copied per export (torch_cache.reused_torchlib_registry):
    byte for byte the graph torch.onnx.export builds with a registry of its own, and the patch is undone after."""
    from torch.onnx._internal.exporter import _registration

    from seq2trt.exporters import onnx_export

    model = make_model(seed=7, dtype=torch.float32)
    original = _registration.ONNXRegistry.__dict__["from_torchlib"]
    reused = onnx_export.trace(model, spec.GraphKind.ENCODER, spec.DEFAULT_OPSET)
    assert _registration.ONNXRegistry.__dict__["from_torchlib"] is original
    monkeypatch.setattr(onnx_export, "reused_torchlib_registry", contextlib.nullcontext)
    fresh = onnx_export.trace(model, spec.GraphKind.ENCODER, spec.DEFAULT_OPSET)
    assert reused.SerializeToString() == fresh.SerializeToString()
