"""The ONNX Runtime target of fusion: each marked attention block becomes `com.microsoft.MultiHeadAttention`, then
folds that only ONNX Runtime's graphs want.

- `ort_node`: the block's node for ONNX Runtime, which runs it natively (with the past K/V and `unidirectional` for
  decoder self-attention, BNSH cross K/V and a key padding mask otherwise; a relative position bias as its
  `attention_bias`, expanded from the shapes);
- `fold_projections_into_attention`: the q/k/v projections packed into one GEMM and their biases moved into the
  node, where a one-token step runs them cheaper;
- `fold_attention_scale`: the attention's scale moved onto the query, so that MLAS takes its one-row path for a
  step's scores;
- `fold_constant_transposes`: a Transpose of a weight becomes a transposed weight, so `seq2trt quantize` can make
  the tied output projection int8;
- T5's residual add + RMSNorm and tanh GELU as contrib nodes: `fold_elementwise.fold_norms_and_activations`.

A pass that reads a weight's value takes `base_dir`, the folder of a graph loaded as structure, whose external data
it reads one tensor at a time (`graph_files`).
"""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import helper

from seq2trt.exporters.attention_functions import bias_by_distance
from seq2trt.exporters.graph_files import tensor_array
from seq2trt.plugins.op import LOWEST_FP32, AttentionAttrs, AttentionKind, unpack_inputs

MS_DOMAIN = "com.microsoft"


def ort_node(node: onnx.NodeProto, attrs: AttentionAttrs, attention_bias: str = "") -> onnx.NodeProto:
    """com.microsoft.MultiHeadAttention inputs: query, key, value, bias, key_padding_mask, attention_bias,
    past_key, past_value; the op's inputs map onto them by kind. Padded keys score LOWEST_FP32 (its default adds
    -10000, which leaves an all-padding row attending as if unmasked), so such a row is the mean of V (`plugins.op`).
    `attention_bias`: the (1, H, T, L) expansion of the node's position bias (`ort_nodes`), if it has one."""
    ins = unpack_inputs(attrs.kind, list(node.input))
    if attrs.kind is AttentionKind.DECODER_SELF:
        ms_inputs, extra = [ins.query, ins.key, ins.value, "", "", attention_bias, ins.past_key, ins.past_value], \
            {"unidirectional": 1}
    else:
        ms_inputs, extra = [ins.query, ins.key, ins.value, "", ins.key_padding_mask, attention_bias], \
            {"mask_filter_value": LOWEST_FP32}
    while ms_inputs[-1] == "":
        ms_inputs.pop()
    return helper.make_node("MultiHeadAttention", ms_inputs, list(node.output), name=node.name, domain=MS_DOMAIN,
                            num_heads=attrs.num_heads, scale=attrs.scale, **extra)


def ort_nodes(node: onnx.NodeProto, attrs: AttentionAttrs, biases: dict[str, str]) -> list[onnx.NodeProto]:
    """The block for ONNX Runtime: a position bias (H, 2M - 1) becomes `attention_bias` (1, H, T, L) (broadcast over
    the batch), gathered by signed distance from the shapes (queries from the past length in the decoder), once per
    bias tensor, so blocks sharing one bias (T5) share its expansion (`biases`: bias name -> expanded name, kept by
    the caller for the graph). Returns the nodes computing a new expansion, then the attention node."""
    ins = unpack_inputs(attrs.kind, list(node.input))
    nodes = []
    if ins.position_bias is not None and ins.position_bias not in biases:
        biases[ins.position_bias] = f"{node.name}.attention_bias"
        nodes = _expanded_bias(ins, attrs.kind, node.name, biases[ins.position_bias])
    return nodes + [ort_node(node, attrs, biases.get(ins.position_bias, "") if ins.position_bias else "")]


