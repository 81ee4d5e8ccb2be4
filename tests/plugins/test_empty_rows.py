"""One definition of a fully masked attention row, followed by every implementation that runs on CPU.

A query row with no allowed key (an all-padding source) returns the mean of V over the row's L keys (`plugins.op`).
The definition is computed here in float64 numpy, independently of every implementation, on inputs that hold such
a row: encoder self-attention with an all-zero mask row, cross-attention with an all-padding source (a one-token
step, which the kernels run split-K, and a prefill). Checked against it: the eager model's attention (fp64, fp16),
the op's reference, the op through `torch_core`, the plugin graph on CPU (`plugin_cpu`), the unfused graph's
attention function and the fused ONNX Runtime node (fp32, fp16), and the Triton kernels in the interpreter (in a
child process: TRITON_INTERPRET=1 must be set before triton is imported).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from seq2trt.exporters import spec
from seq2trt.exporters.attention_functions import attention_functions
from seq2trt.exporters.fuse_ort import MS_DOMAIN, ort_node
from seq2trt.plugins.op import DOMAIN, INPUTS, OUTPUTS, PLUGIN_NAME, AttentionAttrs, AttentionKind, reference_attention
from seq2trt.plugins.plugin_cpu import for_cpu, register_reference_ops
from seq2trt.plugins.eager_kernels import op_core
from seq2trt.reference_model.model import attention_core

H, DH = 2, 8
# (kind, query tokens, source length, tokens kept in batch row 0; row 1 keeps none). The 150-key step runs as 3
# splits of 64 keys (num_splits=3): row 0's last two splits are all padding beside a split with tokens.
CASES = {"encoder": (AttentionKind.ENCODER_SELF, 6, 6, 4), "cross-step": (AttentionKind.CROSS, 1, 150, 20),
         "cross-prefill": (AttentionKind.CROSS, 5, 70, 3)}
TOLERANCE = {"fp64": 1e-12, "fp32": 1e-5, "fp16": 4e-3}  # absolute, outputs are O(1); fp16: inputs rounded first
NP_TYPES = {"fp32": np.float32, "fp16": np.float16}
ONNX_TYPES = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16}


def make_inputs(name: str) -> tuple[AttentionAttrs, tuple[torch.Tensor, ...]]:
    """float64 op inputs with batch row 1 entirely padded."""
    kind, T, S, kept = CASES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    mask = torch.zeros(2, S, dtype=torch.int32)
    mask[0, :kept] = 1
    kv = (rand(2, S, H * DH), rand(2, S, H * DH)) if kind is AttentionKind.ENCODER_SELF else \
        (rand(2, H, S, DH), rand(2, H, S, DH))
    return AttentionAttrs(kind, H, DH, 1 / math.sqrt(DH)), (rand(2, T, H * DH), *kv, mask)


def definition(attrs: AttentionAttrs, inputs) -> np.ndarray:
    """The op's output (B, T, D) in float64: softmax over the allowed keys; the mean of V where none is allowed."""
    q, k, v, mask = (np.asarray(x.double() if x.is_floating_point() else x) for x in inputs)
    B, T, _ = q.shape
    q = q.reshape(B, T, H, DH).transpose(0, 2, 1, 3)  # (B, H, T, Dh)
    if attrs.kind is AttentionKind.ENCODER_SELF:
        k, v = (x.reshape(B, -1, H, DH).transpose(0, 2, 1, 3) for x in (k, v))
    out = np.empty_like(q)
    for b in range(B):
        keys = np.flatnonzero(mask[b])
        if keys.size == 0:
            out[b] = v[b].mean(axis=1, keepdims=True)  # (H, 1, Dh) for every query
            continue
        scores = np.einsum("htd,hld->htl", q[b], k[b][:, keys]) * attrs.scale
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out[b] = (p / p.sum(-1, keepdims=True)) @ v[b][:, keys]
    return out.transpose(0, 2, 1, 3).reshape(B, T, H * DH)


def rounded(inputs, dtype: torch.dtype):
    return tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)


def eager(attrs, inputs):
    q, k, v, mask = inputs
    return attention_core(attrs.kind, q, k, v, attrs.num_heads, attrs.scale, key_padding_mask=mask)[0]


def through_torch_core(attrs, inputs):
    q, k, v, mask = inputs
    core = op_core(lambda a, xs: reference_attention(a, *xs))
    return core(attrs.kind, q, k, v, attrs.num_heads, attrs.scale, key_padding_mask=mask)[0]


def one_node_graph(node, attrs: AttentionAttrs, inputs, dtype: str, domain: str, functions=()) -> bytes:
    names = INPUTS[attrs.kind]
    values = [helper.make_tensor_value_info(n, TensorProto.INT32 if n == "key_padding_mask" else ONNX_TYPES[dtype],
                                            list(x.shape)) for n, x in zip(names, inputs)]
    outputs = [helper.make_tensor_value_info(n, ONNX_TYPES[dtype], None) for n in OUTPUTS[attrs.kind]]
    model = helper.make_model(helper.make_graph([node], "block", values, outputs),
                              opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(domain, 1)],
                              functions=list(functions))
    model.ir_version = 10
    return model.SerializeToString()


