"""A damaged plugin graph run on CPU (plugins/plugin_cpu.py) ends in an error or a failed check, never in the
process's end: onnxruntime-extensions lets a Python op's exception escape its kernel (std::terminate), which the
fuzz (tests/reliability/test_fuzz_graphs.py, seeds 105, 107, 113 before this) met as a cross-attention node whose
`kind` had become encoder self-attention."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from seq2trt.plugins.op import DOMAIN, INPUTS, OUTPUTS, PLUGIN_NAME, AttentionAttrs, AttentionKind
from seq2trt.plugins.plugin_cpu import for_cpu, register_reference_ops
from seq2trt.core.errors import ArtifactError

B, T, L, H, DH = 2, 3, 5, 2, 4


def cross_graph(kind_attr: AttentionKind) -> bytes:
    """One cross-attention plugin node (query, cross K/V, mask -> output) whose `kind` attribute says `kind_attr`."""
    attrs = AttentionAttrs(AttentionKind.CROSS, H, DH, DH ** -0.5).onnx_attributes() | {"kind": int(kind_attr)}
    node = helper.make_node(PLUGIN_NAME, list(INPUTS[AttentionKind.CROSS]), list(OUTPUTS[AttentionKind.CROSS]),
                            name="cross", domain=DOMAIN, **attrs)
    shapes = {"query": [B, T, H * DH], "cross_key": [B, H, L, DH], "cross_value": [B, H, L, DH],
              "key_padding_mask": [B, L]}
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT32 if n == "key_padding_mask" else TensorProto.FLOAT,
                                            shapes[n]) for n in INPUTS[AttentionKind.CROSS]]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in OUTPUTS[AttentionKind.CROSS]]
    model = helper.make_model(helper.make_graph([node], "block", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)])
    model.ir_version = 10
    return model.SerializeToString()


def run(data: bytes) -> np.ndarray:
    options = ort.SessionOptions()
    options.register_custom_ops_library(register_reference_ops())
    session = ort.InferenceSession(for_cpu(data, "fp32"), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feed = {"query": rng.standard_normal((B, T, H * DH), np.float32),
            "cross_key": rng.standard_normal((B, H, L, DH), np.float32),
            "cross_value": rng.standard_normal((B, H, L, DH), np.float32),
            "key_padding_mask": np.ones((B, L), np.int32)}
    return session.run(None, feed)[0]


def test_the_intact_node_runs():
    assert np.isfinite(run(cross_graph(AttentionKind.CROSS))).all()


def test_a_kind_of_the_same_arity_gives_nan_not_an_abort(caplog):
    """Encoder self-attention takes four inputs too: its reference cannot unpack 4-D keys. The op's outputs are NaN
    (validation then fails on them) and the error is logged."""
    out = run(cross_graph(AttentionKind.ENCODER_SELF))
    assert out.shape == (B, T, H * DH) and np.isnan(out).all()
    assert "reference op failed" in caplog.text


def test_a_kind_of_another_arity_is_refused_before_running():
    with pytest.raises(ArtifactError, match="DECODER_SELF, which takes 5 inputs .* but it has 4 and 1"):
        for_cpu(cross_graph(AttentionKind.DECODER_SELF), "fp32")
