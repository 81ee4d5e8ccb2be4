"""Launching the precompiled attention kernels on TensorRT's stream: the plugin's one door to the GPU.

The TensorRT plugin (`tensorrt_plugin`) knows only `KernelLauncher`: given one `AttentionCall` (the op's
attributes, dtype, concrete shapes, device pointers, workspace and TensorRT's stream) it enqueues the kernels.
`CudaDriverLauncher` is the implementation: it loads the kernels compiled ahead of time by
`seq2trt.plugins.kernels` (PTX/cubin plus a JSON index) with the CUDA driver API (cuda-python
`cuModuleLoadData`, once per kernel and process; PTX is JIT-compiled by the driver at that load, never per call)
and launches them with `cuLaunchKernel` on the given stream. Which kernels a call needs, in what order, with what
grid and arguments, is the kernels package's `launch_plan` — it owns the kernels' signatures, so this module never
spells them.

Nothing here runs without a GPU; `workspace_size` is pure Python because the builder asks for it on CPU.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

from seq2trt.reference_model.errors import DependencyError

from .op import AttentionAttrs, AttentionKind

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttentionCall:
    attrs: AttentionAttrs
    dtype: str  # "fp32" | "fp16" | "bf16"
    input_shapes: tuple[tuple[int, ...], ...]
    inputs: tuple[int, ...]  # device pointers, in `op.INPUTS[kind]` order
    outputs: tuple[int, ...]  # device pointers, in `op.OUTPUTS[kind]` order
    workspace: int  # device pointer to `workspace_size(...)` bytes
    stream: int  # cudaStream_t of TensorRT's enqueue


@dataclass(frozen=True)
class KernelLaunch:
    """One cuLaunchKernel: the kernel's index key, grid, and its arguments as ctypes values in signature order."""
    kernel: str
    grid: tuple[int, int, int]
    args: tuple[ctypes._SimpleCData, ...]


class KernelLauncher(Protocol):
    def launch(self, call: AttentionCall) -> None: ...


def _kernels():
    try:
        from seq2trt.plugins import kernels
    except ImportError as exc:
        raise DependencyError(f"the attention kernels (seq2trt.plugins.kernels) are not importable ({exc}); "
                              "the TensorRT plugin cannot run without them") from exc
    return kernels


def workspace_size(attrs: AttentionAttrs, dtype: str, max_shapes: Sequence[tuple[int, ...]]) -> int:
    """Scratch bytes at the largest shapes: the flash-decoding partials of decoder self-attention, else 0.

    Sized for the kernels' most splits, so any shape of the profile fits (kernels.launch owns the formula).
    """
    if attrs.kind is not AttentionKind.DECODER_SELF:
        return 0
    try:
        from seq2trt.plugins.kernels import attention, launch
    except ImportError as exc:
        raise DependencyError(f"sizing the plugin's workspace needs seq2trt.plugins.kernels ({exc}); install "
                              "triton (pip install triton)") from exc
    batch = max_shapes[0][0]
    return int(launch.decode_workspace_bytes(batch * attrs.num_heads, attrs.head_dim, attention.MAX_SPLITS))


@dataclass(frozen=True)
class KernelImage:
    """One compiled kernel as the kernels' AOT index lists it."""
    key: str
    function: str  # the entry point's mangled name in the image
    image: Path  # cubin for this compute capability, or PTX
    num_warps: int
    shared: int  # dynamic shared memory bytes


def read_index(index_path: Path, compute_capability: int) -> dict[str, KernelImage]:
    """Kernels for one GPU from the AOT index: the cubin of this compute capability if present, else the PTX.

    Index format (written by `seq2trt.plugins.kernels`' aot module): {"kernels": [{"key", "name", "target":
    "sm_86", "cubin", "ptx", "num_warps", "shared"}, ...]}, paths relative to the index.
    """
    entries = json.loads(Path(index_path).read_text())["kernels"]
    chosen: dict[str, KernelImage] = {}
    for e in entries:
        exact = e.get("target") == f"sm_{compute_capability}" and e.get("cubin")
        if not exact and (e["key"] in chosen or not e.get("ptx")):
            continue
        image = Path(index_path).parent / (e["cubin"] if exact else e["ptx"])
        chosen[e["key"]] = KernelImage(e["key"], e["name"], image, int(e["num_warps"]), int(e.get("shared", 0)))
    return chosen


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # cuda-python < 12.6
        except ImportError as exc:
            raise DependencyError("the TensorRT plugin launches kernels with cuda-python; install it with: "
                                  "pip install cuda-python") from exc
    return driver


def _check(result):
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return rest[0] if len(rest) == 1 else rest


class CudaDriverLauncher:
    """Loads kernel images lazily (once each) into the current CUDA context and launches them on a stream."""

    def __init__(self, index_path: Path, compute_capability: int, plan=None):
        self.images = read_index(index_path, compute_capability)
        self.plan = plan or _kernels().launch_plan
        self.cuda = _driver()
        self._functions: dict[str, object] = {}

    def _function(self, key: str):
        if key not in self._functions:
            if key not in self.images:
                raise KeyError(f"no compiled kernel {key!r} in the AOT index; recompile the kernels for this GPU")
            img = self.images[key]
            module = _check(self.cuda.cuModuleLoadData(img.image.read_bytes()))
            self._functions[key] = _check(self.cuda.cuModuleGetFunction(module, img.function.encode()))
        return self._functions[key]

    def launch(self, call: AttentionCall) -> None:
        for launch in self.plan(call):
            img, function = self.images[launch.kernel], self._function(launch.kernel)
            # cuLaunchKernel takes an array of pointers to each argument value.
            pointers = (ctypes.c_void_p * len(launch.args))(*[ctypes.addressof(a) for a in launch.args])
            _check(self.cuda.cuLaunchKernel(function, *launch.grid, 32 * img.num_warps, 1, 1, img.shared,
                                            self.cuda.CUstream(call.stream), ctypes.addressof(pointers), 0))


@functools.lru_cache(maxsize=None)
def default_launcher(device: int = 0) -> KernelLauncher:
    """The launcher for this process's GPU, from the kernels package's AOT index (loaded once)."""
    cuda = _driver()
    _check(cuda.cuInit(0))
    dev = _check(cuda.cuDeviceGet(device))
    major = _check(cuda.cuDeviceGetAttribute(cuda.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev))
    minor = _check(cuda.cuDeviceGetAttribute(cuda.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))
    return CudaDriverLauncher(_kernels().index_path(), 10 * major + minor)