def _expanded_bias(ins, kind: AttentionKind, name: str, out: str) -> list[onnx.NodeProto]:
    """(H, 2M - 1) -> `out` (1, H, T, L): queries P .. P + T - 1 (P the past length, 0 in the encoder) over keys
    0 .. P + T - 1, with T from the query's shape."""
    n = lambda part: f"{name}.bias.{part}"
    first = [helper.make_node("Shape", [ins.past_key], [n("past_1d")], start=2, end=3),
             helper.make_node("Squeeze", [n("past_1d")], [n("first")])] if kind is AttentionKind.DECODER_SELF \
        else [helper.make_node("Constant", [], [n("first")], value_int=0)]
    nodes = first + [
        helper.make_node("Shape", [ins.query], [n("tgt_1d")], start=1, end=2),
        helper.make_node("Squeeze", [n("tgt_1d")], [n("tgt")]),
        helper.make_node("Add", [n("first"), n("tgt")], [n("end")]),
        helper.make_node("Constant", [], [n("one")], value_int=1),
        helper.make_node("Constant", [], [n("zero")], value_int=0),
        helper.make_node("Range", [n("first"), n("end"), n("one")], [n("q_pos")]),  # (T,)
        helper.make_node("Range", [n("zero"), n("end"), n("one")], [n("k_pos")])]  # (L,)
    nodes += bias_by_distance(ins.position_bias, n("q_pos"), n("k_pos"), n("htl"), prefix=n(""))
    return nodes + [helper.make_node("Constant", [], [n("axis0")], value_ints=[0]),
                    helper.make_node("Unsqueeze", [n("htl"), n("axis0")], [out])]  # (1, H, T, L)


def _linear(name: str, producers: dict, weights: dict) -> tuple[str, str, str | None] | None:
    """(activation, weight, bias) when `name` is Add(MatMul(x, W), b) with W (D_in, D_out) and b initializers, or
    (activation, weight, None) when it is a bias-free MatMul(x, W) (T5's projections)."""
    node = producers.get(name)
    if node is not None and node.op_type == "MatMul" and node.input[1] in weights:
        return node.input[0], node.input[1], None
    if node is None or node.op_type != "Add":
        return None
    for matmul_out, bias in (node.input, node.input[::-1]):
        matmul = producers.get(matmul_out)
        if bias in weights and matmul is not None and matmul.op_type == "MatMul" and matmul.input[1] in weights:
            return matmul.input[0], matmul.input[1], bias
    return None


def fold_projections_into_attention(model: onnx.ModelProto, base_dir: Path | None = None) -> int:
    """ORT target: move the input projections' work into MultiHeadAttention where it is cheaper for a one-token step.

    Self-attention: the q/k/v projections of one input become one MatMul (x @ [Wq | Wk | Wv]) and a Split, their
    biases MultiHeadAttention's `bias` input — 2 GEMMs and 3 Adds fewer per block (bias-free projections, T5's,
    are packed and leave `bias` empty). Cross-attention: the query bias moves into `bias` (zero for the precomputed
    K/V) — 1 Add fewer. Returns how many blocks changed; the old nodes die in the optimizer's dead-code pass.
    """
    from onnx import numpy_helper

    import numpy as np

    graph = model.graph
    producers = {out: n for n in graph.node for out in n.output}
    weights = {i.name: i for i in graph.initializer}
    changed, nodes, renamed = 0, [], {}
    for node in graph.node:
        unbiased_mha = node.op_type == "MultiHeadAttention" and node.domain == MS_DOMAIN and node.input[3] == ""
        parts = [_linear(name, producers, weights) for name in node.input[:3]] if unbiased_mha else [None] * 3
        if parts[0] is None:
            nodes.append(node)
            continue
        if None not in parts and len({x for x, _, _ in parts}) == 1:  # self-attention: pack q, k, v
            b = _pack_qkv(graph, node, parts, weights, base_dir, nodes, renamed)
        elif parts[1] is None and parts[2] is None and parts[0][2] is not None:  # cross: only the query's bias
            bias = tensor_array(weights[parts[0][2]], base_dir)
            b = np.concatenate([bias, np.zeros_like(bias), np.zeros_like(bias)])
            node.input[0] = producers[node.input[0]].input[0] if producers[node.input[0]].input[1] == parts[0][2] \
                else producers[node.input[0]].input[1]  # the MatMul's output, the Add's other input
        else:
            nodes.append(node)
            continue
        if b is not None:
            graph.initializer.append(numpy_helper.from_array(b, f"{node.name}.bias"))
            node.input[3] = f"{node.name}.bias"
        nodes.append(node)
        changed += 1
    for node in nodes:
        node.input[:] = [renamed.get(name, name) for name in node.input]
    del graph.node[:]
    graph.node.extend(topological(nodes))
    return changed


