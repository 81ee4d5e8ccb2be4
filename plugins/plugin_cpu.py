"""Run TensorRT plugin graphs on CPU: each plugin node executes the op's PyTorch reference inside ONNX Runtime.

ONNX Runtime only calls Python custom ops (onnxruntime-extensions' `onnx_op`) in the domain
`ai.onnx.contrib`, so a copy of the graph gets its plugin nodes re-domained there, one op type per kind since
a Python op has a fixed signature. Those ops take fp32 only: in an fp16 graph each plugin node is wrapped in
Casts (fp16 -> fp32 is exact, and the op computes in fp32 and rounds its outputs to fp16 anyway, which the
Cast back does), so the numbers are the op's own. Everything else about the node — inputs, outputs,
attributes, the KV append — is exactly what TensorRT's parser sees, so a plugin graph that validates here is
wired correctly before any GPU runs it.
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import onnx

from seq2trt.core.errors import ArtifactError, DependencyError

from seq2trt.plugins.op import (DOMAIN, INPUTS, OPTIONAL_INPUTS, OUTPUTS, PLUGIN_NAME, AttentionAttrs, AttentionKind,
                                attrs_from_node, input_names, reference_attention)

logger = logging.getLogger(__name__)

CONTRIB_DOMAIN = "ai.onnx.contrib"
CPU_DTYPES = ("fp32", "fp16")
# Name and Python type of every node attribute, read off `AttentionAttrs.onnx_attributes` (any instance will do).
_ATTRIBUTE_TYPES = {name: type(value)
                    for name, value in AttentionAttrs(AttentionKind.ENCODER_SELF, 1, 1, 1.0).onnx_attributes().items()}


def contrib_op_type(kind: AttentionKind, position_bias: bool = False) -> str:
    """One Python op per kind and input list (a Python op's signature is fixed): the bias variant has its own."""
    return f"{PLUGIN_NAME}_{kind.name}" + ("_BIAS" if position_bias else "")


def _reference(*inputs: np.ndarray, **attrs) -> np.ndarray | tuple[np.ndarray, ...]:
    """The op body ONNX Runtime calls, with the node's attributes as keywords.

    It must not raise: onnxruntime-extensions lets a Python exception escape the kernel, which ends the process
    (std::terminate). A node whose attributes do not fit its inputs (a damaged graph: a `kind` changed between two
    kinds of the same arity, say) gets NaN outputs instead, with the error logged, so validation fails on them."""
    import torch

    op = AttentionAttrs.from_onnx(attrs)  # for_cpu read these attributes already: they parse
    try:
        outputs = reference_attention(op, *(torch.from_numpy(np.ascontiguousarray(x)) for x in inputs))
        arrays = tuple(o.numpy() for o in outputs)
    except Exception as exc:  # noqa: BLE001 -- anything raised here would abort the process
        logger.error("the plugin's CPU reference op failed on a node with attributes %s (%s: %s): its outputs are "
                     "NaN, so the graph fails validation; a plugin node's attributes do not match its inputs",
                     attrs, type(exc).__name__, exc)
        kind = op.kind
        query = np.asarray(inputs[0], np.float32) if inputs else np.zeros((1, 1, 1), np.float32)
        arrays = (np.full(query.shape, np.nan, np.float32),)
        if kind is AttentionKind.DECODER_SELF and len(inputs) >= 5 and np.ndim(inputs[3]) == 4:
            past = np.asarray(inputs[3])
            present = (past.shape[0], past.shape[1], past.shape[2] + query.shape[1], past.shape[3])
            arrays += (np.full(present, np.nan, np.float32),) * 2
        elif kind is AttentionKind.DECODER_SELF:
            arrays += (np.full((1, 1, 1, 1), np.nan, np.float32),) * 2
    return arrays if len(arrays) > 1 else arrays[0]


@functools.cache
def register_reference_ops() -> str:
    """Register the reference op for every kind once per process; returns the library path."""
    try:
        from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op
    except ImportError:
        raise DependencyError("running plugin graphs on CPU needs onnxruntime-extensions; "
                              "pip install 'seq2trt[dev]'") from None
    ort_types = {int: PyCustomOpDef.dt_int64, float: PyCustomOpDef.dt_float, str: PyCustomOpDef.dt_string}
    attrs = {name: ort_types[python_type] for name, python_type in _ATTRIBUTE_TYPES.items()}
    f = PyCustomOpDef.dt_float
    for kind in AttentionKind:
        for bias in (False, True) if OPTIONAL_INPUTS[kind] else (False,):
            types = [PyCustomOpDef.dt_int32 if name == "key_padding_mask" else f for name in input_names(kind, bias)]
            onnx_op(op_type=contrib_op_type(kind, bias), inputs=types, outputs=[f] * len(OUTPUTS[kind]),
                    attrs=attrs)(_reference)
    return get_library_path()


def _check_signature(node: onnx.NodeProto, kind: AttentionKind, bias: bool) -> None:
    """A node whose inputs or outputs are not its kind's would reach the Python op with the wrong arguments, and an
    exception there ends the process (onnxruntime-extensions lets it escape the kernel): refuse it here instead."""
    inputs = input_names(kind, bias and bool(OPTIONAL_INPUTS[kind]))
    if len(node.input) != len(inputs) or len(node.output) != len(OUTPUTS[kind]):
        raise ArtifactError(
            f"plugin node {node.name or '(unnamed)'} is of kind {kind.name}, which takes {len(inputs)} inputs "
            f"({', '.join(inputs)}) and gives {len(OUTPUTS[kind])} outputs, but it has {len(node.input)} and "
            f"{len(node.output)}: the graph is damaged; fuse the export again (seq2trt fuse OUT --target trt --force)")


def for_cpu(model: bytes, dtype: str) -> bytes:
    """A copy of a plugin graph whose plugin nodes run the reference op in ONNX Runtime."""
    from onnx import TensorProto, helper

    if dtype not in CPU_DTYPES:
        raise DependencyError(f"plugin graphs run on CPU in {', '.join(CPU_DTYPES)} only, not {dtype}: ONNX "
                              "Runtime's CPU has no bf16 kernels and its Python custom ops are fp32; "
                              "validate bf16 plugin graphs on a GPU")
    proto = onnx.load_from_string(model)
    nodes = []
    for node in proto.graph.node:
        if node.domain != DOMAIN or node.op_type != PLUGIN_NAME:
            nodes.append(node)
            continue
        kind = attrs_from_node(node).kind
        bias = len(node.input) > len(INPUTS[kind])
        _check_signature(node, kind, bias)
        node.domain, node.op_type = CONTRIB_DOMAIN, contrib_op_type(kind, bias)
        if dtype == "fp16":
            for i, (name, value) in enumerate(zip(input_names(kind, bias), list(node.input))):
                if name != "key_padding_mask":
                    nodes.append(helper.make_node("Cast", [value], [f"{value}__fp32_{node.name}"], to=TensorProto.FLOAT))
                    node.input[i] = f"{value}__fp32_{node.name}"
            outputs = list(node.output)
            for i, value in enumerate(outputs):
                node.output[i] = f"{value}__fp32"
            nodes.append(node)
            nodes += [helper.make_node("Cast", [f"{v}__fp32"], [v], to=TensorProto.FLOAT16) for v in outputs]
        else:
            nodes.append(node)
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    kept = [o for o in proto.opset_import if o.domain != DOMAIN]
    del proto.opset_import[:]
    proto.opset_import.extend(kept + [onnx.helper.make_opsetid(CONTRIB_DOMAIN, 1)])
    return proto.SerializeToString()


