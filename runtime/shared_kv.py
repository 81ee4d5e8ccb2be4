"""The fused decoder graph rewritten so that each step writes its present K/V in place into the past buffer.

ONNX Runtime's MultiHeadAttention shares past and present when it is given `past_sequence_length` (input 8): past
and present are then one (B, H, max_positions, Dh) buffer, the step's K/V are written at positions
[past_sequence_length, past_sequence_length + T) and attention reads only the positions before their end (ONNX
Runtime 1.32's CPU kernel does so, unidirectional prompts included, with whatever the buffer holds beyond them:
tests/runtime/test_device_step.py). The rewrite, applied when the step model opens the graph (the export is not
changed):
- a graph input `past_sequence_length` (int32, [1]);
- every self-attention MultiHeadAttention node reading a decoder past takes it as input 8;
- every `Shape` of a decoder past (positions 2..3: the past length, which the graph reads for its positions) becomes
  a Cast of `past_sequence_length`;
- the past and present K/V lose their fixed position axis.
A graph that reads a decoder past any other way is left alone (None): the step model then concatenates as before.
"""

from __future__ import annotations

PAST_LENGTH = "past_sequence_length"


def shared_buffer_decoder(model: bytes, past_names: list[str], present_names: list[str]) -> bytes | None:
    """The decoder graph with past and present sharing one buffer, or None when its graph does not allow it."""
    import onnx
    from onnx import TensorProto, helper

    proto = onnx.load_from_string(model)
    g, pasts = proto.graph, set(past_names)
    nodes = []
    for node in g.node:
        read = [i for i in node.input if i in pasts]
        if not read:
            nodes.append(node)
            continue
        if node.op_type == "MultiHeadAttention" and list(node.input[6:8]) == read and len(node.input) == 8:
            node.input.append(PAST_LENGTH)
            nodes.append(node)
        elif node.op_type == "Shape" and _attrs(node) == {"start": 2, "end": 3}:
            nodes.append(helper.make_node("Cast", [PAST_LENGTH], list(node.output), name=node.name,
                                          to=TensorProto.INT64))
        else:
            return None  # a past read otherwise than by attention or for its length
    del g.node[:]
    g.node.extend(nodes)
    for value in [*g.input, *g.output]:
        if value.name in pasts or value.name in present_names:
            value.type.tensor_type.shape.dim[2].dim_param = "max_positions"
    kept = [v for v in g.value_info if v.name not in present_names]
    del g.value_info[:]
    g.value_info.extend(kept)
    g.input.append(helper.make_tensor_value_info(PAST_LENGTH, TensorProto.INT32, [1]))
    return proto.SerializeToString()


def _attrs(node) -> dict:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}
