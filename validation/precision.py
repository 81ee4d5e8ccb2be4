"""How a graph in reduced precision is judged, case by case, from the arithmetic rather than from measured models.

Each case of the parity sweep gets two checks for an fp16 or bf16 graph:

- structure: the graph's fp32 twin (`fp32_twin`: every fp16/bf16 tensor, weight and constant widened exactly to
  float32, so it computes the graph's own function in float32) against the float64 eager model whose parameters,
  buffers and embedding scale are rounded to the dtype (`rounded_model`: the values the graph holds). Both
  compute the same function on the same numbers, so they agree to float32 arithmetic and are judged by the fp32
  tolerances (`twin_tolerance`), widened elementwise by one unit roundoff of the dtype for the few constants the
  graph stores in it that the model computes in Python floats (GELU's 1/sqrt(2)): each moves an output by about
  that much at most, relative. Every fault of structure (a wrong scale, a swapped head, a shifted bias) shows here
  undiluted by rounding noise, whatever the dtype.
- precision: the graph as it runs against the float64 eager model, bounded by the error of the eager model run
  in the same dtype on the same case (`peer_model`). Both round at every op boundary with the same unit roundoff;
  the graph rounds at its ONNX ops, which can be several per eager op (a decomposed LayerNorm or GELU), and
  rounding errors add in variance with the number of rounding points, so a graph with up to 4x as many has up to
  2x the root-mean-square error. `RMS_FACTOR` 4 allows that and the same again for the order each op accumulates
  in; `MAX_FACTOR` 8 does the same for the largest error, a noisier statistic. The peer's error is floored at one
  rounding of the output itself (`UNIT_ROUNDOFF` x |reference|), for outputs the peer happens to get exact. NaN or
  infinity fails, whatever the peer does.

int8 graphs are judged against a float64 reference that computes dynamic quantization (`int8_reference`), which
leaves float32 arithmetic only: the fp32 tolerances again. What int8 costs against the float model is reported
beside it and judged end to end (token agreement, the task's exact match).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Callable, Mapping

import numpy as np

from seq2trt.core.dtypes import torch_dtype
from seq2trt.validation.parity import REPORTED, TOLERANCES, CaseResult, OutputStats, Tolerance, compare_output

UNIT_ROUNDOFF = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}
RMS_FACTOR = 4.0
MAX_FACTOR = 8.0
TWIN = "fp32 twin"  # suffix of the structure check's output names


def rounded_model(model, dtype: str):
    """A float64 copy of `model` holding exactly the values an export in `dtype` holds."""
    import torch

    lp = torch_dtype(dtype)
    rounded = copy.deepcopy(model).double().eval()
    with torch.no_grad():
        for tensor in list(rounded.parameters()) + list(rounded.buffers()):
            if tensor.is_floating_point():
                tensor.copy_(tensor.to(lp).double())
    rounded.embed_scale = float(torch.tensor(rounded.embed_scale, dtype=torch.float64).to(lp))
    return rounded


def peer_model(model, dtype: str):
    """The eager model computing in `dtype` (PyTorch's CPU kernels for it)."""
    return copy.deepcopy(model).to(torch_dtype(dtype)).eval()


def twin_tolerance(dtype: str) -> Tolerance:
    """The structure check's bound (module docstring)."""
    fp32 = TOLERANCES["fp32"]["*"]
    return Tolerance(atol=fp32.atol, rtol=fp32.rtol + UNIT_ROUNDOFF[dtype], min_cosine=fp32.min_cosine,
                     basis=f"fp32, rtol + {dtype} unit roundoff", scaled=fp32.scaled)


def noise_tolerance(reference: np.ndarray, peer: np.ndarray, dtype: str) -> Tolerance:
    """The precision check's bound for one output of one case (module docstring)."""
    r = np.asarray(reference, dtype=np.float64)
    d = np.abs(np.asarray(peer, dtype=np.float64) - r)
    u = UNIT_ROUNDOFF[dtype]
    if r.size == 0:
        return Tolerance(atol=0.0, rtol=0.0, min_cosine=-1.0)
    d = np.nan_to_num(d, nan=0.0, posinf=0.0)
    rms = max(float(np.sqrt(np.mean(d ** 2))), u * float(np.sqrt(np.mean(r ** 2))))
    largest = max(float(d.max()), u * float(np.abs(r).max()))
    return Tolerance(atol=MAX_FACTOR * largest, rtol=0.0, min_cosine=-1.0, max_rms=RMS_FACTOR * rms,
                     basis=f"{MAX_FACTOR:g}x max / {RMS_FACTOR:g}x rms of eager-{dtype}")


def fp32_twin(model: bytes) -> bytes:
    """The graph with every fp16/bf16 tensor type, initializer, constant and cast widened to float32 (exact)."""
    import onnx
    from onnx import TensorProto, numpy_helper

    from seq2trt.exporters.graph_files import widen_external

    low = {TensorProto.FLOAT16, TensorProto.BFLOAT16}
    proto = onnx.load_from_string(model)
    graph = proto.graph
    for value in [*graph.input, *graph.output, *graph.value_info]:
        if value.type.tensor_type.elem_type in low:
            value.type.tensor_type.elem_type = TensorProto.FLOAT
    widen_external(graph, low)  # a big graph's weights: widened by Casts in the session (graph_files)
    for i, init in enumerate(graph.initializer):
        if init.data_type in low and init.data_location != TensorProto.EXTERNAL:
            graph.initializer[i].CopyFrom(numpy_helper.from_array(
                numpy_helper.to_array(init).astype(np.float32), init.name))
    for node in [*graph.node, *(n for f in proto.functions for n in f.node)]:
        for attr in node.attribute:
            if node.op_type == "Cast" and attr.name == "to" and attr.i in low:
                attr.i = TensorProto.FLOAT
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type in low:
                attr.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(attr.t).astype(np.float32), attr.t.name))
    return proto.SerializeToString()


