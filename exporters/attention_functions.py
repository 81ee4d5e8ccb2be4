"""Bodies of the marked attention nodes: one ONNX local function per kind, in standard ops.

They compute exactly `plugins.op.reference_attention` (scaled dot-product attention, 3.2.1 of Vaswani et al.):
heads split from (B, T, D), scores and softmax in fp32 whatever the graph's dtype, masked keys set to the
lowest fp32 (not -inf, so a row with no allowed key stays finite, as in the eager model), output back in the
query's dtype as (B, T, D). The decoder self-attention appends the new K/V to the past and is causal with
query i at absolute position past_len + i. The attributes come from the node (`num_heads`, `scale`; `kind`
and `head_dim` are carried for the fuser), so the same function serves every model.

A self-attention block with a relative position bias (T5) is a node of the biased variant (`marked_op_type`), whose
last input is the op's `position_bias` (H, 2M - 1) by signed distance: `bias_by_distance` gathers its columns
M - 1 + key - query position into the scores' (H, T, L) bias, the query positions starting at the past length.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto
from onnx import helper as h

from seq2trt.plugins.op import (ATTRIBUTES, LOWEST_FP32, OPTIONAL_INPUTS, OUTPUTS, POSITION_BIAS, AttentionKind,
                                input_names)

from seq2trt.exporters import spec


BIASED_SUFFIX = "WithPositionBias"


def marked_op_type(kind: AttentionKind, biased: bool = False) -> str:
    """The marked node's op_type: the kind's (`spec.MARKED_OP_TYPES`), or its variant taking a position bias."""
    return spec.MARKED_OP_TYPES[kind] + (BIASED_SUFFIX if biased else "")


def marked_kind(op_type: str) -> tuple[AttentionKind, bool] | None:
    """(kind, biased) of a marked node's op_type; None for any other op_type."""
    for kind in AttentionKind:
        for biased in (False, True):
            if op_type == marked_op_type(kind, biased):
                return kind, biased
    return None


def bias_by_distance(bias: str, q_pos: str, k_pos: str, out: str, prefix: str = "") -> list[onnx.NodeProto]:
    """`out` (H, T, L) = `bias` (H, 2M - 1)[:, M - 1 + k_pos[j] - q_pos[i]] from positions q_pos (T,), k_pos (L,)
    int64: one Gather of the bias columns by signed distance (M from the bias's width). `prefix` keeps the
    intermediate names apart when the nodes go into a graph rather than a function body."""
    n = lambda name: f"{prefix}{name}"
    return [h.make_node("Shape", [bias], [n("bias_width")], start=1, end=2),
            h.make_node("Constant", [], [n("bias_one")], value_ints=[1]),
            h.make_node("Constant", [], [n("bias_two")], value_ints=[2]),
            h.make_node("Sub", [n("bias_width"), n("bias_one")], [n("bias_twice_offset")]),
            h.make_node("Div", [n("bias_twice_offset"), n("bias_two")], [n("bias_offset")]),  # (1,): M - 1
            h.make_node("Constant", [], [n("bias_axis0")], value_ints=[0]),
            h.make_node("Constant", [], [n("bias_axis1")], value_ints=[1]),
            h.make_node("Unsqueeze", [k_pos, n("bias_axis0")], [n("bias_k_row")]),  # (1, L)
            h.make_node("Unsqueeze", [q_pos, n("bias_axis1")], [n("bias_q_col")]),  # (T, 1)
            h.make_node("Sub", [n("bias_k_row"), n("bias_q_col")], [n("bias_distance")]),  # (T, L): key - query
            h.make_node("Add", [n("bias_distance"), n("bias_offset")], [n("bias_column")]),
            h.make_node("Gather", [bias, n("bias_column")], [out], axis=1)]  # (H, T, L)


def _attr_constant(attr: str, out: str, kind: int) -> onnx.NodeProto:
    """Constant whose value is the calling node's attribute `attr` (an attribute reference)."""
    node = h.make_node("Constant", [], [out])
    ref = onnx.AttributeProto(name="value_int" if kind == onnx.AttributeProto.INT else "value_float",
                              ref_attr_name=attr, type=kind)
    node.attribute.append(ref)
    return node


