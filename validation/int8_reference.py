"""The float64 reference of an int8 graph: the eager model computing what dynamic quantization computes.

`seq2trt quantize` gives every MatMul with a constant weight int8 weights (a scale and zero point per tensor or
per output channel, stored in the graph) and quantizes the MatMul's activation to uint8 at run time, per tensor,
as ONNX's DynamicQuantizeLinear defines it: range [min(0, min x), max(0, max x)], scale = range / 255, zero point
round(-min / scale), q = saturate(round(x / scale) + zero point), rounding half to even. The product of the two
integer tensors is exact; the graph then scales it back to float.

`quantized_reference(model, graph)` returns a copy of the float64 model whose every `nn.Linear` that the graph
quantized computes exactly that, with the weights, scales and zero points read from the graph. What is left
between the graph and this reference is float32 arithmetic, and the rare activation whose float32 and float64
values fall on two sides of a rounding boundary: given the graph's own integers (`expose_decisions`), the reference
checks each against its own activation and then follows them (`QuantizedLinear`).

Which graph weight belongs to which layer is found by value, not by name (the fuser packs q, k and v into one
weight and the quantizer renames every weight): a block of columns of a quantized weight belongs to a layer when it
dequantizes to that layer's weight within half a quantization step, which is exactly what rounding to the nearest
step guarantees. A graph weight that matches no layer is a fault of the graph (a wrong scale, a corrupted or
misplaced weight) and is reported, not papered over.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import onnx
import torch
from onnx import numpy_helper

# Float32 dequantization of the graph's weights is not exact: allow that rounding on top of the half step.
_FP32_SLACK = 4 * np.finfo(np.float32).eps


@dataclass(frozen=True)
class QuantizedWeight:
    """One quantized MatMul weight of a graph, dequantized: `values` (in, N) = (q - zero_point) * scale."""

    name: str
    graph_input: str  # the MatMul's activation input: the integers DynamicQuantizeLinear made
    values: np.ndarray  # float64 (in, N)
    half_step: np.ndarray  # (N,) half a quantization step per column


def quantized_weights(graph: onnx.ModelProto) -> list[QuantizedWeight]:
    """Every constant weight of a MatMulInteger or DynamicQuantizeMatMul node, dequantized."""
    inits = {i.name: i for i in graph.graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    producers = {o: n for n in graph.graph.node for o in n.output}
    found = []
    for node in graph.graph.node:
        if node.op_type == "MatMulInteger":
            weight, zero = node.input[1], node.input[3] if len(node.input) > 3 else ""
            scale = _weight_scale_of(node, inits, consumers, producers)
        elif node.op_type == "DynamicQuantizeMatMul":
            weight, scale, zero = node.input[1], node.input[2], node.input[3] if len(node.input) > 3 else ""
        else:
            continue
        if weight not in inits or scale not in inits:
            continue
        q = numpy_helper.to_array(inits[weight]).astype(np.float64)
        s = numpy_helper.to_array(inits[scale]).astype(np.float64)
        z = numpy_helper.to_array(inits[zero]).astype(np.float64) if zero in inits else np.zeros(())
        values = (q - z) * s  # scalar or per-column (N,) scale broadcast over (in, N)
        found.append(QuantizedWeight(weight, node.input[0], values, np.broadcast_to(np.abs(s) / 2, (q.shape[1],)).copy()))
    return found


def _weight_scale_of(matmul: onnx.NodeProto, inits: dict, consumers: dict, producers: dict) -> str:
    """MatMulInteger carries no scale: the quantizer casts its output to float and multiplies it by (activation
    scale * weight scale), a Mul whose constant input is the weight's scale."""
    for cast in (n for n in consumers.get(matmul.output[0], []) if n.op_type == "Cast"):
        for mul in (n for n in consumers.get(cast.output[0], []) if n.op_type == "Mul"):
            for operand in mul.input:
                product = producers.get(operand)
                if product is not None and product.op_type == "Mul":
                    return next((i for i in product.input if i in inits), "")
    return ""


