"""The TensorRT backend: one engine of the graph contract behind the shared `Runner` interface.

`TensorRTRunner(plan, cfg, kind, dtype, limits, flavour, build_info)`: on activation it imports the flavour
(`exporters.tensorrt.trt_compat`), registers the attention plugin (plugin engines need its creator at deserialization),
checks that the engine can run here (`trt_compat.check_engine`: flavour, version, compute capability, with a message
saying how to rebuild), deserializes it and makes one execution context and one CUDA stream.
`infer(feed)` takes numpy like every runner; `infer_device(feed)` takes and returns torch CUDA tensors, so a
decoding loop can feed the present K/V back as the next past without a host round trip. Shapes outside the
engine's optimization profile are refused before TensorRT sees them, with the limits named.

Device buffers and the stream are torch's (a core dependency); deserializing and running need an NVIDIA GPU.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from seq2trt.exporters import spec
from seq2trt.exporters.tensorrt import trt_compat
from seq2trt.core.errors import ArtifactError, DependencyError, InputError

from seq2trt.runtime.runners import Runner

logger = logging.getLogger(__name__)

Plan = Path | bytes | Callable[[], Path | bytes]


def profile_problems(shapes: Mapping[str, tuple[int, ...]],
                     profile: Mapping[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]) -> list[str]:
    """Every input whose shape lies outside the profile's [min, max], with the limits."""
    problems = []
    for name, shape in shapes.items():
        if name not in profile:
            continue
        lo, _, hi = profile[name]
        if len(shape) != len(lo) or any(not a <= s <= b for s, a, b in zip(shape, lo, hi)):
            problems.append(f"{name} {tuple(shape)} is outside the engine's profile [{tuple(lo)}, {tuple(hi)}]")
    return problems


def _torch_cuda():
    import torch

    if not torch.cuda.is_available():
        raise DependencyError("TensorRT engines run on an NVIDIA GPU and this machine has none visible to torch "
                              "(or torch is a CPU build); use --backend ort here")
    return torch


class TensorRTRunner(Runner):
    def __init__(self, plan: Plan, cfg, kind: spec.GraphKind, dtype: str, limits: spec.Limits,
                 flavour: str = "tensorrt-rtx", build_info: Mapping | None = None, device: int = 0,
                 name: str | None = None):
        self.flavour = trt_compat.flavour_of(flavour)
        super().__init__(name or self.flavour.value, cfg, kind, dtype, limits)
        self._source, self.build_info, self.device = plan, build_info, device
        self.engine = self.context = self.stream = None

    # -- lifecycle
    def _activate(self) -> None:
        torch = _torch_cuda()
        trt = trt_compat.load(self.flavour)
        from seq2trt.plugins import tensorrt_plugin

        tensorrt_plugin.register(trt)
        major, minor = torch.cuda.get_device_capability(self.device)
        if self.build_info is not None:
            trt_compat.check_engine(self.build_info, self.flavour, trt.__version__, 10 * major + minor)
        source = self._source() if callable(self._source) else self._source
        plan = Path(source).read_bytes() if isinstance(source, (str, Path)) else source
        torch.cuda.set_device(self.device)
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine(plan)
        if self.engine is None:
            raise ArtifactError(f"{self.flavour.value} {trt.__version__} could not deserialize the {self.kind.value} "
                                f"engine on sm_{major}{minor} (other TensorRT version or GPU?); rebuild it with "
                                f"`seq2trt build OUT --backend {self.flavour.value} --force`")
        self.context = self.engine.create_execution_context()
        self.stream = torch.cuda.Stream(self.device)
        self._trt = trt
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        is_input = lambda n: self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT
        self.input_names = [n for n in names if is_input(n)]
        self.output_names = [n for n in names if not is_input(n)]
        self.profile = {n: tuple(tuple(s) for s in self.engine.get_tensor_profile_shape(n, 0))
                        for n in self.input_names}

    def _deactivate(self) -> None:
        self.context = self.engine = self.stream = None

    # -- inference
    def _torch_dtype(self, name: str):
        import torch

        trt = self._trt
        return {trt.DataType.FLOAT: torch.float32, trt.DataType.HALF: torch.float16, trt.DataType.BF16: torch.bfloat16,
                trt.DataType.INT64: torch.int64, trt.DataType.INT32: torch.int32,
                trt.DataType.BOOL: torch.bool}[self.engine.get_tensor_dtype(name)]

    def infer_device(self, feed: Mapping) -> dict:
        """Torch CUDA tensors in, torch CUDA tensors out (outputs are fresh tensors, ready to be fed back)."""
        import torch

        problems = profile_problems({n: tuple(t.shape) for n, t in feed.items()}, self.profile)
        missing = sorted(set(self.input_names) - set(feed))
        if missing:
            problems.append(f"missing inputs {missing}")
        if problems:
            raise InputError(f"{self.name} {self.kind.value} engine: " + "; ".join(problems) +
                             "; rebuild with larger --max-batch/--max-src-len/--max-tgt-len to go beyond")
        keep = []
        for name in self.input_names:
            tensor = feed[name].to(device=f"cuda:{self.device}", dtype=self._torch_dtype(name)).contiguous()
            keep.append(tensor)
            self.context.set_input_shape(name, tuple(tensor.shape))
            self.context.set_tensor_address(name, tensor.data_ptr())
        outputs = {}
        for name in self.output_names:
            shape = tuple(self.context.get_tensor_shape(name))
            outputs[name] = torch.empty(shape, dtype=self._torch_dtype(name), device=f"cuda:{self.device}")
            self.context.set_tensor_address(name, outputs[name].data_ptr())
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # inputs copied on the current stream
        if not self.context.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError(f"{self.name}: TensorRT failed to enqueue the {self.kind.value} engine (see its log)")
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        for tensor in keep + list(outputs.values()):
            tensor.record_stream(self.stream)
        return outputs

    def _infer(self, feed):
        import torch

        def to_torch(array: np.ndarray):
            if self.dtype == "bf16" and array.dtype == spec.numpy_dtype("bf16"):  # numpy has no bf16 of its own
                return torch.from_numpy(np.ascontiguousarray(array).view(np.uint16)).view(torch.bfloat16)
            return torch.from_numpy(np.ascontiguousarray(array))

        outputs = self.infer_device({n: to_torch(v) for n, v in feed.items()})
        torch.cuda.synchronize(self.device)
        float_dtype = spec.numpy_dtype(self.dtype)
        result = {}
        for name, tensor in outputs.items():
            if tensor.dtype == torch.bfloat16:
                result[name] = tensor.view(torch.uint16).cpu().numpy().view(float_dtype)
            else:
                result[name] = tensor.cpu().numpy()
        return result


def runner_for(engine_dir: Path, kind: spec.GraphKind, cfg, limits: spec.Limits | None = None) -> TensorRTRunner:
    """A runner for one graph of an engine directory (under an export's engines/), its plan checked against
    build.json and build.json against the graphs of that export (`verify_engines`)."""
    from seq2trt.exporters.tensorrt.engines import verify_engines

    info = verify_engines(engine_dir)
    limits = limits or spec.Limits(**info["limits"])
    plan = Path(engine_dir) / info["graphs"][kind.value]["plan"]
    return TensorRTRunner(plan, cfg, kind, info["dtype"], limits, info["flavour"], info)