def _prelude() -> list[onnx.NodeProto]:
    """`split_shape` = [0, 0, num_heads, -1] for (B, T, D) -> (B, T, H, Dh); `scale`; `lowest`."""
    return [_attr_constant("num_heads", "heads", onnx.AttributeProto.INT),
            _attr_constant("scale", "scale", onnx.AttributeProto.FLOAT),
            h.make_node("Constant", [], ["axis0"], value_ints=[0]),
            h.make_node("Constant", [], ["axis1"], value_ints=[1]),
            h.make_node("Constant", [], ["zero_zero"], value_ints=[0, 0]),
            h.make_node("Constant", [], ["minus_one"], value_ints=[-1]),
            h.make_node("Unsqueeze", ["heads", "axis0"], ["heads_1d"]),
            h.make_node("Concat", ["zero_zero", "heads_1d", "minus_one"], ["split_shape"], axis=0),
            h.make_node("Constant", [], ["lowest"], value_float=LOWEST_FP32)]


def _split_heads(x: str, out: str) -> list[onnx.NodeProto]:
    """(B, T, D) -> (B, H, T, Dh), in the input's dtype."""
    return [h.make_node("Reshape", [x, "split_shape"], [f"{out}_bthd"]),
            h.make_node("Transpose", [f"{out}_bthd"], [out], perm=[0, 2, 1, 3])]


def _to_fp32(x: str, out: str) -> onnx.NodeProto:
    return h.make_node("Cast", [x], [out], to=TensorProto.FLOAT)


def _padding_allowed(mask: str) -> list[onnx.NodeProto]:
    """key_padding_mask (B, S) int32 of 1/0 -> `allowed` (B, 1, 1, S) bool."""
    return [h.make_node("Constant", [], ["zero_i32"], value=h.make_tensor("zero", TensorProto.INT32, [], [0])),
            h.make_node("Equal", [mask, "zero_i32"], ["is_pad"]),
            h.make_node("Not", ["is_pad"], ["keep"]),
            h.make_node("Constant", [], ["axes12"], value_ints=[1, 2]),
            h.make_node("Unsqueeze", ["keep", "axes12"], ["allowed"])]


def _causal_allowed() -> list[onnx.NodeProto]:
    """Query i (position P + i) sees keys 0 .. P + i: `allowed` (T, P + T) bool, P from the past's shape."""
    return [h.make_node("Shape", ["past_key"], ["past_len_1d"], start=2, end=3),
            h.make_node("Shape", ["query"], ["tgt_len_1d"], start=1, end=2),
            h.make_node("Squeeze", ["past_len_1d"], ["past_len"]),
            h.make_node("Squeeze", ["tgt_len_1d"], ["tgt_len"]),
            h.make_node("Add", ["past_len", "tgt_len"], ["total_len"]),
            h.make_node("Constant", [], ["one"], value_int=1),
            h.make_node("Constant", [], ["zero"], value_int=0),
            h.make_node("Range", ["past_len", "total_len", "one"], ["q_pos"]),  # (T,)
            h.make_node("Range", ["zero", "total_len", "one"], ["k_pos"]),  # (P + T,)
            h.make_node("Unsqueeze", ["k_pos", "axis0"], ["k_row"]),  # (1, P + T)
            h.make_node("Unsqueeze", ["q_pos", "axis1"], ["q_col"]),  # (T, 1)
            h.make_node("LessOrEqual", ["k_row", "q_col"], ["allowed"])]