@dataclass(frozen=True)
class WeightMismatch:
    """A quantized graph weight that dequantizes to no layer of the model."""

    graph_weight: str
    nearest_layer: str
    steps: float  # its largest error against that layer, in quantization steps (<= 0.5 when it matches)

    def message(self) -> str:
        return (f"int8 weight {self.graph_weight} dequantizes to no layer of the model: nearest is {self.nearest_layer}, "
                f"off by {self.steps:.3g} quantization steps where rounding allows 0.5")


class Decisions:
    """What the graph decided, for a reference that follows it: the graph's debug outputs of one run (its quantized
    activations, `expose_decisions`), and the checks made while following them."""

    def __init__(self):
        self.outputs: Mapping[str, np.ndarray] | None = None
        self.checks: list = []


class QuantizedLinear(torch.nn.Module):
    """`nn.Linear`'s forward as dynamic quantization computes it (module docstring), in float64.

    When the graph's own quantized input of this MatMul is known (`Decisions.outputs`), the reference checks it
    against its own input (within half a step, plus float32 arithmetic) and continues from the graph's integers:
    a float32 activation a hair's breadth from a rounding boundary may round the other way than its float64
    value, and following the graph keeps that one-step difference from growing through the layers after it."""

    def __init__(self, name: str, weight_t: np.ndarray, original: torch.nn.Linear, graph_input: str,
                 decisions: Decisions):
        super().__init__()
        self.layer, self.graph_input, self.decisions = name, graph_input, decisions
        self.weight, self.bias = original.weight, original.bias  # tied weights and shape lookups keep working
        self.register_buffer("weight_t", torch.as_tensor(weight_t, dtype=torch.float64), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.float64)
        q, scale, zero = self._graph_decision(x) or quantize_activation(x)
        y = ((q - zero) * scale) @ self.weight_t
        return y if self.bias is None else y + self.bias.to(torch.float64)

    def _graph_decision(self, x: torch.Tensor):
        """The graph's (q, scale, zero point) for this input, checked: each integer must be round(x / scale) +
        zero point for some x within float32 error of the reference's (fp32 tolerances), so only an activation
        that close to a rounding boundary may round the other way."""
        from seq2trt.validation.parity import TOLERANCES, Tolerance, compare_output

        outputs = self.decisions.outputs
        names = [debug_name(self.graph_input, part) for part in DECISION_PARTS]
        if outputs is None or any(n not in outputs for n in names):
            return None
        q, scale, zero = (torch.as_tensor(np.asarray(outputs[n], dtype=np.float64)) for n in names)
        if q.numel() != x.numel():
            return None
        q = q.reshape(x.shape)
        fp32 = TOLERANCES["fp32"]["*"]
        slack = fp32.atol + fp32.rtol * x.abs()
        lowest = torch.clamp(torch.round((x - slack) / scale) + zero, 0, 255)
        highest = torch.clamp(torch.round((x + slack) / scale) + zero, 0, 255)
        off_grid = int(((q < lowest) | (q > highest)).sum())
        low, high = (0 - zero) * scale, (255 - zero) * scale
        tolerance = Tolerance(atol=float(scale) / 2 + fp32.atol, rtol=fp32.rtol, min_cosine=-1.0,
                              basis="round(x / scale) + zero point, x within fp32 error")
        stats = compare_output(f"int8 input of {self.layer}", ((q - zero) * scale).numpy(),
                               torch.clamp(x, low, high).numpy(), tolerance)
        self.decisions.checks.append(dataclasses.replace(stats, violations=stats.violations + off_grid))
        return q, scale, zero


DECISION_PARTS = ("q", "scale", "zero_point")


def debug_name(tensor: str, part: str) -> str:
    from seq2trt.exporters import spec

    return spec.debug_output_name(f"int8.{tensor}.{part}")