def twin_options(fp32_options: Mapping) -> dict:
    """The runner options of a graph's fp32 twin: an fp32 graph's of the same set (`fp32_options`), its `prepare`
    run after widening the graph."""
    fp32_prepare: Callable[[bytes], bytes] | None = fp32_options.get("prepare")
    return {**fp32_options, "prepare": (lambda m: fp32_prepare(fp32_twin(m))) if fp32_prepare else fp32_twin}


def as_fp32(feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A feed of fp16/bf16 values as float32 (exact), for a twin."""
    return {k: v if np.issubdtype(v.dtype, np.integer) else np.asarray(v, dtype=np.float32) for k, v in feed.items()}


class _RunnersJudge:
    """A judge holding runners of its own, active while it is entered (around the sweep)."""

    def __init__(self, *runners):
        self._runners, self._stack = runners, contextlib.ExitStack()

    def __enter__(self):
        for runner in self._runners:
            self._stack.enter_context(runner)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()


class ReducedJudge(_RunnersJudge):
    """fp16 / bf16: the precision and structure checks of every case (module docstring). `twins`: the graphs'
    fp32 twins; `rounded`: eager runners of `rounded_model`; `peers`: eager runners of `peer_model`."""

    def __init__(self, dtype: str, twins: tuple, rounded: tuple, peers: tuple):
        super().__init__(*twins, *rounded, *peers)
        self.dtype, self.twins, self.rounded, self.peers = dtype, twins, rounded, peers

    def compare(self, index, candidate, reference, feed, case) -> CaseResult:
        got, want, peer = candidate.infer(feed), reference.infer(feed), self.peers[index].infer(feed)
        twin, exact = self.twins[index].infer(as_fp32(feed)), self.rounded[index].infer(feed)
        outputs = [compare_output(n, got[n], want[n], noise_tolerance(want[n], peer[n], self.dtype)) for n in want]
        outputs += [compare_output(f"{n} ({TWIN})", twin[n], exact[n], twin_tolerance(self.dtype)) for n in exact]
        return CaseResult(candidate.kind.value, case, outputs)


class Int8Judge(_RunnersJudge):
    """int8: each graph (run with its quantization decisions exposed, `int8_reference.expose_decisions`) against
    the float64 reference that quantizes as it does and follows its decisions, at the fp32 tolerances; the graph's
    weights must dequantize to the model's; the error against the float model is reported beside, not judged."""

    def __init__(self, quantized: tuple, mismatches: tuple[list, list]):
        super().__init__(*quantized)
        self.quantized, self.mismatches = quantized, mismatches

    def compare(self, index, candidate, reference, feed, case) -> CaseResult:
        from seq2trt.validation.int8_reference import decisions_of

        got, float_want = candidate.infer(feed), reference.infer(feed)
        decisions = decisions_of(self.quantized[index].model)
        decisions.outputs, decisions.checks = got, []
        want = self.quantized[index].infer(feed)
        fp32 = TOLERANCES["fp32"]["*"]
        outputs = [compare_output(n, got[n], want[n], fp32) for n in want]
        outputs += decisions.checks
        outputs += [OutputStats(m.message(), (), m.steps, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0, 1, fp32)
                    for m in self.mismatches[index]]
        outputs += [compare_output(f"{n} (int8 vs float model)", got[n], float_want[n], REPORTED) for n in float_want]
        decisions.outputs = None
        return CaseResult(candidate.kind.value, case, outputs)


def judge_for(precision: str, graphs: Mapping, cfg, limits, model, runner_options: Mapping,
              fp32_options: Mapping | None = None):
    """The judge of a graph set in `precision` ("fp32", "fp16", "bf16" or "int8"), and the runner options its
    candidates need. `graphs`: GraphKind -> graph path; `model`: the eager model (any dtype); `fp32_options`:
    the runner options of an fp32 graph of the same set (plugin graphs need their own)."""
    import onnx

    from seq2trt.exporters import spec

    from seq2trt.validation.parity import Fp32Judge
    from seq2trt.runtime.runners import EagerRunner, OrtRunner

    kinds = tuple(spec.GraphKind)
    if precision == "fp32":
        return Fp32Judge(), dict(runner_options)
    if precision == "int8":
        from seq2trt.validation.int8_reference import expose_decisions, quantized_reference

        built = [quantized_reference(model, onnx.load(graphs[kind])) for kind in kinds]
        quantized = tuple(EagerRunner(ref, kind, limits, name="eager-fp64-int8") for (ref, _), kind in zip(built, kinds))
        prepare = runner_options.get("prepare")
        options = {**runner_options, "prepare": (lambda m: expose_decisions(prepare(m))) if prepare else expose_decisions}
        return Int8Judge(quantized, tuple(m for _, m in built)), options
    if fp32_options is None:
        fp32_options = {k: v for k, v in runner_options.items() if k not in ("prepare", "custom_op_libraries")}
    twins = tuple(OrtRunner(graphs[kind], cfg, kind, "fp32", limits, name=f"onnxruntime-{TWIN}",
                            **twin_options(fp32_options)) for kind in kinds)
    rounded = rounded_model(model, precision)
    peer = peer_model(model, precision)
    return ReducedJudge(precision, twins, tuple(EagerRunner(rounded, k, limits, name="eager-fp64-rounded") for k in kinds),
                        tuple(EagerRunner(peer, k, limits, name=f"eager-{precision}") for k in kinds)), dict(runner_options)
