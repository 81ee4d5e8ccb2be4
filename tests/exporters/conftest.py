"""Planted faults for the negative controls of test_onnx_export.py and test_fuse.py: each edits a plain exported
graph (an onnx ModelProto, in place) the way a real exporter or fuser bug would, and parity must fail on it.

- scale x1.1 in the cross-attention, the decoder self-attention or the encoder self-attention (the marked node's
  `scale` attribute, which the exported function computes with and the fuser copies);
- one head swapped: heads 0 and 1 of decoder layer 0's cross-attention query projection (weight columns and bias)
  trade places, so each attends with the other's keys;
- one bias shifted non-uniformly: decoder layer 0's second FFN bias + a ramp of +-0.05 (a uniform shift ahead of a
  LayerNorm would be invisible).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
import pytest
from onnx import numpy_helper


def _scale(op_type: str, factor: float = 1.1) -> Callable[[onnx.ModelProto, object], None]:
    def plant(proto, cfg):
        node = next(n for n in proto.graph.node if n.op_type == op_type)
        next(a for a in node.attribute if a.name == "scale").f *= factor
    return plant


def _initializer(proto: onnx.ModelProto, name: str) -> onnx.TensorProto:
    return next(i for i in proto.graph.initializer if i.name == name)


def _store(init: onnx.TensorProto, array: np.ndarray) -> None:
    init.CopyFrom(numpy_helper.from_array(array.astype(numpy_helper.to_array(init).dtype), init.name))


def _swap_heads(proto, cfg, bias: str = "model.decoder_layers.0.cross_attn.q_proj.bias") -> None:
    add = next(n for n in proto.graph.node if n.op_type == "Add" and bias in n.input)
    matmul = next(n for n in proto.graph.node if n.op_type == "MatMul" and set(add.input) & set(n.output))
    w, b = _initializer(proto, matmul.input[1]), _initializer(proto, bias)
    W, B = numpy_helper.to_array(w).copy(), numpy_helper.to_array(b).copy()
    h0, h1 = slice(0, cfg.head_dim), slice(cfg.head_dim, 2 * cfg.head_dim)
    W[:, h0], W[:, h1] = W[:, h1].copy(), W[:, h0].copy()
    B[h0], B[h1] = B[h1].copy(), B[h0].copy()
    _store(w, W)
    _store(b, B)


def _ramp_bias(proto, cfg, bias: str = "model.decoder_layers.0.ffn.fc2.bias", amplitude: float = 0.05) -> None:
    init = _initializer(proto, bias)
    values = numpy_helper.to_array(init).astype(np.float64)
    _store(init, values + amplitude * np.linspace(-1.0, 1.0, values.size))


# name -> (graph file it edits, plant(proto, cfg))
FAULTS: dict[str, tuple[str, Callable]] = {
    "cross-scale-x1.1": ("decoder.onnx", _scale("CrossAttention")),
    "decoder-self-scale-x1.1": ("decoder.onnx", _scale("DecoderSelfAttention")),
    "encoder-self-scale-x1.1": ("encoder.onnx", _scale("EncoderSelfAttention")),
    "one-head-swapped": ("decoder.onnx", _swap_heads),
    "bias-ramp-0.05": ("decoder.onnx", _ramp_bias),
}


@pytest.fixture(params=list(FAULTS))
def fault(request) -> tuple[str, str, Callable]:
    """(name, graph file, plant) of each planted fault."""
    return (request.param, *FAULTS[request.param])
