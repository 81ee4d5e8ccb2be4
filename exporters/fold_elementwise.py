"""The ONNX Runtime target's element-wise folds (after `fuse_ort`'s attention passes and the optimizer):
`fold_norms_and_activations` makes T5's residual add + RMSNorm one `SkipSimplifiedLayerNormalization` and its tanh
GELU one `FastGelu`, where a one-token step pays per node rather than per element."""

from __future__ import annotations

import onnx
from onnx import helper

from seq2trt.exporters.fuse_ort import MS_DOMAIN, topological

# tanh GELU: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), as FastGelu computes it
_GELU_CONSTANTS = {"cube": 3.0, "cubic": 0.044715, "scale": (2.0 / 3.141592653589793) ** 0.5, "one": 1.0, "half": 0.5}


class _ElementwiseChains:
    """What `fold_norms_and_activations` reads of a graph (its constants, who produces and who reads each value) and
    the two chains it folds, each matched from its `Pow` node."""

    def __init__(self, model: onnx.ModelProto):
        import numpy as np
        from onnx import numpy_helper

        graph = model.graph
        self.inits = {i.name: i for i in graph.initializer}
        floats = [i for i in graph.initializer if i.data_type == onnx.TensorProto.FLOAT]
        self.scalars = {i.name: float(numpy_helper.to_array(i).reshape(()))
                        for i in floats if int(np.prod(i.dims)) == 1}
        self.vectors = {i.name for i in floats if len(i.dims) == 1}
        self.producers = {out: n for n in graph.node for out in n.output}
        self.readers: dict[str, list] = {}
        for node in graph.node:
            for name in node.input:
                self.readers.setdefault(name, []).append(node)
        self.outputs = {o.name for o in graph.output}

    def only(self, name: str, op: str) -> onnx.NodeProto | None:
        """The single reader of `name` when it is an `op` node and `name` is no graph output."""
        found = self.readers.get(name, [])
        return found[0] if len(found) == 1 and found[0].op_type == op and name not in self.outputs else None

    @staticmethod
    def other(node: onnx.NodeProto, name: str) -> str:
        return node.input[1] if node.input[0] == name else node.input[0]

    def is_scalar(self, name: str, value: float) -> bool:
        return name in self.scalars and abs(self.scalars[name] - value) <= 1e-6 * max(1.0, abs(value))

    def axes_last(self, node: onnx.NodeProto) -> bool:
        from onnx import numpy_helper

        keep = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "keepdims"), 1)
        axes = node.input[1] if len(node.input) > 1 else ""
        return keep == 1 and axes in self.inits and numpy_helper.to_array(self.inits[axes]).tolist() in ([-1], -1)

    def rms_norm(self, pow_: onnx.NodeProto):
        """(removed nodes, x, weight name, eps, output) of the RMSNorm starting at `pow_`, or None."""
        only, other, x = self.only, self.other, pow_.input[0]
        if not self.is_scalar(pow_.input[1], 2.0) or not (mean := only(pow_.output[0], "ReduceMean")) \
                or not self.axes_last(mean):
            return None
        if not (add := only(mean.output[0], "Add")) or other(add, mean.output[0]) not in self.scalars:
            return None
        if not (sqrt := only(add.output[0], "Sqrt")) or not (recip := only(sqrt.output[0], "Reciprocal")):
            return None
        if not (scale := only(recip.output[0], "Mul")) or other(scale, recip.output[0]) != x:
            return None
        if not (weigh := only(scale.output[0], "Mul")) or (w := other(weigh, scale.output[0])) not in self.vectors:
            return None
        return [pow_, mean, add, sqrt, recip, scale, weigh], x, w, self.scalars[other(add, mean.output[0])], \
            weigh.output[0]

    def gelu(self, pow_: onnx.NodeProto):
        """(removed nodes, x, output) of the tanh GELU starting at `pow_`, or None."""
        x = pow_.input[0]
        chain, name = [pow_], pow_.output[0]
        if not self.is_scalar(pow_.input[1], _GELU_CONSTANTS["cube"]):
            return None
        for op, const in (("Mul", "cubic"), ("Add", None), ("Mul", "scale"), ("Tanh", None), ("Add", "one"),
                          ("Mul", "half"), ("Mul", None)):
            node = self.only(name, op)
            if node is None or (const and not self.is_scalar(self.other(node, name), _GELU_CONSTANTS[const])) or \
                    (op != "Tanh" and const is None and self.other(node, name) != x):
                return None
            chain.append(node)
            name = node.output[0]
        return chain, x, name


def fold_norms_and_activations(model: onnx.ModelProto) -> dict[str, int]:
    """ORT target, fp32 graphs, after the optimizer: the element-wise chains our exporter writes for T5 become
    single ONNX Runtime contrib nodes. At one token a step each node's dispatch costs more than its arithmetic, and
    a T5 decoder step has some 400 such nodes against 85 matrix products.

    - `Add(a, b)` then RMSNorm, `w * (x * Reciprocal(Sqrt(ReduceMean(Pow(x, 2), -1) + eps)))` (`model.RMSNorm`), ->
      `SkipSimplifiedLayerNormalization(a, b, w)`, whose fourth output is the sum the residual stream reads on;
      a norm whose input is no such Add (a stack's first, on the embedding) is left as it is;
    - `x * (0.5 * (1 + Tanh(sqrt(2/pi) * (x + 0.044715 * Pow(x, 3)))))` -> `FastGelu(x)`.

    Only chains whose every intermediate is read by the chain alone, with the constants above, are folded; the
    fp16/bf16 exports (casts inside the norm) keep theirs. Returns how many of each were folded.
    """
    graph = model.graph
    chains = _ElementwiseChains(model)
    inits, producers = chains.inits, chains.producers
    removed, new_nodes = set(), {}
    counts = {"skip_rms_norm": 0, "fast_gelu": 0}
    for node in graph.node:
        if node.op_type != "Pow" or id(node) in removed:
            continue
        if found := chains.gelu(node):
            chain, x, out = found
            new = helper.make_node("FastGelu", [x], [out], name=f"{out}.fast_gelu", domain=MS_DOMAIN)
            counts["fast_gelu"] += 1
        elif (found := chains.rms_norm(node)) and (residual := producers.get(found[1])) is not None and \
                residual.op_type == "Add" and not any(i in inits for i in residual.input) \
                and id(residual) not in removed:
            chain, x, w, eps, out = found
            chain = chain + [residual]
            # the sum keeps the Add's name: the residual stream, and localisation's sub-block outputs, read it
            new = helper.make_node("SkipSimplifiedLayerNormalization", [*residual.input, w], [out, "", "", x],
                                   name=f"{out}.skip_rms_norm", domain=MS_DOMAIN, epsilon=eps)
            counts["skip_rms_norm"] += 1
        else:
            continue
        new.metadata_props.extend(chain[0].metadata_props)  # the traced module scopes, for localisation
        removed.update(id(n) for n in chain)
        new_nodes[id(chain[0])] = new
    nodes = [new_nodes.get(id(node), node) for node in graph.node if id(node) in new_nodes or id(node) not in removed]
    del graph.node[:]
    graph.node.extend(topological(nodes))
    if any(counts.values()) and not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return counts
