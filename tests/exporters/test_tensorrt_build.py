"""Engines built for real on CPU with TensorRT-RTX: plugin graphs of every kind, and TensorRT's own Attention op.

TensorRT-RTX compiles for named compute capabilities with no GPU (see docs/design.md, "Toolchain facts the code relies on"), so these
tests build genuine plans; only running them needs a GPU (tests/validation).
"""

from __future__ import annotations

import importlib.util
import json

import onnx
import pytest
from onnx import TensorProto, helper

from seq2trt.plugins.op import DOMAIN, INPUTS, OUTPUTS, PLUGIN_NAME, AttentionAttrs, AttentionKind
from seq2trt.core.errors import InputError

from helpers.cli import invoke

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None,
                                reason="tensorrt_rtx is not installed (pip install 'seq2trt[rtx]')")

ONNX_TYPES = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}
H, DH = 4, 32
LIMITS = {"batch": (1, 2, 4), "tgt_len": (1, 8, 32), "past_len": (0, 8, 64), "src_len": (1, 16, 48)}


def io_shapes(kind: AttentionKind) -> dict[str, list]:
    """Symbolic shapes of the op's inputs (op.py's layouts)."""
    new = ["batch", "src_len" if kind is AttentionKind.ENCODER_SELF else "tgt_len", H * DH]
    return {"query": new, "key": new, "value": new,
            "key_padding_mask": ["batch", "src_len"],
            "past_key": ["batch", H, "past_len", DH], "past_value": ["batch", H, "past_len", DH],
            "cross_key": ["batch", H, "src_len", DH], "cross_value": ["batch", H, "src_len", DH]}


def plugin_graph(path, kind: AttentionKind, dtype: str) -> dict:
    """Write a graph of one plugin node; return its profiles."""
    attrs = AttentionAttrs(kind, H, DH, DH ** -0.5)
    shapes = io_shapes(kind)
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT32 if n == "key_padding_mask" else ONNX_TYPES[dtype],
                                            shapes[n]) for n in INPUTS[kind]]
    outputs = [helper.make_tensor_value_info(n, ONNX_TYPES[dtype], None) for n in OUTPUTS[kind]]
    node = helper.make_node(PLUGIN_NAME, list(INPUTS[kind]), list(OUTPUTS[kind]), domain=DOMAIN,
                            **attrs.onnx_attributes())
    model = helper.make_model(helper.make_graph([node], f"plugin_{kind.name}", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])
    onnx.save(model, path)
    return {n: profile(shapes[n]) for n in INPUTS[kind]}


def profile(shape: list) -> tuple:
    return tuple(tuple(LIMITS[d][k] if isinstance(d, str) else d for d in shape) for k in range(3))


@pytest.fixture(scope="module")
def build():
    """`build` with one child process for the module's builds (starting one takes seconds)."""
    import functools

    from seq2trt.exporters.tensorrt.build import build
    from seq2trt.exporters.tensorrt.child import BuildChild

    with BuildChild() as child:
        yield functools.partial(build, child=child)


@pytest.mark.parametrize("kind", list(AttentionKind))
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_plugin_graph_builds_an_engine(tmp_path, monkeypatch, kind, dtype):
    from seq2trt.exporters.tensorrt.build import build_in_process as build  # in process: the plugin is watched
    from seq2trt.plugins import tensorrt_plugin

    asked = []
    size = tensorrt_plugin.workspace_bytes
    monkeypatch.setattr(tensorrt_plugin, "workspace_bytes", lambda *a: asked.append(a) or size(*a))
    path = tmp_path / "plugin.onnx"
    profiles = plugin_graph(path, kind, dtype)
    phases = []
    result = build(path, profiles, "sm_86", dtype, progress=lambda phase, done, total: phases.append(phase))
    assert asked and all(a[1] == LIMITS["batch"][2] for a in asked)  # sized at max batch
    assert len(result.plan) > 1000
    assert PLUGIN_NAME.encode() in result.plan  # the plugin and its fields are serialized into the plan
    assert result.network.plugin_layers == 1 and result.network.layer_types == {"PLUGIN_V3": 1}
    assert result.targets == (86,)
    trt_type = {"fp32": "FLOAT", "fp16": "HALF"}[dtype]
    assert [o["dtype"] for o in result.network.outputs.values()] == [trt_type] * len(OUTPUTS[kind])
    assert "Building engine" in phases