def _encoder_positions() -> list[onnx.NodeProto]:
    """`q_pos` (T,) and `k_pos` (S,): positions 0 .. of the queries and keys, from the inputs' shapes."""
    return [h.make_node("Shape", ["query"], ["tgt_len_1d"], start=1, end=2),
            h.make_node("Shape", ["key"], ["key_len_1d"], start=1, end=2),
            h.make_node("Squeeze", ["tgt_len_1d"], ["tgt_len"]),
            h.make_node("Squeeze", ["key_len_1d"], ["key_len"]),
            h.make_node("Constant", [], ["one"], value_int=1),
            h.make_node("Constant", [], ["zero"], value_int=0),
            h.make_node("Range", ["zero", "tgt_len", "one"], ["q_pos"]),
            h.make_node("Range", ["zero", "key_len", "one"], ["k_pos"])]


def _attend(biased: bool) -> list[onnx.NodeProto]:
    """softmax(q k^T * scale [+ bias] | allowed) v in fp32 from q, k, v (B, H, *, Dh) fp32 -> `output` (B, T, D)."""
    bias = [*bias_by_distance(POSITION_BIAS, "q_pos", "k_pos", "bias_htl"),
            _to_fp32("bias_htl", "bias_fp32"),
            h.make_node("Add", ["scaled", "bias_fp32"], ["scores"])] if biased else []  # (H, T, L) over B
    return [h.make_node("Transpose", ["k"], ["k_t"], perm=[0, 1, 3, 2]),  # (B, H, Dh, L)
            h.make_node("MatMul", ["q", "k_t"], ["qk"]),  # (B, H, T, L)
            h.make_node("Mul", ["qk", "scale"], ["scaled" if biased else "scores"]), *bias,
            h.make_node("Where", ["allowed", "scores", "lowest"], ["masked"]),
            h.make_node("Softmax", ["masked"], ["probs"], axis=-1),
            h.make_node("MatMul", ["probs", "v"], ["context"]),  # (B, H, T, Dh)
            h.make_node("CastLike", ["context", "query"], ["context_t"]),
            h.make_node("Transpose", ["context_t"], ["context_bthd"], perm=[0, 2, 1, 3]),  # (B, T, H, Dh)
            h.make_node("Constant", [], ["merge_shape"], value_ints=[0, 0, -1]),
            h.make_node("Reshape", ["context_bthd", "merge_shape"], ["output"])]  # (B, T, D)


def _body(kind: AttentionKind, biased: bool) -> list[onnx.NodeProto]:
    nodes = _prelude() + _split_heads("query", "q_h") + [_to_fp32("q_h", "q")]
    if kind is AttentionKind.ENCODER_SELF:
        nodes += _split_heads("key", "k_h") + _split_heads("value", "v_h")
        nodes += [_to_fp32("k_h", "k"), _to_fp32("v_h", "v")] + _padding_allowed("key_padding_mask")
        nodes += _encoder_positions() if biased else []
    elif kind is AttentionKind.CROSS:
        nodes += [_to_fp32("cross_key", "k"), _to_fp32("cross_value", "v")] + _padding_allowed("key_padding_mask")
    else:
        nodes += _split_heads("key", "k_new") + _split_heads("value", "v_new")
        nodes += [h.make_node("Concat", ["past_key", "k_new"], ["present_key"], axis=2),  # (B, H, P + T, Dh)
                  h.make_node("Concat", ["past_value", "v_new"], ["present_value"], axis=2),
                  _to_fp32("present_key", "k"), _to_fp32("present_value", "v")] + _causal_allowed()
    return nodes + _attend(biased)


def attention_functions(opset: int, biased: bool = False) -> list[onnx.FunctionProto]:
    """The three local functions, and with `biased` the variants of the kinds that take a position bias, importing
    the graph's own default-domain opset."""
    imports = [h.make_opsetid("", opset)]
    variants = [(kind, False) for kind in AttentionKind]
    variants += [(kind, True) for kind in AttentionKind if biased and POSITION_BIAS in OPTIONAL_INPUTS[kind]]
    return [h.make_function(spec.MARKED_DOMAIN, marked_op_type(kind, bias), list(input_names(kind, bias)),
                            list(OUTPUTS[kind]), _body(kind, bias), imports,
                            list(ATTRIBUTES))
            for kind, bias in variants]
