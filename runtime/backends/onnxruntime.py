"""Backend kind `onnxruntime`: an export's encoder and decoder graphs (a graph set: plain, fused-ort, int8-ort) on
ONNX Runtime's CPU provider, driven step by step by the searches of `reference_model.decoding` with the KV cache
fed back as host arrays (`RunnerStepModel`)."""

from __future__ import annotations

import contextlib
from pathlib import Path

from seq2trt.exporters import spec
from seq2trt.runtime.backends import BenchContext, BenchModel, bench_opened
from seq2trt.runtime.backends.graph_sets import graph_set

CONCURRENT = True  # ONNX Runtime sessions may run from several threads at once; the step model keeps no state


def unavailable(backend) -> str | None:
    return None


def graph_folder(out: Path, backend, manifest) -> Path:
    """The verified folder of the backend's encoder and decoder graphs."""
    return graph_set(backend.graphs).verified_folder(out, manifest)


def runners(out: Path, backend, manifest, threads: int, device: str = "cpu") -> list:
    """Encoder and decoder runners of the backend's verified graphs, with the options the graph set needs."""
    from seq2trt.runtime.runners import OrtRunner

    folder = graph_folder(out, backend, manifest)
    options = graph_set(backend.graphs).options(manifest.dtype)
    return [OrtRunner(folder / kind.filename, manifest.config, kind, manifest.dtype, manifest.limits,
                      intra_op_threads=threads, name=backend.name, device=device, **options)
            for kind in spec.GraphKind]


def step_model(encoder, decoder):
    """The step model over an encoder and a decoder runner of this kind."""
    from seq2trt.runtime.step_model import RunnerStepModel

    return RunnerStepModel(encoder, decoder)


@contextlib.contextmanager
def entered(pair, wrap):
    """`wrap(*runners)` with the runners active, closed on exit."""
    with contextlib.ExitStack() as stack:
        for runner in pair:
            stack.enter_context(runner)
        yield wrap(*pair)


@contextlib.contextmanager
def open(out: Path, backend, manifest, checkpoint: Path | None, threads: int):
    with entered(runners(out, backend, manifest, threads), step_model) as model:
        yield model


def check(out: Path, backend, manifest) -> None:
    graph_folder(out, backend, manifest)


def bench(ctx: BenchContext, backend) -> BenchModel:
    return bench_opened(open, ctx, backend)
