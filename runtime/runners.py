"""Backends behind one runner (Polygraphy's shape): one runner runs one graph of the graph contract.

`with runner: runner.infer(feed) -> dict[name, np.ndarray]`. The base checks the feed against the spec
(names, dtypes, shapes, limits) and times each call (`last_inference_time`, seconds); a backend implements
only `_activate`, `_infer` and `_deactivate`. Runners take a model (or a path) or a zero-argument callable that
loads it, so loading stays lazy until the runner is activated. ONNX Runtime sessions come from the one session
factory, `exporters.ort_session` (CPU, or CUDA on a device id).

ONNX Runtime's CPU provider has no bf16 kernels: `OrtRunner` runs a bf16 graph on CPU as its fp32 twin with
every bf16 tensor rounded to bf16 after the op that makes it (fp32 arithmetic, bf16 storage — what GPU
kernels with fp32 accumulation do). On the CUDA provider bf16 graphs run as they are.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from seq2trt.core.dtypes import dtype_name
from seq2trt.exporters import ort_session, spec
from seq2trt.core.errors import ArtifactError, DependencyError, first_line

class Runner:
    """Base: context manager, `input_metadata()`, checked and timed `infer(feed)`."""

    def __init__(self, name: str, cfg, kind: spec.GraphKind, dtype: str, limits: spec.Limits):
        self.name, self.cfg, self.kind, self.dtype, self.limits = name, cfg, kind, dtype, limits
        self.is_active = False
        self.last_inference_time: float | None = None

    def __enter__(self) -> "Runner":
        self._activate()
        self.is_active = True
        return self

    def __exit__(self, *exc) -> None:
        self.is_active = False
        self._deactivate()

    def input_metadata(self) -> dict[str, tuple[np.dtype, tuple[str | int, ...]]]:
        """Input name -> (numpy dtype, axes), from the spec."""
        float_dtype = spec.numpy_dtype(self.dtype)
        return {s.name: (np.dtype(np.int64) if s.dtype == "int64" else float_dtype, s.axes)
                for s in spec.inputs(self.cfg, self.kind)}

    def infer(self, feed: Mapping[str, np.ndarray], check: bool = True) -> dict[str, np.ndarray]:
        if not self.is_active:
            raise RuntimeError(f"runner {self.name} is not active: use it inside `with runner:`")
        if check:
            spec.check_feed(self.cfg, self.kind, self.dtype, self.limits, feed)
        start = time.perf_counter()
        outputs = self._infer(feed)
        self.last_inference_time = time.perf_counter() - start
        return outputs

    def _activate(self) -> None:
        pass

    def _deactivate(self) -> None:
        pass

    def _infer(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise NotImplementedError


def _to_numpy(t, dtype: np.dtype) -> np.ndarray:
    import torch

    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.float().numpy().astype(dtype)
    return t.numpy().astype(dtype, copy=False)


@contextlib.contextmanager
def torch_threads(threads: int):
    """torch's intra-op threads at `threads` for the block, restored after (the eager model, and the step loops'
    search arithmetic: log-softmax, top-k, beside ONNX Runtime's own threads)."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


class EagerRunner(Runner):
    """The PyTorch model as a graph of the contract, at the model's own dtype (float64 for a reference).

    Float inputs of any dtype are converted to the model's dtype, so a float64 model can replay exactly the
    fp16 inputs fed to a graph under test; float outputs come back in the model's dtype.
    """

    def __init__(self, model, kind: spec.GraphKind, limits: spec.Limits | None = None, name: str = "eager",
                 threads: int | None = 1):
        """`model`: a `Seq2SeqTransformer`, or a zero-argument callable that loads one. `threads`: torch's
        intra-op threads while active (None: leave as is); one thread is fastest for the small calls of
        decoding and does not collapse when the CPU is shared."""
        import torch

        self._source, self.threads, self._held = model, threads, contextlib.ExitStack()
        cfg = model.cfg if isinstance(model, torch.nn.Module) else None
        super().__init__(name, cfg, kind, "fp32", limits)

    def _activate(self) -> None:
        import torch

        model = self._source if isinstance(self._source, torch.nn.Module) else self._source()
        self.model, self.cfg = model.eval(), model.cfg
        self.limits = self.limits or spec.Limits.for_model(self.cfg)
        self._torch_dtype = next(model.parameters()).dtype
        self.dtype = dtype_name(self._torch_dtype) or "fp32"  # float64: the fp32 contract's inputs
        self._np_dtype = np.dtype(np.float64) if self._torch_dtype == torch.float64 else spec.numpy_dtype(self.dtype)
        if self.threads:
            self._held.enter_context(torch_threads(self.threads))

    def _deactivate(self) -> None:
        self._held.close()

    def infer(self, feed: Mapping[str, np.ndarray], check: bool = False) -> dict[str, np.ndarray]:
        """Only names and shapes matter here (any float dtype is converted), so the dtype check is off."""
        if check:
            spec.check_feed(self.cfg, self.kind, self.dtype, self.limits, feed)
        return super().infer(feed, check=False)

    def _tensor(self, array: np.ndarray):
        import torch

        if np.issubdtype(array.dtype, np.integer):
            return torch.as_tensor(np.ascontiguousarray(array), dtype=torch.int64)
        return torch.as_tensor(np.asarray(array, dtype=np.float64)).to(self._torch_dtype)

    def _infer(self, feed):
        import torch

        t = {k: self._tensor(v) for k, v in feed.items()}
        with torch.inference_mode():
            if self.kind is spec.GraphKind.ENCODER and spec.audio_source(self.cfg):  # features; Whisper masks nothing
                features = t["input_features"]
                hidden = self.model.encode(features, torch.ones(len(features), self.cfg.max_src_len, dtype=torch.int64))
                values = [hidden] + spec.flatten_kv(self.model.cross_kv(hidden))
            elif self.kind is spec.GraphKind.ENCODER:
                hidden = self.model.encode(t["input_ids"], t["attention_mask"])
                values = [hidden] + spec.flatten_kv(self.model.cross_kv(hidden))
            else:
                kv = lambda side: spec.unflatten_kv([t[name] for name in spec.kv_names(self.cfg, side, "past")])
                logits, present = self.model.decode_step(t["input_ids"], t["encoder_attention_mask"],
                                                         kv("encoder"), kv("decoder"))
                values = [logits] + spec.flatten_kv(present)
        names = [s.name for s in spec.outputs(self.cfg, self.kind)]
        return {n: _to_numpy(v, self._np_dtype) for n, v in zip(names, values)}