def _pack_qkv(graph: onnx.GraphProto, node: onnx.NodeProto, parts: list, weights: dict, base_dir: Path | None,
              nodes: list, renamed: dict):
    """Self-attention's three projections of one input as one MatMul with [Wq | Wk | Wv] and a Split feeding `node`
    (appended to `nodes`; the old q, k, v names mapped to the new ones in `renamed`); returns their biases as one
    (3D,) array for MultiHeadAttention's `bias`, or None when the projections have none."""
    from onnx import numpy_helper

    import numpy as np

    prefix = f"{node.name}.packed_qkv"
    w = np.concatenate([tensor_array(weights[p[1]], base_dir) for p in parts], axis=1)  # (D, 3D)
    b = None if all(p[2] is None for p in parts) else np.concatenate(
        [tensor_array(weights[p[2]], base_dir) if p[2] else np.zeros(w.shape[1] // 3, w.dtype)
         for p in parts])  # (3D,)
    graph.initializer.extend([
        numpy_helper.from_array(w, f"{prefix}.weight"),
        numpy_helper.from_array(np.array([w.shape[1] // 3] * 3, np.int64), f"{prefix}.split")])
    q, k, v = (f"{prefix}.{part}" for part in "qkv")
    nodes += [helper.make_node("MatMul", [parts[0][0], f"{prefix}.weight"], [f"{prefix}.out"],
                               name=f"{prefix}.matmul"),
              helper.make_node("Split", [f"{prefix}.out", f"{prefix}.split"], [q, k, v], axis=-1,
                               name=f"{prefix}.split")]
    renamed.update(zip(node.input[:3], (q, k, v)))  # the same values: other readers (a bias's Shape) follow
    node.input[0], node.input[1], node.input[2] = q, k, v
    return b


def fold_attention_scale(model: onnx.ModelProto, base_dir: Path | None = None) -> int:
    """ORT target, decoder graphs, after the optimizer: each MultiHeadAttention's `scale` moves onto its query, a
    `Mul` before the node (and the query's third of the node's `bias`, which it adds first), and the node keeps
    `scale=1.0`.

    ONNX Runtime's CPU kernel hands the scale to MLAS as the GEMM's alpha, and MLAS takes its one-row path (a
    decoder step's query, per head) only for alpha 1: with 0.125 the scores of a cross-attention over Whisper's 1500
    frames cost 2.1x as much (benchmarks/README.md, "The attention scale"). The weights stay as they are, so `seq2trt
    quantize` and its check that every int8 weight dequantizes to a layer of the model see the model's own. Float32
    graphs for any scale; float16/bfloat16 ones only for a power of two, where the product is exact. Returns how many
    nodes changed.
    """
    import math

    graph = model.graph
    floats = [v.type.tensor_type.elem_type for v in graph.output
              if v.type.tensor_type.elem_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16,
                                                  onnx.TensorProto.BFLOAT16)]
    if not floats:
        return 0
    elem = floats[0]
    inits = {i.name: i for i in graph.initializer}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in set(node.input):
            readers[name] = readers.get(name, 0) + 1
    folded, nodes = 0, []
    for node in graph.node:
        attr = next((a for a in node.attribute if a.name == "scale"), None) \
            if node.op_type == "MultiHeadAttention" and node.domain == MS_DOMAIN else None
        factor = attr.f if attr is not None else 0.0
        bias = node.input[3] if len(node.input) > 3 else ""
        if factor in (0.0, 1.0) or (elem != onnx.TensorProto.FLOAT and math.frexp(factor)[0] != 0.5) \
                or (bias and (bias not in inits or readers[bias] != 1)):
            nodes.append(node)
            continue
        if bias:  # (3D,): q, k, v biases; the node adds q's before its product
            _scale_query_bias(inits[bias], factor, base_dir)
        constant = helper.make_tensor(f"{node.name}.scale", elem, [], [factor])  # the graph's float type
        graph.initializer.append(constant)
        query = f"{node.name}.query_scaled"
        mul = helper.make_node("Mul", [node.input[0], constant.name], [query], name=f"{node.name}.scale")
        mul.metadata_props.extend(node.metadata_props)
        node.input[0] = query
        attr.f = 1.0
        nodes += [mul, node]
        folded += 1
    del graph.node[:]
    graph.node.extend(nodes)
    return folded


def _scale_query_bias(tensor: onnx.TensorProto, factor: float, base_dir: Path | None) -> None:
    """Multiply the query's third of a MultiHeadAttention `bias` (q, k, v biases, (3D,)) by `factor`, in place, in
    its own element type."""
    from onnx import numpy_helper

    import numpy as np

    array = tensor_array(tensor, base_dir)
    scaled = array.astype(np.float64)
    scaled[: len(scaled) // 3] *= factor
    new = numpy_helper.from_array(scaled.astype(array.dtype), tensor.name)
    new.data_type = tensor.data_type
    tensor.CopyFrom(new)


def topological(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """`nodes` in an order where each reads only graph inputs, initializers or earlier outputs (a renamed reader may
    now precede its tensor's new producer); otherwise the given order is kept."""
    produced = {out for node in nodes for out in node.output}
    ready, done, pending = [], set(), list(nodes)
    while pending:
        left = []
        for node in pending:
            if all(name in done or name not in produced or name == "" for name in node.input):
                ready.append(node)
                done.update(node.output)
            else:
                left.append(node)
        if len(left) == len(pending):
            raise ValueError("the fused graph has a cycle")
        pending = left
    return ready


def fold_constant_transposes(model: onnx.ModelProto, base_dir: Path | None = None) -> int:
    """ORT target: a Transpose of a weight becomes a transposed weight.

    The tied output projection is exported as MatMul(h, Transpose(embedding)) — the embedding stays shared with
    the Gather — and onnxscript's optimizer leaves that Transpose alone. ONNX Runtime folds it at load time
    anyway (the same extra copy), but only an initializer second input lets `seq2trt quantize` make the MatMul
    int8: for the `base` preset that projection is 40% of the decoder's weight bytes. A weight held as external data
    (a graph past the threshold, graph_files) is left to ONNX Runtime: its copy could pass protobuf's 2 GiB, and int8
    then leaves that projection in fp32 (docs/large-models.md). Returns how many folded.
    """
    from onnx import numpy_helper

    import numpy as np

    weights = {i.name: i for i in model.graph.initializer}
    folded = 0
    for node in model.graph.node:
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx") or node.input[0] not in weights:
            continue
        if weights[node.input[0]].data_location == onnx.TensorProto.EXTERNAL:
            continue  # a big graph's weight: its transposed copy could not be one protobuf tensor (2 GiB); ORT folds it
        array = tensor_array(weights[node.input[0]], base_dir)
        perm = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "perm"), None) or list(range(array.ndim))[::-1]
        model.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(array.transpose(perm)),
                                                               f"{node.input[0]}.transposed"))
        node.op_type, node.input[0] = "Identity", f"{node.input[0]}.transposed"
        del node.attribute[:]
        folded += 1
    return folded
