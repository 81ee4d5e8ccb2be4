"""Engines built for real on CPU with TensorRT-RTX: plugin graphs of every kind, and TensorRT's own Attention op.

TensorRT-RTX compiles for named compute capabilities with no GPU (see DESIGN.md "Toolchain facts"), so these
tests build genuine plans; only running them needs a GPU (tests/validation).
"""

from __future__ import annotations

import importlib.util

import onnx
import pytest
from onnx import TensorProto, helper

from seq2trt.plugins.op import DOMAIN, INPUTS, OUTPUTS, PLUGIN_NAME, AttentionAttrs, AttentionKind
from seq2trt.reference_model.errors import InputError

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
    from seq2trt.exporters.tensorrt_build import build

    return build


@pytest.mark.parametrize("kind", list(AttentionKind))
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_plugin_graph_builds_an_engine(tmp_path, build, kind, dtype):
    path = tmp_path / "plugin.onnx"
    profiles = plugin_graph(path, kind, dtype)
    phases = []
    result = build(path, profiles, "sm_86", dtype, progress=lambda phase, done, total: phases.append(phase))
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
    from seq2trt.exporters.tensorrt_build import BuildSettings

    path = tmp_path / "attention.onnx"
    profiles = attention_graph(path, dtype)
    result = build(path, profiles, "sm_86", dtype, BuildSettings(plugin=False))
    assert result.network.plugin_layers == 0 and result.network.attention_layers == 1
    assert PLUGIN_NAME.encode() not in result.plan
    assert len(result.plan) > 1000


def test_refusals(tmp_path, build):
    from seq2trt.exporters.tensorrt_build import BuildSettings

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
