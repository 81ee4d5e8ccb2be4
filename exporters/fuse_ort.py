"""The ONNX Runtime target of fusion: each marked attention block becomes `com.microsoft.MultiHeadAttention`, then
folds that only ONNX Runtime's graphs want.

- `ort_node`: the block's node for ONNX Runtime, which runs it natively (with the past K/V and `unidirectional` for
  decoder self-attention, BNSH cross K/V and a key padding mask otherwise);
- `fold_projections_into_attention`: the q/k/v projections packed into one GEMM and their biases moved into the
  node, where a one-token step runs them cheaper;
- `fold_constant_transposes`: a Transpose of a weight becomes a transposed weight, so `seq2trt quantize` can make
  the tied output projection int8.
"""

from __future__ import annotations

import onnx
from onnx import helper

from seq2trt.plugins.op import LOWEST_FP32, AttentionAttrs, AttentionKind

MS_DOMAIN = "com.microsoft"


def ort_node(node: onnx.NodeProto, attrs: AttentionAttrs) -> onnx.NodeProto:
    """com.microsoft.MultiHeadAttention inputs: query, key, value, bias, key_padding_mask, attention_bias,
    past_key, past_value; the op's inputs map onto them by kind. Padded keys score LOWEST_FP32 (its default adds
    -10000, which leaves an all-padding row attending as if unmasked), so such a row is the mean of V (`plugins.op`)."""
    inputs = list(node.input)
    if attrs.kind is AttentionKind.DECODER_SELF:
        q, k, v, past_k, past_v = inputs
        ms_inputs, extra = [q, k, v, "", "", "", past_k, past_v], {"unidirectional": 1}
    else:
        q, k, v, mask = inputs
        ms_inputs, extra = [q, k, v, "", mask], {"mask_filter_value": LOWEST_FP32}
    return helper.make_node("MultiHeadAttention", ms_inputs, list(node.output), name=node.name, domain=MS_DOMAIN,
                            num_heads=attrs.num_heads, scale=attrs.scale, **extra)


def _linear(name: str, producers: dict, weights: dict) -> tuple[str, str, str] | None:
    """(activation, weight, bias) when `name` is Add(MatMul(x, W), b) with W (D_in, D_out) and b initializers."""
    add = producers.get(name)
    if add is None or add.op_type != "Add":
        return None
    for matmul_out, bias in (add.input, add.input[::-1]):
        matmul = producers.get(matmul_out)
        if bias in weights and matmul is not None and matmul.op_type == "MatMul" and matmul.input[1] in weights:
            return matmul.input[0], matmul.input[1], bias
    return None


def fold_projections_into_attention(model: onnx.ModelProto) -> int:
    """ORT target: move the input projections' work into MultiHeadAttention where it is cheaper for a one-token step.

    Self-attention: the q/k/v projections of one input become one MatMul (x @ [Wq | Wk | Wv]) and a Split, their
    biases MultiHeadAttention's `bias` input — 2 GEMMs and 3 Adds fewer per block. Cross-attention: the query
    bias moves into `bias` (zero for the precomputed K/V) — 1 Add fewer. Returns how many blocks changed; the old
    nodes die in the optimizer's dead-code pass.
    """
    from onnx import numpy_helper

    import numpy as np

    graph = model.graph
    producers = {out: n for n in graph.node for out in n.output}
    weights = {i.name: i for i in graph.initializer}
    changed, nodes = 0, []
    for node in graph.node:
        unbiased_mha = node.op_type == "MultiHeadAttention" and node.domain == MS_DOMAIN and node.input[3] == ""
        parts = [_linear(name, producers, weights) for name in node.input[:3]] if unbiased_mha else [None] * 3
        if parts[0] is None:
            nodes.append(node)
            continue
        prefix = f"{node.name}.packed_qkv"
        if None not in parts and len({x for x, _, _ in parts}) == 1:  # self-attention: pack q, k, v
            w = np.concatenate([numpy_helper.to_array(weights[p[1]]) for p in parts], axis=1)  # (D, 3D)
            b = np.concatenate([numpy_helper.to_array(weights[p[2]]) for p in parts])  # (3D,)
            graph.initializer.extend([
                numpy_helper.from_array(w, f"{prefix}.weight"),
                numpy_helper.from_array(np.array([w.shape[1] // 3] * 3, np.int64), f"{prefix}.split")])
            q, k, v = (f"{prefix}.{part}" for part in "qkv")
            nodes += [helper.make_node("MatMul", [parts[0][0], f"{prefix}.weight"], [f"{prefix}.out"],
                                       name=f"{prefix}.matmul"),
                      helper.make_node("Split", [f"{prefix}.out", f"{prefix}.split"], [q, k, v], axis=-1,
                                       name=f"{prefix}.split")]
            node.input[0], node.input[1], node.input[2] = q, k, v
        elif parts[1] is None and parts[2] is None:  # cross-attention: only the query is projected here
            bias = numpy_helper.to_array(weights[parts[0][2]])
            b = np.concatenate([bias, np.zeros_like(bias), np.zeros_like(bias)])
            node.input[0] = producers[node.input[0]].input[0] if producers[node.input[0]].input[1] == parts[0][2] \
                else producers[node.input[0]].input[1]  # the MatMul's output, the Add's other input
        else:
            nodes.append(node)
            continue
        graph.initializer.append(numpy_helper.from_array(b, f"{node.name}.bias"))
        node.input[3] = f"{node.name}.bias"
        nodes.append(node)
        changed += 1
    del graph.node[:]
    graph.node.extend(nodes)
    return changed


def fold_constant_transposes(model: onnx.ModelProto) -> int:
    """ORT target: a Transpose of a weight becomes a transposed weight.

    The tied output projection is exported as MatMul(h, Transpose(embedding)) — the embedding stays shared with
    the Gather — and onnxscript's optimizer leaves that Transpose alone. ONNX Runtime folds it at load time
    anyway (the same extra copy), but only an initializer second input lets `seq2trt quantize` make the MatMul
    int8: for the `base` preset that projection is 40% of the decoder's weight bytes. Returns how many folded.
    """
    from onnx import numpy_helper

    import numpy as np

    weights = {i.name: i for i in model.graph.initializer}
    folded = 0
    for node in model.graph.node:
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx") or node.input[0] not in weights:
            continue
        array = numpy_helper.to_array(weights[node.input[0]])
        perm = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "perm"), None) or list(range(array.ndim))[::-1]
        model.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(array.transpose(perm)),
                                                               f"{node.input[0]}.transposed"))
        node.op_type, node.input[0] = "Identity", f"{node.input[0]}.transposed"
        del node.attribute[:]
        folded += 1
    return folded
