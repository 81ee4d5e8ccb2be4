"""Launching the precompiled attention kernels with the CUDA driver: the TensorRT plugin's one door to the GPU.

The TensorRT plugin (`tensorrt_plugin`) knows only `KernelLauncher`: given one `AttentionCall` (the op's
attributes, dtype, concrete shapes, device pointers, workspace and TensorRT's stream) it enqueues the kernels.
- `launch_plan(call)`: the call's launches, packed for cuLaunchKernel. Which kernels, in what order, with what grid
  and arguments, is `kernels.launch_plan.plan`, and each kernel's parameter order is `kernels.launch_plan.SIGNATURES` (plus
  the two scratch pointers every Triton 3.9 kernel takes), so this module never spells them; here they become
  ctypes values, from a template cached per shape signature. Pure Python: it runs, and is tested, without a GPU.
- `CudaDriverLauncher`: loads the kernels compiled ahead of time by `kernels.aot` (its index, `aot.read_index`)
  with the CUDA driver API (cuda-python `cuModuleLoadData`, once per kernel and process; PTX is JIT-compiled by
  the driver at that load, never per call) and launches them with `cuLaunchKernel` on the given stream.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from seq2trt.core.errors import ArtifactError, DependencyError, InputError

from seq2trt.plugins.kernels import aot
from seq2trt.plugins.kernels.launch_plan import DIVISIBILITY, SCRATCH_PARAMS, SIGNATURES, Launch, plan
from seq2trt.plugins.op import AttentionAttrs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttentionCall:
    attrs: AttentionAttrs
    dtype: str  # "fp32" | "fp16" | "bf16"
    input_shapes: tuple[tuple[int, ...], ...]
    inputs: tuple[int, ...]  # device pointers, in `op.input_names` order (the position bias last, when given)
    outputs: tuple[int, ...]  # device pointers, in `op.OUTPUTS[kind]` order
    workspace: int  # device pointer to `kernels.launch_plan.workspace_bytes(...)` bytes
    stream: int  # cudaStream_t of TensorRT's enqueue


class KernelLauncher(Protocol):
    def launch(self, call: AttentionCall) -> None: ...


_CTYPES = {"i32": ctypes.c_int32, "fp32": ctypes.c_float}


@dataclass(frozen=True)
class PackedLaunch:
    """One cuLaunchKernel: the compiled variant's index key, grid, and its parameters as ctypes values."""
    kernel: str
    grid: tuple[int, int, int]
    args: tuple[ctypes._SimpleCData, ...]


def pack(launch: Launch) -> PackedLaunch:
    """Arguments in the compiled kernel's parameter order; pointers as c_void_p; null scratch pointers last."""
    values = []
    for name, ty in SIGNATURES[launch.kernel]:
        value = launch.args[name]
        divisor = DIVISIBILITY[launch.kernel].get(name)
        if divisor and int(value) % divisor:
            fix = "pass 16-byte aligned buffers" if ty.startswith("*") else "every head_dim is a multiple of 8"
            raise InputError(f"{launch.kernel}: {name}={int(value)} is not a multiple of {divisor}, which the compiled "
                             f"kernels assume; {fix}")
        values.append(ctypes.c_void_p(int(value)) if ty.startswith("*") else _CTYPES[ty](value))
    values += [ctypes.c_void_p(0) for _ in SCRATCH_PARAMS]
    return PackedLaunch(launch.key, launch.grid, tuple(values))


_TAG_SHIFT = 44  # template pointers: (buffer number + 1) << _TAG_SHIFT, plus the byte offset into that buffer


@dataclass(frozen=True)
class _Template:
    """One packed launch with its buffer pointers left open: `pointers` lists (parameter position, buffer number,
    byte offset, must be 16-byte aligned); buffers are numbered inputs, then outputs, then the workspace."""
    kernel: str
    grid: tuple[int, int, int]
    args: tuple[ctypes._SimpleCData | None, ...]
    pointers: tuple[tuple[int, int, int, bool], ...]