def test_bf16_plugin_graph_for_two_targets(tmp_path, build):
    path = tmp_path / "plugin.onnx"
    profiles = plugin_graph(path, AttentionKind.DECODER_SELF, "bf16")
    result = build(path, profiles, "sm_86,sm_89", "bf16")
    assert result.targets == (86, 89) and result.network.plugin_layers == 1


def attention_graph(path, dtype: str) -> dict:
    """The standard opset-23 ONNX `Attention` op, (B, H, L, Dh) inputs, with a boolean mask: no plugin."""
    shape = ["batch", H, "src_len", DH]
    inputs = [helper.make_tensor_value_info(n, ONNX_TYPES[dtype], shape) for n in ("q", "k", "v")]
    inputs.append(helper.make_tensor_value_info("mask", TensorProto.BOOL, ["batch", 1, "src_len", "src_len"]))
    node = helper.make_node("Attention", ["q", "k", "v", "mask"], ["out"], scale=DH ** -0.5)
    model = helper.make_model(helper.make_graph([node], "attention", inputs,
                                                [helper.make_tensor_value_info("out", ONNX_TYPES[dtype], None)]),
                              opset_imports=[helper.make_opsetid("", 23)])
    onnx.save(model, path)
    profiles = {n: profile(shape) for n in ("q", "k", "v")}
    profiles["mask"] = profile(["batch", 1, "src_len", "src_len"])
    return profiles


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_standard_attention_op_builds_without_plugin(tmp_path, build, dtype):
    from seq2trt.exporters.tensorrt.build import BuildSettings

    path = tmp_path / "attention.onnx"
    profiles = attention_graph(path, dtype)
    result = build(path, profiles, "sm_86", dtype, BuildSettings(plugin=False))
    assert result.network.plugin_layers == 0 and result.network.attention_layers == 1
    assert PLUGIN_NAME.encode() not in result.plan
    assert len(result.plan) > 1000


def test_refusals(tmp_path, build):
    from seq2trt.exporters.tensorrt.build import BuildSettings

    path = tmp_path / "plugin.onnx"
    profiles = plugin_graph(path, AttentionKind.CROSS, "fp16")
    with pytest.raises(InputError, match="fp16 graph, not fp32.*re-export"):
        build(path, profiles, "sm_86", "fp32")
    with pytest.raises(InputError, match=r"dynamic inputs \['query'\] without an optimization profile"):
        build(path, {k: v for k, v in profiles.items() if k != "query"}, "sm_86")
    with pytest.raises(InputError, match="min <= opt <= max"):
        build(path, {**profiles, "query": ((4, 1, 128), (2, 8, 128), (4, 32, 128))}, "sm_86")
    with pytest.raises(InputError, match="cannot target sm_90"):
        build(path, profiles, "sm_90")
    with pytest.raises(InputError, match="plugin is disabled"):
        build(path, profiles, "sm_86", settings=BuildSettings(plugin=False))
    with pytest.raises(InputError, match="plugin needs .* MiB of workspace at batch 4"):
        build(path, profiles, "sm_86", settings=BuildSettings(workspace_limit=1024))


# --- the build stage on a real export of a tiny model ------------------------------------------------------------

@pytest.fixture(scope="module", params=["fp32", "fp16"])
def export_dir(request, tmp_path_factory):
    """A tiny model exported and fused for TensorRT, as `seq2trt export` and `seq2trt fuse --target trt` do."""
    import torch

    from seq2trt.exporters import spec
    from seq2trt.exporters.fuse import Target, fuse_artifacts
    from seq2trt.exporters.onnx_export import export
    from seq2trt.reference_model.config import preset
    from seq2trt.reference_model.model import Seq2SeqTransformer

    torch.manual_seed(0)
    # one head of 32: a head_dim the plugin's kernels take (build refuses the others)
    model = Seq2SeqTransformer(preset("tiny", src_vocab_size=24, tgt_vocab_size=24, num_heads=1)).eval()
    out = export(model, tmp_path_factory.mktemp("export") / "art", dtype=request.param,
                 limits=spec.Limits(4, 32, 32))
    fuse_artifacts(out, Target.TRT)
    return out, request.param, model.cfg


