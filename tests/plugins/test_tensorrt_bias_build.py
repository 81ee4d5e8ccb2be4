"""TensorRT-RTX engines (built for real on CPU) from plugin graphs whose attention node takes T5's position bias.

The bias is the op's optional last input (`plugins.op.input_names(kind, position_bias=True)`), (H, 2M - 1) in the
query's dtype: either a constant table in the graph (how an export computes it from the model's weights) or a graph
input. The plugin must accept the extra input (its formats, its shapes) and the plan must hold one plugin layer.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from seq2trt.plugins.op import DOMAIN, OUTPUTS, PLUGIN_NAME, POSITION_BIAS, AttentionAttrs, AttentionKind, input_names

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None,
                                reason="tensorrt_rtx is not installed (pip install 'seq2trt[rtx]')")

ONNX_TYPES = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}
H, DH, M = 4, 64, 64  # T5's head_dim; M covers every position the profiles reach
LIMITS = {"batch": (1, 2, 4), "tgt_len": (1, 8, 16), "past_len": (0, 8, 32), "src_len": (1, 16, 48)}


def io_shapes(kind: AttentionKind) -> dict[str, list]:
    new = ["batch", "src_len" if kind is AttentionKind.ENCODER_SELF else "tgt_len", H * DH]
    return {"query": new, "key": new, "value": new, "key_padding_mask": ["batch", "src_len"],
            "past_key": ["batch", H, "past_len", DH], "past_value": ["batch", H, "past_len", DH],
            POSITION_BIAS: [H, 2 * M - 1]}


def profile(shape: list) -> tuple:
    return tuple(tuple(LIMITS[d][k] if isinstance(d, str) else d for d in shape) for k in range(3))


def bias_plugin_graph(path, kind: AttentionKind, dtype: str, constant: bool) -> dict:
    """A graph of one plugin node with a position bias; returns its profiles."""
    attrs = AttentionAttrs(kind, H, DH, 1.0)  # T5 scales no scores
    names = input_names(kind, position_bias=True)
    shapes = io_shapes(kind)
    graph_inputs = [n for n in names if not (constant and n == POSITION_BIAS)]
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT32 if n == "key_padding_mask" else ONNX_TYPES[dtype],
                                            shapes[n]) for n in graph_inputs]
    initializers = []
    if constant:
        table = np.random.default_rng(0).normal(0, 2, (H, 2 * M - 1)).astype(np.float32)
        if dtype == "bf16":  # numpy has no bf16: the tensor's raw bits, the top halves of the fp32 values
            tensor = helper.make_tensor(POSITION_BIAS, TensorProto.BFLOAT16, table.shape,
                                        (table.view(np.uint32) >> 16).astype(np.uint16).tobytes(), raw=True)
        else:
            tensor = numpy_helper.from_array(table.astype({"fp32": np.float32, "fp16": np.float16}[dtype]),
                                             POSITION_BIAS)
        initializers.append(tensor)
    outputs = [helper.make_tensor_value_info(n, ONNX_TYPES[dtype], None) for n in OUTPUTS[kind]]
    node = helper.make_node(PLUGIN_NAME, list(names), list(OUTPUTS[kind]), domain=DOMAIN, **attrs.onnx_attributes())
    model = helper.make_model(helper.make_graph([node], f"plugin_bias_{kind.name}", inputs, outputs, initializers),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])
    onnx.save(model, path)
    return {n: profile(shapes[n]) for n in graph_inputs}


@pytest.mark.parametrize("kind,dtype,constant", [
    (AttentionKind.ENCODER_SELF, "fp16", True), (AttentionKind.DECODER_SELF, "fp16", True),
    (AttentionKind.DECODER_SELF, "fp32", False), (AttentionKind.ENCODER_SELF, "bf16", False)])
def test_plugin_graph_with_a_bias_builds_an_engine(tmp_path, kind, dtype, constant):
    from seq2trt.exporters.tensorrt.build import build_in_process as build  # in process: the plugin is watched
    from seq2trt.plugins import tensorrt_plugin

    seen = []
    plugin_class = tensorrt_plugin.plugin_classes(__import__("tensorrt_rtx"))[0]
    original = plugin_class.supports_format_combination

    def watched(self, pos, in_out, num_inputs):
        seen.append(num_inputs)
        return original(self, pos, in_out, num_inputs)

    plugin_class.supports_format_combination = watched
    try:
        path = tmp_path / "plugin.onnx"
        result = build(path, bias_plugin_graph(path, kind, dtype, constant), "sm_86", dtype)
    finally:
        plugin_class.supports_format_combination = original
    assert seen and set(seen) == {len(input_names(kind, position_bias=True))}  # the bias reached the plugin
    assert len(result.plan) > 1000 and PLUGIN_NAME.encode() in result.plan
    assert result.network.plugin_layers == 1
    trt_type = {"fp32": "FLOAT", "fp16": "HALF", "bf16": "BF16"}[dtype]
    assert [o["dtype"] for o in result.network.outputs.values()] == [trt_type] * len(OUTPUTS[kind])


def test_plugin_refuses_a_bias_of_another_dtype():
    """The bias takes the query's dtype: an fp32 table beside fp16 queries is no format combination."""
    import tensorrt_rtx as trt

    from seq2trt.plugins import tensorrt_plugin

    plugin = tensorrt_plugin.plugin_classes(trt)[0](AttentionAttrs(AttentionKind.DECODER_SELF, H, DH, 1.0))

    def desc(dtype):
        d = trt.DynamicPluginTensorDesc()
        d.desc.type, d.desc.format = dtype, trt.TensorFormat.LINEAR
        return d

    in_out = [desc(trt.float16)] * 5 + [desc(trt.float32)] + [desc(trt.float16)] * 3
    assert all(plugin.supports_format_combination(pos, in_out, 6) for pos in range(5))
    assert not plugin.supports_format_combination(5, in_out, 6)
    assert not plugin.supports_format_combination(0, in_out[:4] + in_out[6:], 7)  # 7 inputs: the op takes 5 or 6
