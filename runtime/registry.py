"""A decoding backend on an export directory, opened as a `StepModel` — the one place `translate` (and `bench`'s
in-process backends) get a backend from. Every graph it loads is checked first: the export against its manifest,
fused and int8 graphs against fusion.json / quantization.json, engines against build.json.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from seq2trt.exporters import spec
from seq2trt.exporters.manifest import Manifest, verify
from seq2trt.reference_model.errors import InputError

DECODE_BACKENDS = ("eager", "ort", "ort-fused", "ort-int8", "tensorrt", "tensorrt-rtx", "ort-generate",
                   "ort-generate-int8")
ENGINE_BACKENDS = ("tensorrt", "tensorrt-rtx")


def graph_folder(out: Path, backend: str, manifest: Manifest) -> Path:
    """The verified folder of an ONNX Runtime backend's graphs."""
    from seq2trt.exporters.fuse import Target, fused_dir, verify_fused
    from seq2trt.exporters.quantize import quantized_dir, verify_quantized

    if backend == "ort":
        return Path(out)
    if backend == "ort-fused":
        verify_fused(out, Target.ORT, manifest)
        return fused_dir(out, Target.ORT)
    verify_quantized(out, manifest)
    return quantized_dir(out)


@contextlib.contextmanager
def open_step_model(out: Path, backend: str, checkpoint: Path | None = None, threads: int = 1
                    ) -> Iterator[tuple[object, Manifest]]:
    """(StepModel, the export's manifest) for `backend` on the export in `out`; runners are closed on exit."""
    if backend not in DECODE_BACKENDS:
        raise InputError(f"unknown backend {backend!r}; choose one of {', '.join(DECODE_BACKENDS)}")
    out = Path(out)
    manifest = verify(out, [kind.filename for kind in spec.GraphKind])
    if backend == "eager":
        from seq2trt.reference_model.eager import EagerStepModel

        from seq2trt.runtime.reference_loader import load_reference

        model, _ = load_reference(manifest, checkpoint)
        yield EagerStepModel(model), manifest
        return
    if backend.startswith("ort-generate"):  # the whole search in one session run: not a StepModel (generate_backend)
        from seq2trt.runtime.ort_search import GenerateModel

        with GenerateModel(out, manifest, threads, int8=backend == "ort-generate-int8") as generate:
            yield generate, manifest
        return
    from seq2trt.runtime.step_model import RunnerStepModel

    kinds = list(spec.GraphKind)
    if backend in ENGINE_BACKENDS:
        from seq2trt.reference_model.layout import engine_dir
        from seq2trt.runtime.tensorrt_runner import runner_for

        engines = engine_dir(out, backend)
        runners = [runner_for(engines, kind, manifest.config, manifest.limits) for kind in kinds]
    else:
        from seq2trt.runtime.runners import OrtRunner

        folder = graph_folder(out, backend, manifest)
        runners = [OrtRunner(folder / kind.filename, manifest.config, kind, manifest.dtype, manifest.limits,
                             intra_op_threads=threads, name=backend,
                             optimization="extended" if backend == "ort-int8" else "basic") for kind in kinds]
    with contextlib.ExitStack() as stack:
        for runner in runners:
            stack.enter_context(runner)
        yield RunnerStepModel(*runners), manifest
