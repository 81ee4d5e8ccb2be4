"""Backend kind `tensorrt`: TensorRT (or TensorRT-RTX) engines of `seq2trt build` under OUT/engines/<backend>, each
plan checked against build.json and build.json against the export, run step by step like the ONNX Runtime graphs."""

from __future__ import annotations

import contextlib
from pathlib import Path

from seq2trt.exporters import spec
from seq2trt.runtime.backends import BenchContext, BenchModel, bench_opened
from seq2trt.runtime.backends.onnxruntime import entered, step_model  # noqa: F401  (step_model: the same wrapper)

CONCURRENT = False  # one execution context per engine: calls are serialised


def unavailable(backend) -> str | None:
    from seq2trt.exporters.tensorrt import trt_compat

    if not trt_compat.has_gpu():
        return "TensorRT engines run only on an NVIDIA GPU and this machine has none"
    return None


def engine_runners(out: Path, name: str, manifest) -> tuple[tuple, dict]:
    """(TensorRT runners of the encoder and decoder engines of `name` under OUT/engines, their build.json), each plan
    checked against build.json and build.json against this export."""
    from seq2trt.exporters.tensorrt.engines import verify_engines
    from seq2trt.core.layout import engine_dir
    from seq2trt.runtime.tensorrt_runner import runner_for

    engines = engine_dir(out, name)
    info = verify_engines(engines)
    return tuple(runner_for(engines, kind, manifest.config, manifest.limits) for kind in spec.GraphKind), info


@contextlib.contextmanager
def open(out: Path, backend, manifest, checkpoint: Path | None, threads: int):
    pair, _ = engine_runners(out, backend.name, manifest)
    with entered(pair, step_model) as model:
        yield model


def check(out: Path, backend, manifest) -> None:
    """A GPU PyTorch sees (the runner's buffers live there) and the verified engines."""
    from seq2trt.runtime.tensorrt_runner import _torch_cuda

    _torch_cuda()
    engine_runners(out, backend.name, manifest)


def bench(ctx: BenchContext, backend) -> BenchModel:
    return bench_opened(open, ctx, backend)