class OrtRunner(Runner):
    """ONNX Runtime on one graph file (or bytes, or a callable returning either).

    `prepare` rewrites the serialized graph before the session loads it and `custom_op_libraries` are
    registered with the session: the hooks a graph set with custom nodes (plugin graphs on CPU) needs.
    """

    def __init__(self, model: Path | bytes | Callable[[], Path | bytes], cfg, kind: spec.GraphKind, dtype: str,
                 limits: spec.Limits, device: str = "cpu", intra_op_threads: int = 1, name: str | None = None,
                 prepare: Callable[[bytes], bytes] | None = None, custom_op_libraries: tuple[str, ...] = (),
                 optimization: str = "basic", device_id: int = 0, data_dir: Path | None = None):
        super().__init__(name or f"onnxruntime-{device}", cfg, kind, dtype, limits)
        self._source, self.device, self.device_id, self.intra_op_threads = model, device, device_id, intra_op_threads
        self.data_dir = data_dir  # where graph bytes' external data lie (a graph file's own folder otherwise)
        self.prepare, self.custom_op_libraries = prepare, custom_op_libraries
        if optimization not in ort_session.OPTIMIZATION:
            raise ValueError(f"optimization must be one of {', '.join(ort_session.OPTIMIZATION)}, got {optimization!r}")
        self.optimization = optimization
        self.session = None
        self.emulated_bf16 = False

    def _activate(self) -> None:
        source = self._source() if callable(self._source) else self._source
        where = source if isinstance(source, (str, Path)) else f"the {self.kind.value} graph"
        cpu = ort_session.providers(self.device, self.device_id)[0] == "CPUExecutionProvider"
        self.emulated_bf16 = self.dtype == "bf16" and cpu  # the CPU provider has no bf16 kernels
        rewrites = [f for f in (self.prepare, emulate_bf16 if self.emulated_bf16 else None) if f is not None]
        try:
            self.session, self.threading = ort_session.open_session(
                source, device=self.device, device_id=self.device_id, threads=self.intra_op_threads,
                shared_pool=True, optimization=self.optimization, custom_op_libraries=self.custom_op_libraries,
                rewrite=_chain(rewrites) if rewrites else None, data_dir=self.data_dir)
        except DependencyError:
            raise
        except Exception as exc:  # protobuf's DecodeError, ORT's Fail / InvalidGraph: a damaged or foreign file
            first = first_line(exc)
            raise ArtifactError(f"ONNX Runtime cannot load {where} ({first}); re-export (and re-fuse) it") from exc
        self.output_names = [o.name for o in self.session.get_outputs()]
        self._where = where
        self._check_session(where)

    def _check_session(self, where) -> None:
        """The session's inputs and outputs against the graph contract: names, element types, and the inputs' ranks
        and fixed sizes (a damaged graph that still loads would otherwise fail inside ONNX Runtime at run time)."""
        fix = "re-export it with `seq2trt export --force` (and re-fuse)"
        float_type = ("float" if self.emulated_bf16
                      else {"fp32": "float", "fp16": "float16", "bf16": "bfloat16"}[self.dtype])
        problems = []
        for io, want, have in (("inputs", spec.inputs(self.cfg, self.kind), self.session.get_inputs()),
                               ("outputs", spec.outputs(self.cfg, self.kind), self.session.get_outputs())):
            have = {v.name: v for v in have if spec.parse_debug_name(v.name) is None}  # a debug copy's extra outputs
            if sorted(s.name for s in want) != sorted(have):
                raise ArtifactError(f"{where} is not a seq2trt {self.kind.value} graph of this model: its {io} differ "
                                    f"from the graph contract's; {fix}")
            for s in want:
                value = have[s.name]
                expected = f"tensor({'int64' if s.dtype == 'int64' else float_type})"
                if value.type != expected:
                    problems.append(f"{s.name} is {value.type}, the contract's is {expected}")
                if io == "inputs":
                    problems += _shape_problems(s, value.shape)
        if problems:
            raise ArtifactError(f"{where} breaks the graph contract: {'; '.join(problems)}; {fix}")

    def _deactivate(self) -> None:
        self.session = None

    def _infer(self, feed):
        if self.emulated_bf16:
            feed = {k: v.astype(np.float32) if v.dtype != np.int64 else v for k, v in feed.items()}
        try:
            values = self.session.run(self.output_names, feed if isinstance(feed, dict) else dict(feed))
        except _ort_errors() as exc:  # feeds follow the contract (checked, or the graph's own outputs fed back)
            first = first_line(exc)
            raise ArtifactError(f"ONNX Runtime failed to run {self._where} ({first}); the graph is damaged or not "
                                "from this export: re-export it with `seq2trt export --force` (and re-fuse)") from exc
        outputs = dict(zip(self.output_names, values))
        if self.emulated_bf16:
            bf16 = spec.numpy_dtype("bf16")
            outputs = {k: v.astype(bf16) for k, v in outputs.items()}
        return outputs


