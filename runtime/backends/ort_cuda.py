"""Backend kind `ort_cuda` (`ort-cuda`): the fused ONNX Runtime graphs of an fp32, fp16 or bf16 export on ONNX
Runtime's CUDA provider, with the KV cache kept on the GPU (`runtime/device_step.py`: IO binding, the cross K/V
computed once, beams reordered there; only tokens in and a row of logits out cross the bus per step). Needs
onnxruntime-gpu (`pip install 'seq2trt[gpu]'`, docs/gpu.md) and an NVIDIA GPU; refused in one line otherwise."""

from __future__ import annotations

import contextlib
from pathlib import Path

from seq2trt.runtime.backends import BenchContext, BenchModel, bench_opened
from seq2trt.runtime.backends import onnxruntime as ort_backend

CONCURRENT = False  # one device-resident model per opened export: its calls are serialised


def unavailable(backend) -> str | None:
    """Why ONNX Runtime's CUDA provider cannot run here, naming the install; None when it can."""
    from seq2trt.exporters.ort_session import GPU_INSTALL, has_cuda
    from seq2trt.exporters.tensorrt import trt_compat

    if not has_cuda():
        return f"ONNX Runtime has no CUDA provider here (onnxruntime-gpu is not installed); {GPU_INSTALL}"
    if not trt_compat.has_gpu():
        return "ONNX Runtime's CUDA provider needs an NVIDIA GPU and this machine has none"
    return None


def refuse_unavailable(backend) -> None:
    from seq2trt.core.errors import DependencyError

    why = unavailable(backend)
    if why:
        raise DependencyError(f"backend {backend.name}: {why}")


def step_model(encoder, decoder):
    """The device-resident step model over an encoder and a decoder runner of this kind."""
    from seq2trt.runtime.device_step import DeviceStepModel

    return DeviceStepModel(encoder, decoder)


@contextlib.contextmanager
def open(out: Path, backend, manifest, checkpoint: Path | None, threads: int):
    refuse_unavailable(backend)
    pair = ort_backend.runners(out, backend, manifest, threads, device=backend.device)
    with ort_backend.entered(pair, step_model) as model:
        yield model


def check(out: Path, backend, manifest) -> None:
    refuse_unavailable(backend)
    ort_backend.graph_folder(out, backend, manifest)


def bench(ctx: BenchContext, backend) -> BenchModel:
    return bench_opened(open, ctx, backend)