def run_graph(data: bytes, attrs, inputs, dtype: str, plugin: bool = False) -> np.ndarray:
    options = ort.SessionOptions()
    if plugin:
        options.register_custom_ops_library(register_reference_ops())
        data = for_cpu(data, dtype)
    session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    feed = {n: x.numpy() if n == "key_padding_mask" else x.numpy().astype(NP_TYPES[dtype])
            for n, x in zip(INPUTS[attrs.kind], inputs)}
    return session.run(None, feed)[0]


def marked_node(attrs) -> "helper.NodeProto":
    return helper.make_node(spec.MARKED_OP_TYPES[attrs.kind], list(INPUTS[attrs.kind]), list(OUTPUTS[attrs.kind]),
                            name="block", domain=spec.MARKED_DOMAIN, **attrs.marked_attributes())


def unfused_graph(attrs, inputs, dtype):
    return run_graph(one_node_graph(marked_node(attrs), attrs, inputs, dtype, spec.MARKED_DOMAIN,
                                    attention_functions(18)), attrs, inputs, dtype)


def fused_ort_graph(attrs, inputs, dtype):
    return run_graph(one_node_graph(ort_node(marked_node(attrs), attrs), attrs, inputs, dtype, MS_DOMAIN),
                     attrs, inputs, dtype)


def plugin_graph(attrs, inputs, dtype):
    node = helper.make_node(PLUGIN_NAME, list(INPUTS[attrs.kind]), list(OUTPUTS[attrs.kind]), name="block",
                            domain=DOMAIN, **attrs.onnx_attributes())
    return run_graph(one_node_graph(node, attrs, inputs, dtype, DOMAIN), attrs, inputs, dtype, plugin=True)


KERNEL_CHILD = """
import sys, torch
from seq2trt.plugins.kernels.launch_plan import attention
from seq2trt.plugins.op import AttentionAttrs, AttentionKind
torch.set_num_threads(1)
cases = torch.load(sys.argv[1])
torch.save({key: attention(AttentionAttrs(AttentionKind(kind), heads, head_dim, scale), *inputs, num_splits=splits)[0]
            for key, ((kind, heads, head_dim, scale), inputs, splits) in cases.items()}, sys.argv[2])
"""


@pytest.fixture(scope="module")
def kernel_outputs(tmp_path_factory) -> dict:
    """The Triton kernels on every case in fp32 and fp16, in the interpreter (one child process for all)."""
    folder = tmp_path_factory.mktemp("kernels")
    cases = {}
    for name in CASES:
        attrs, inputs = make_inputs(name)
        for dtype, torch_dtype in (("fp32", torch.float32), ("fp16", torch.float16)):
            cases[f"{name}/{dtype}"] = ((int(attrs.kind), attrs.num_heads, attrs.head_dim, attrs.scale),
                                        rounded(inputs, torch_dtype), 3 if name == "cross-step" else None)
    torch.save(cases, folder / "cases.pt")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", KERNEL_CHILD, str(folder / "cases.pt"), str(folder / "out.pt")],
                          env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"kernels in the interpreter exited with {proc.returncode}:\n{proc.stderr[-4000:]}")
    return torch.load(folder / "out.pt")


@pytest.mark.parametrize("name", list(CASES))
def test_every_implementation_returns_the_mean_of_v_for_a_fully_masked_row(name, kernel_outputs):
    attrs, inputs = make_inputs(name)
    torch_types = {"fp64": torch.float64, "fp32": torch.float32, "fp16": torch.float16}
    got = {}
    for dtype, torch_dtype in torch_types.items():
        x = rounded(inputs, torch_dtype)
        got[f"eager {dtype}"] = (dtype, eager(attrs, x))
        got[f"op reference {dtype}"] = (dtype, reference_attention(attrs, *x)[0])
        got[f"torch_core {dtype}"] = (dtype, through_torch_core(attrs, x))
    for dtype in ("fp32", "fp16"):
        got[f"plugin graph on CPU {dtype}"] = (dtype, plugin_graph(attrs, inputs, dtype))
        got[f"unfused graph {dtype}"] = (dtype, unfused_graph(attrs, inputs, dtype))
        got[f"fused ORT graph {dtype}"] = (dtype, fused_ort_graph(attrs, inputs, dtype))
        got[f"triton kernels {dtype}"] = (dtype, kernel_outputs[f"{name}/{dtype}"])
    failures = []
    for label, (dtype, out) in got.items():
        want = definition(attrs, rounded(inputs, torch_types[dtype]))  # on the inputs that implementation saw
        error = np.abs(np.asarray(torch.as_tensor(out).double()) - want)
        if not error.max() <= TOLERANCE[dtype]:
            worst_row = int(np.unravel_index(error.argmax(), error.shape)[0])
            failures.append(f"{label}: off by {error.max():.3g} (batch row {worst_row}; row 1 is all padding)")
    assert not failures, "\n".join(failures)
    mean_v = definition(attrs, inputs)[1]
    assert np.abs(mean_v).max() > 0.05  # the all-padding row's expected output is not zeros