def expose_decisions(model: bytes) -> bytes:
    """The graph with every DynamicQuantizeLinear's outputs (integers, scale, zero point) as extra outputs."""
    graph = onnx.load_from_string(model)
    for node in [n for n in graph.graph.node if n.op_type == "DynamicQuantizeLinear"]:
        for tensor, part, elem in zip(node.output, DECISION_PARTS,
                                      (onnx.TensorProto.UINT8, onnx.TensorProto.FLOAT, onnx.TensorProto.UINT8)):
            name = debug_name(node.output[0], part)
            graph.graph.node.append(onnx.helper.make_node("Identity", [tensor], [name], name=f"{name}.identity"))
            graph.graph.output.append(onnx.helper.make_tensor_value_info(name, elem, None))
    return graph.SerializeToString()


def decisions_of(model) -> Decisions | None:
    """The `Decisions` a quantized reference (or a copy of one) follows."""
    return next((m.decisions for m in model.modules() if isinstance(m, QuantizedLinear)), None)


def quantize_activation(x: torch.Tensor):
    """ONNX DynamicQuantizeLinear on a float64 tensor: (q as float64, scale, zero point)."""
    lo = torch.clamp(x.min(), max=0.0) if x.numel() else x.new_zeros(())
    hi = torch.clamp(x.max(), min=0.0) if x.numel() else x.new_zeros(())
    scale = (hi - lo) / 255.0
    if float(scale) == 0.0:
        return torch.zeros_like(x), x.new_ones(()), x.new_zeros(())
    zero = torch.clamp(torch.round(-lo / scale), 0, 255)
    return torch.clamp(torch.round(x / scale) + zero, 0, 255), scale, zero


def quantized_reference(model, graph: onnx.ModelProto) -> tuple[object, list[WeightMismatch]]:
    """A float64 copy of `model` whose layers quantized in `graph` compute as the graph does, and the graph's
    weights that match no layer (a non-empty list means the graph is wrong)."""
    reference = copy.deepcopy(model).double().eval()
    linears = {name: m for name, m in reference.named_modules() if isinstance(m, torch.nn.Linear)}
    targets = {name: m.weight.detach().numpy().T for name, m in linears.items()}  # (in, out), float64
    mismatches, assigned, decisions = [], {}, Decisions()
    for qw in quantized_weights(graph):
        offset, columns = 0, qw.values.shape[1]
        while offset < columns:
            best = _best_layer(qw, offset, targets)
            if best is None:
                mismatches.append(WeightMismatch(qw.name, "(none of its width)", float("inf")))
                break
            name, steps = best
            if steps > 0.5 + _FP32_SLACK * 127:
                mismatches.append(WeightMismatch(qw.name, name, steps))
                break
            width = targets[name].shape[1]
            assigned.setdefault(name, (qw.values[:, offset:offset + width], qw.graph_input))
            offset += width
    for name, (weight_t, graph_input) in assigned.items():
        parent_name, _, leaf = name.rpartition(".")
        parent = reference.get_submodule(parent_name) if parent_name else reference
        setattr(parent, leaf, QuantizedLinear(name, weight_t, linears[name], graph_input, decisions))
    return reference, mismatches


def _best_layer(qw: QuantizedWeight, offset: int, targets: dict[str, np.ndarray]) -> tuple[str, float] | None:
    """The layer whose weight is nearest to the columns of `qw` from `offset` on, and its error in steps."""
    best = None
    rows, columns = qw.values.shape
    for name, target in targets.items():
        width = target.shape[1]
        if target.shape[0] != rows or offset + width > columns:
            continue
        block = qw.values[:, offset:offset + width]
        half = qw.half_step[offset:offset + width]
        steps = float((np.abs(block - target) / (2 * half + 1e-300)).max())
        if best is None or steps < best[1]:
            best = (name, steps)
    return best
