"""Backend kind `ort_search`: generate.onnx, the whole search in one ONNX Runtime session run (ORT's BeamSearch
over the fused graphs, or the int8 ones), on the CPU provider or, for `ort-generate-cuda`, the CUDA provider. It is
not a step model: `GenerateModel.decode` takes the searches' arguments and returns their outputs."""

from __future__ import annotations

import contextlib
from pathlib import Path

from seq2trt.runtime.backends import BenchContext, BenchModel, bench_opened
from seq2trt.runtime.backends.graph_sets import graph_set

CONCURRENT = False  # one BeamSearch run at a time per session: its subgraph sessions hold the search's state


def unavailable(backend) -> str | None:
    from seq2trt.runtime.backends.ort_cuda import unavailable as no_cuda

    return no_cuda(backend) if backend.device == "cuda" else None


@contextlib.contextmanager
def open(out: Path, backend, manifest, checkpoint: Path | None, threads: int):
    from seq2trt.runtime.backends.ort_cuda import refuse_unavailable
    from seq2trt.runtime.ort_search import GenerateModel

    if backend.device == "cuda":
        refuse_unavailable(backend)
    with GenerateModel(out, manifest, threads, int8=graph_set(backend.graphs).quantized,
                       device=backend.device) as generate:
        yield generate


def check(out: Path, backend, manifest) -> None:
    graph_set(backend.graphs).verified_folder(out, manifest)


def bench(ctx: BenchContext, backend) -> BenchModel:
    return bench_opened(open, ctx, backend)