def _chain(rewrites: list[Callable[[bytes], bytes]]) -> Callable[[bytes], bytes]:
    """The rewrites applied in order (the plugin nodes' CPU form, then bf16 emulation)."""
    def rewrite(model: bytes) -> bytes:
        for f in rewrites:
            model = f(model)
        return model
    return rewrite


def _shape_problems(tensor: spec.TensorSpec, shape) -> list[str]:
    """An input's shape as the session declares it against its spec: the same rank, the fixed sizes, and a free
    (symbolic or unknown) size on each named axis, which the contract lets vary."""
    shape = list(shape or [])
    if len(shape) != len(tensor.axes):
        return [f"{tensor.name} has rank {len(shape)} {shape}, the contract's is {len(tensor.axes)} {tensor.axes}"]
    bad = [f"{dim} for {axis}" for axis, dim in zip(tensor.axes, shape)
           if isinstance(dim, int) and dim != axis]  # a named axis fixed to a size, or another fixed size
    return [f"{tensor.name} has {', '.join(bad)}"] if bad else []


def _ort_errors() -> tuple[type[Exception], ...]:
    """ONNX Runtime's own exceptions (its pybind module's classes) that running a session raises."""
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    return tuple(getattr(state, name) for name in ("Fail", "InvalidArgument", "InvalidGraph", "RuntimeException",
                                                   "NotImplemented", "EPFail", "EngineError") if hasattr(state, name))


# Ops that only move or select values: their bf16 outputs are already bf16-exact, no rounding needed.
_MOVES_ONLY = {"Reshape", "Transpose", "Concat", "Gather", "Slice", "Squeeze", "Unsqueeze", "Identity", "Expand",
               "Shape", "Relu"}


def emulate_bf16(model: bytes) -> bytes:
    """The fp32 twin of a bf16 graph, rounding every bf16 tensor to bf16 after the op that makes it."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from seq2trt.exporters.graph_files import widen_external

    proto = onnx.load_from_string(model)
    g = proto.graph
    values = [*g.input, *g.output, *g.value_info]
    bf16 = {v.name for v in values if v.type.tensor_type.elem_type == TensorProto.BFLOAT16}
    for v in values:
        if v.type.tensor_type.elem_type == TensorProto.BFLOAT16:
            v.type.tensor_type.elem_type = TensorProto.FLOAT
    widen_external(g, {TensorProto.BFLOAT16})  # a big graph's weights (external data): widened by Casts
    for i, init in enumerate(g.initializer):
        if init.data_type == TensorProto.BFLOAT16 and init.data_location != TensorProto.EXTERNAL:
            g.initializer[i].CopyFrom(numpy_helper.from_array(
                numpy_helper.to_array(init).astype(np.float32), init.name))
    nodes = []
    for node in g.node:
        for attr in node.attribute:
            if node.op_type == "Cast" and attr.name == "to" and attr.i == TensorProto.BFLOAT16:
                attr.i = TensorProto.FLOAT
                bf16.add(node.output[0])
            if node.op_type == "Constant" and attr.t.data_type == TensorProto.BFLOAT16:
                attr.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(attr.t).astype(np.float32)))
        nodes.append(node)
        if node.op_type in _MOVES_ONLY:
            continue
        for j, out in enumerate(node.output):
            if out in bf16:
                node.output[j] = f"{out}__fp32"
                nodes += [helper.make_node("Cast", [f"{out}__fp32"], [f"{out}__bf16"], to=TensorProto.BFLOAT16),
                          helper.make_node("Cast", [f"{out}__bf16"], [out], to=TensorProto.FLOAT)]
    del g.node[:]
    g.node.extend(nodes)
    return proto.SerializeToString()