@pytest.mark.parametrize("plugin", [True, False])
def test_build_stage_writes_engines_and_build_json(export_dir, plugin, caplog):
    import json
    import logging

    from seq2trt.exporters.tensorrt.engines import EngineRequest, build_engines, read_build

    out, dtype, cfg = export_dir
    with caplog.at_level(logging.INFO, logger="seq2trt"):
        engine_dir = build_engines(out, EngineRequest("tensorrt-rtx", (86,), plugin=plugin, force=True))
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []  # expected noise is quiet
    suffix = "" if plugin else "-noplugin"
    assert engine_dir == out / "engines" / f"tensorrt-rtx-sm_86-{dtype}{suffix}"
    assert sorted(p.name for p in engine_dir.iterdir()) == ["build.json", "decoder.plan", "encoder.plan"]
    info = read_build(engine_dir)
    assert info == json.loads((engine_dir / "build.json").read_text())
    assert info["flavour"] == "tensorrt-rtx" and info["targets"] == [86] and info["dtype"] == dtype
    expected_plugins = {"encoder": cfg.num_encoder_layers, "decoder": 2 * cfg.num_decoder_layers} if plugin \
        else {"encoder": 0, "decoder": 0}
    assert info["plugin"]["layers"] == expected_plugins  # every attention block is one plugin layer
    decoder = info["graphs"]["decoder"]
    assert decoder["profiles"]["past_key_values.0.decoder.key"][0][2] == 0  # past_len 0 ...
    assert decoder["profiles"]["past_key_values.0.decoder.key"][2][2] == 31  # ... to max_tgt_len - 1
    for graph in info["graphs"].values():
        assert graph["plan_bytes"] == (engine_dir / graph["plan"]).stat().st_size > 10_000
        assert graph["build_seconds"] > 0
        if plugin:
            assert graph["source"].startswith("fused/trt/")


def test_build_stage_refuses_tampering_overwrite_and_dtype(export_dir):
    from seq2trt.exporters.tensorrt.engines import EngineRequest, build_engines
    from seq2trt.core.errors import ArtifactError

    out, dtype, _ = export_dir
    other = "fp16" if dtype == "fp32" else "fp32"
    with pytest.raises(InputError, match=f"exported as {dtype}"):
        build_engines(out, EngineRequest("tensorrt-rtx", (89,), dtype=other))
    engine_dir = build_engines(out, EngineRequest("tensorrt-rtx", (89,), force=True))
    before = {p.name: p.read_bytes() for p in engine_dir.iterdir()}
    with pytest.raises(ArtifactError, match="already exists; pass --force"):
        build_engines(out, EngineRequest("tensorrt-rtx", (89,)))
    fused = out / "fused" / "trt" / "decoder.onnx"
    original = fused.read_bytes()
    fused.write_bytes(original + b"\0")
    try:
        with pytest.raises(ArtifactError, match="decoder.onnx does not match its sha256"):
            build_engines(out, EngineRequest("tensorrt-rtx", (89,), force=True))
    finally:
        fused.write_bytes(original)
    assert {p.name: p.read_bytes() for p in engine_dir.iterdir()} == before  # a failed --force keeps the old engines


def test_cli_build(export_dir):
    out, dtype, _ = export_dir
    result = invoke("build", out, "--target", "sm_80", "--max-batch", "2", "--force")
    assert result.exit_code == 0, result.output
    engine_dir = out / "engines" / f"tensorrt-rtx-sm_80-{dtype}"
    assert (engine_dir / "decoder.plan").exists()
    info = json.loads((engine_dir / "build.json").read_text())
    assert info["limits"]["max_batch"] == 2  # --max-batch 2 reached the profiles: every max shape has batch 2
    for graph in info["graphs"].values():
        assert {shapes[2][0] for shapes in graph["profiles"].values()} == {2}, graph["profiles"]
    bad = invoke("build", out, "--target", "sm_90")
    assert bad.exit_code == 2 and "cannot target sm_90" in bad.output
    if importlib.util.find_spec("tensorrt") is None:  # enterprise TensorRT: a clear error naming the extra
        from seq2trt.exporters.tensorrt.engines import EngineRequest, build_engines
        from seq2trt.core.errors import DependencyError

        with pytest.raises(DependencyError, match=r"pip install 'seq2trt\[trt\]'"):
            build_engines(out, EngineRequest("tensorrt", ("current",)))
        missing = invoke("build", out, "--backend", "tensorrt")
        assert missing.exit_code == 2 and "`tensorrt` module, which is not importable" in missing.output