@functools.lru_cache(maxsize=4096)
def _templates(attrs: AttentionAttrs, dtype: str, shapes: tuple, n_outputs: int, workspace: bool) -> tuple:
    """`plan` and `pack` once per shape signature, on tagged stand-in pointers that say which buffer each pointer
    parameter addresses (decoding changes the past length every step; an engine reuses each length's plan)."""
    n_inputs = len(shapes)
    tag = lambda number: (number + 1) << _TAG_SHIFT  # noqa: E731  16-byte aligned, far above any offset
    launches = plan(attrs, dtype, shapes, [tag(i) for i in range(n_inputs)],
                    [tag(n_inputs + i) for i in range(n_outputs)], tag(n_inputs + n_outputs) if workspace else None)
    templates = []
    for launch in launches:
        packed = pack(launch)  # checks the scalar parameters' divisibility once
        args, pointers = list(packed.args), []
        for position, (name, ty) in enumerate(SIGNATURES[launch.kernel]):
            if ty.startswith("*"):
                value = int(launch.args[name])
                pointers.append((position, (value >> _TAG_SHIFT) - 1, value & ((1 << _TAG_SHIFT) - 1),
                                 name in DIVISIBILITY[launch.kernel]))
                args[position] = None
        templates.append(_Template(packed.kernel, packed.grid, tuple(args), tuple(pointers)))
    return tuple(templates)


def launch_plan(call: AttentionCall) -> list[PackedLaunch]:
    """The launches of one TensorRT enqueue: what `pack(plan(...))` gives, from a template cached per shape
    signature with this call's pointers filled in (a workspace pointer of 0: no workspace, no flash-decoding)."""
    buffers = (*call.inputs, *call.outputs, call.workspace)
    packed = []
    for t in _templates(call.attrs, call.dtype, tuple(map(tuple, call.input_shapes)), len(call.outputs),
                        bool(call.workspace)):
        args = list(t.args)
        for position, buffer, offset, aligned in t.pointers:
            address = buffers[buffer] + offset
            if aligned and address % 16:
                name = SIGNATURES[t.kernel.split("-", 1)[0]][position][0]
                raise InputError(f"{t.kernel.split('-', 1)[0]}: {name}={address} is not a multiple of 16, which the "
                                 "compiled kernels assume; pass 16-byte aligned buffers")
            args[position] = ctypes.c_void_p(address)
        packed.append(PackedLaunch(t.kernel, t.grid, tuple(args)))
    return packed


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
        self.images = aot.read_index(index_path, compute_capability)
        self.plan = plan or launch_plan
        self.cuda = _driver()
        self._functions: dict[str, object] = {}
        self._modules: list = []  # loaded once, kept for the process's life

    def _function(self, key: str):
        if key not in self._functions:
            if key not in self.images:
                raise ArtifactError(f"no compiled kernel {key!r} in the AOT index; recompile the kernels for this "
                                    "GPU (`python -m seq2trt.plugins.kernels.aot`)")
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
        for packed in self.plan(call):
            function, img = self._function(packed.kernel), self.images[packed.kernel]
            # cuLaunchKernel takes an array of pointers to each argument value.
            pointers = (ctypes.c_void_p * len(packed.args))(*[ctypes.addressof(a) for a in packed.args])
            _check(self.cuda.cuLaunchKernel(function, *packed.grid, 32 * img.num_warps, 1, 1, img.shared,
                                            self.cuda.CUstream(call.stream), ctypes.addressof(pointers), 0))


@functools.lru_cache(maxsize=None)
def default_launcher(device: int = 0) -> KernelLauncher:
    """The launcher for this process's GPU, from the kernels package's AOT index (loaded once)."""
    cuda = _driver()
    _check(cuda.cuInit(0))
    dev = _check(cuda.cuDeviceGet(device))
    major = _check(cuda.cuDeviceGetAttribute(cuda.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev))
    minor = _check(cuda.cuDeviceGetAttribute(cuda.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))
    index = aot.index_path()
    if not index.exists():
        raise DependencyError(f"no compiled attention kernels at {index}; run `python -m seq2trt.plugins.kernels.aot "
                              f"--targets sm_{10 * major + minor}` (or set SEQ2TRT_KERNEL_DIR)")
    return CudaDriverLauncher(index, 10 * major + minor)
