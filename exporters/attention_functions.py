"""Bodies of the marked attention nodes: one ONNX local function per kind, in standard ops.

They compute exactly `plugins.op.reference_attention` (scaled dot-product attention, 3.2.1 of Vaswani et al.):
heads split from (B, T, D), scores and softmax in fp32 whatever the graph's dtype, masked keys set to the
lowest fp32 (not -inf, so a row with no allowed key stays finite, as in the eager model), output back in the
query's dtype as (B, T, D). The decoder self-attention appends the new K/V to the past and is causal with
query i at absolute position past_len + i. The attributes come from the node (`num_heads`, `scale`; `kind`
and `head_dim` are carried for the fuser), so the same function serves every model.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto
from onnx import helper as h

from seq2trt.plugins.op import ATTRIBUTES, INPUTS, LOWEST_FP32, OUTPUTS, AttentionKind

from seq2trt.exporters import spec


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


def _attend() -> list[onnx.NodeProto]:
    """softmax(q k^T * scale | allowed) v in fp32 from q, k, v (B, H, *, Dh) fp32 -> `output` (B, T, D)."""
    return [h.make_node("Transpose", ["k"], ["k_t"], perm=[0, 1, 3, 2]),  # (B, H, Dh, L)
            h.make_node("MatMul", ["q", "k_t"], ["qk"]),  # (B, H, T, L)
            h.make_node("Mul", ["qk", "scale"], ["scores"]),
            h.make_node("Where", ["allowed", "scores", "lowest"], ["masked"]),
            h.make_node("Softmax", ["masked"], ["probs"], axis=-1),
            h.make_node("MatMul", ["probs", "v"], ["context"]),  # (B, H, T, Dh)
            h.make_node("CastLike", ["context", "query"], ["context_t"]),
            h.make_node("Transpose", ["context_t"], ["context_bthd"], perm=[0, 2, 1, 3]),  # (B, T, H, Dh)
            h.make_node("Constant", [], ["merge_shape"], value_ints=[0, 0, -1]),
            h.make_node("Reshape", ["context_bthd", "merge_shape"], ["output"])]  # (B, T, D)


def _body(kind: AttentionKind) -> list[onnx.NodeProto]:
    nodes = _prelude() + _split_heads("query", "q_h") + [_to_fp32("q_h", "q")]
    if kind is AttentionKind.ENCODER_SELF:
        nodes += _split_heads("key", "k_h") + _split_heads("value", "v_h")
        nodes += [_to_fp32("k_h", "k"), _to_fp32("v_h", "v")] + _padding_allowed("key_padding_mask")
    elif kind is AttentionKind.CROSS:
        nodes += [_to_fp32("cross_key", "k"), _to_fp32("cross_value", "v")] + _padding_allowed("key_padding_mask")
    else:
        nodes += _split_heads("key", "k_new") + _split_heads("value", "v_new")
        nodes += [h.make_node("Concat", ["past_key", "k_new"], ["present_key"], axis=2),  # (B, H, P + T, Dh)
                  h.make_node("Concat", ["past_value", "v_new"], ["present_value"], axis=2),
                  _to_fp32("present_key", "k"), _to_fp32("present_value", "v")] + _causal_allowed()
    return nodes + _attend()


def attention_functions(opset: int) -> list[onnx.FunctionProto]:
    """The three local functions, importing the graph's own default-domain opset."""
    imports = [h.make_opsetid("", opset)]
    return [h.make_function(spec.MARKED_DOMAIN, spec.MARKED_OP_TYPES[kind], list(INPUTS[kind]),
                            list(OUTPUTS[kind]), _body(kind), imports, list(ATTRIBUTES))
            for kind in AttentionKind]
