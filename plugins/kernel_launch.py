"""Launching the precompiled attention kernels on TensorRT's stream: the plugin's one door to the GPU.

The TensorRT plugin (`tensorrt_plugin`) knows only `KernelLauncher`: given one `AttentionCall` (the op's
attributes, dtype, concrete shapes, device pointers, workspace and TensorRT's stream) it enqueues the kernels.
`CudaDriverLauncher` is the implementation: it loads the kernels compiled ahead of time by
`seq2trt.plugins.kernels.aot` (PTX/cubin plus index.json) with the CUDA driver API (cuda-python
`cuModuleLoadData`, once per kernel and process; PTX is JIT-compiled by the driver at that load, never per call)
and launches them with `cuLaunchKernel` on the given stream. Which kernels a call needs, in what order, with what
grid and arguments, is `kernels.launch.launch_plan` — it owns the kernels' signatures, so this module never
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

from .op import AttentionAttrs

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


def _launch_module():
    """`seq2trt.plugins.kernels.launch`: the kernels' launch plans (imports torch, not triton)."""
    try:
        from seq2trt.plugins.kernels import launch
    except ImportError as exc:
        raise DependencyError(f"the attention kernels' launch plans (seq2trt.plugins.kernels.launch) are not "
                              f"importable ({exc}); the TensorRT plugin cannot size or run them") from exc
    return launch


def workspace_size(attrs: AttentionAttrs, dtype: str, max_shapes: Sequence[tuple[int, ...]]) -> int:
    """Scratch bytes for any call up to the profile's largest batch (flash-decoding partials; the kernels' own
    formula, `kernels.launch.workspace_bytes`, since one query token takes flash-decoding in every kind)."""
    return int(_launch_module().workspace_bytes(attrs, max_shapes[0][0]))


@dataclass(frozen=True)
class KernelImage:
    """One compiled kernel as the kernels' AOT index lists it."""
    key: str
    function: str  # the entry point's mangled name in the image
    image: Path  # cubin for this compute capability, or PTX
    num_warps: int
    shared: int  # dynamic shared memory bytes


def read_index(index_path: Path, compute_capability: int) -> dict[str, KernelImage]:
    """Kernels for one GPU from the AOT index: the cubin built for this compute capability, else the PTX of the
    newest target not above it (the driver JIT-compiles PTX forward, never backward).

    Index (`seq2trt.plugins.kernels.aot`): {"kernels": [{"key", "name", "target": "sm_86", "cubin", "ptx",
    "num_warps", "shared", "global_scratch_size"}, ...]}, paths relative to the index's directory.
    """
    root = Path(index_path).parent
    best: dict[str, tuple[int, KernelImage]] = {}
    for e in json.loads(Path(index_path).read_text())["kernels"]:
        cc = int(e["target"].removeprefix("sm_"))
        if cc > compute_capability:
            continue
        exact = cc == compute_capability
        rank = 1000 if exact else cc
        if e["key"] in best and best[e["key"]][0] >= rank:
            continue
        if e.get("global_scratch_size", 0):
            raise RuntimeError(f"kernel {e['key']} needs {e['global_scratch_size']} B of global scratch, which this "
                               "launcher does not allocate; recompile it without")
        image = root / (e["cubin"] if exact else e["ptx"])
        best[e["key"]] = (rank, KernelImage(e["key"], e["name"], image, int(e["num_warps"]), int(e.get("shared", 0))))
    return {key: image for key, (_, image) in best.items()}


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
        self.plan = plan or _launch_module().launch_plan
        self.cuda = _driver()
        self._functions: dict[str, object] = {}
        self._modules: list = []  # loaded once, kept for the process's life

    def _function(self, key: str):
        if key not in self._functions:
            if key not in self.images:
                raise KeyError(f"no compiled kernel {key!r} in the AOT index; recompile the kernels for this GPU")
            img = self.images[key]
            data = img.image.read_bytes()
            if img.image.suffix == ".ptx":
                data += b"\0"  # cuModuleLoadData reads PTX as a NUL-terminated string
            module = _check(self.cuda.cuModuleLoadData(data))
            function = _check(self.cuda.cuModuleGetFunction(module, img.function.encode()))
            if img.shared > 48 * 1024:  # above 48 KiB a kernel must opt in, as triton's own launcher does
                attribute = self.cuda.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                _check(self.cuda.cuFuncSetAttribute(function, attribute, img.shared))
            self._modules.append(module)
            self._functions[key] = function
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
    from seq2trt.plugins.kernels import aot

    index = aot.default_dir() / "index.json"  # SEQ2TRT_KERNEL_DIR, else ~/.cache/seq2trt/kernels
    if not index.exists():
        raise DependencyError(f"no compiled attention kernels at {index}; run `python -m seq2trt.plugins.kernels.aot "
                              f"--targets sm_{10 * major + minor}` (or set SEQ2TRT_KERNEL_DIR)")
    return CudaDriverLauncher(index, 10 * major + minor)
