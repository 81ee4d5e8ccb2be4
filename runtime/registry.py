"""Every backend seq2trt knows, declared once (`BACKENDS`), and the one opener of a decoding backend on an export.

A declaration says what the name runs, which graphs of the export it reads (and how they are verified), whether it
needs a GPU, which extra installs it, whether it is a whole search, and which commands offer it. `translate`,
`validate`, `bench`, `serve`, the demo, the Python API and the Hugging Face model class read their choices from here.
Every graph `open_step_model` loads is checked first: the export against its manifest, fused and int8 graphs against
fusion.json / quantization.json, engines against build.json.
"""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from seq2trt.exporters import spec
from seq2trt.exporters.manifest import Manifest, verify
from seq2trt.reference_model.errors import InputError


@dataclass(frozen=True)
class Backend:
    name: str
    runs: str  # eager | onnxruntime | tensorrt | ort-search | ctranslate2 | transformers | optimum
    summary: str
    graphs: str | None = None  # the graph set it reads (validate's --graphs name); engines: their build.json says
    needs_gpu: bool = False
    extra: str | None = None  # the pip extra that installs what it needs: pip install 'seq2trt[<extra>]'
    modules: tuple[str, ...] = ()  # importable modules it needs, with the names users know them by
    ours: bool = True  # False: what users run today, timed side by side (checked against the eager model first)
    whole_search: bool = False  # the search runs inside the backend (generate.onnx): no step model
    translate: bool = True  # `translate`, the Python API
    serve: bool = False  # `seq2trt serve`
    hf_model: bool = False  # `seq2trt.hf.Seq2TrtModelForSeq2SeqLM` (encoder and decoder graphs)
    validates: bool = False  # `seq2trt validate --backend` runs its graphs
    demo: bool = False  # the demo's bench times it
    needs_import: bool = False  # loads the Hugging Face directory an imported checkpoint came from
    # The distribution whose pinned requirements must hold beside what is installed (optimum-onnx 0.1 pins
    # transformers < 4.58: beside transformers 5 it is installed but cannot run).
    peer: str | None = None


def _declare(*backends: Backend) -> dict[str, Backend]:
    return {b.name: b for b in backends}


BACKENDS: dict[str, Backend] = _declare(
    Backend("eager", "eager", "the PyTorch model of the checkpoint, on the CPU", serve=True, demo=True),
    Backend("eager-cuda", "eager", "the PyTorch model on a CUDA device", needs_gpu=True, translate=False),
    Backend("ort", "onnxruntime", "the exported graphs on ONNX Runtime", graphs="plain", serve=True, hf_model=True,
            validates=True, demo=True),
    Backend("ort-fused", "onnxruntime", "the fused ONNX Runtime graphs (MultiHeadAttention)", graphs="fused-ort",
            serve=True, hf_model=True, demo=True),
    Backend("ort-int8", "onnxruntime", "the int8 graphs of `seq2trt quantize`", graphs="int8-ort", serve=True,
            hf_model=True, demo=True),
    Backend("tensorrt", "tensorrt", "TensorRT engines of `seq2trt build --backend tensorrt`", needs_gpu=True,
            extra="trt", modules=("tensorrt",), serve=True, hf_model=True, validates=True),
    Backend("tensorrt-rtx", "tensorrt", "TensorRT-RTX engines of `seq2trt build`", needs_gpu=True, extra="rtx",
            modules=("tensorrt_rtx",), serve=True, hf_model=True, validates=True),
    Backend("ort-generate", "ort-search", "generate.onnx: the whole beam search in one ONNX Runtime graph",
            graphs="generate", whole_search=True),
    Backend("ort-generate-int8", "ort-search", "generate.onnx over the int8 graphs", graphs="generate-int8",
            whole_search=True),
    Backend("ct2", "ctranslate2", "CTranslate2, the checkpoint converted", extra="ct2", modules=("ctranslate2",),
            ours=False, translate=False, demo=True),
    Backend("ct2-int8", "ctranslate2", "CTranslate2 with int8 weights", extra="ct2", modules=("ctranslate2",),
            ours=False, translate=False, demo=True),
    Backend("hf", "transformers", "transformers' generate on the imported source directory", extra="hf",
            modules=("transformers",), ours=False, translate=False, needs_import=True),
    Backend("optimum", "optimum", "Optimum's ONNX Runtime export of the imported source directory", extra="optimum",
            modules=("transformers", "optimum.onnxruntime"), peer="optimum-onnx", ours=False, translate=False,
            needs_import=True),
)

DECODE_BACKENDS = tuple(n for n, b in BACKENDS.items() if b.translate)
ENGINE_BACKENDS = tuple(n for n, b in BACKENDS.items() if b.runs == "tensorrt")
SERVE_BACKENDS = tuple(n for n, b in BACKENDS.items() if b.serve)
VALIDATE_BACKENDS = tuple(n for n, b in BACKENDS.items() if b.validates)
HF_MODEL_BACKENDS = tuple(n for n, b in BACKENDS.items() if b.hf_model)
BASELINES = tuple(n for n, b in BACKENDS.items() if not b.ours)  # prepared and checked before they are timed


def names(**where: bool) -> tuple[str, ...]:
    """Backend names whose declaration has every given field equal to the given value, in declaration order."""
    return tuple(n for n, b in BACKENDS.items() if all(getattr(b, k) == v for k, v in where.items()))


def declared(name: str, among: tuple[str, ...] | None = None, what: str = "backend") -> Backend:
    """The declaration of `name`; an unknown name (or one outside `among`) is an InputError listing the choices."""
    choices = among if among is not None else tuple(BACKENDS)
    if name not in choices:
        raise InputError(f"unknown {what} {name!r}; choose one of {', '.join(choices)}")
    return BACKENDS[name]


def _missing_module(module: str) -> bool:
    try:
        return importlib.util.find_spec(module.split(".")[0]) is None
    except (ImportError, ValueError):
        return True


_MODULE_NAMES = {"ctranslate2": "CTranslate2", "tensorrt": "TensorRT", "tensorrt_rtx": "TensorRT-RTX"}


def unavailable(backends: tuple[str, ...]) -> dict[str, str]:
    """Backend name -> why it cannot run on this machine (no GPU, or a library not installed)."""
    why = {}
    for name in backends:
        b = BACKENDS[name]
        if b.needs_gpu and b.runs == "tensorrt":
            from seq2trt.plugins import trt_compat

            if not trt_compat.has_gpu():
                why[name] = "TensorRT engines run only on an NVIDIA GPU and this machine has none"
                continue
        elif b.needs_gpu:
            import torch

            if not torch.cuda.is_available():
                why[name] = "the eager model on CUDA needs a GPU visible to PyTorch, and this machine has none"
                continue
        missing = [m for m in b.modules if _missing_module(m)]
        if missing:
            shown = " and ".join(_MODULE_NAMES.get(m, m) for m in missing)
            why[name] = f"{shown} {'is' if len(missing) == 1 else 'are'} not installed (pip install 'seq2trt[{b.extra}]')"
        elif b.peer is not None and (conflict := peer_conflict(b.peer)):
            why[name] = f"{conflict}, so it cannot run beside it (install 'seq2trt[{b.extra}]' in an environment of its own)"
    return why


def peer_conflict(dist: str) -> str | None:
    """The first requirement of the installed distribution `dist` that the installed packages break, said in one
    phrase; None when all hold (or `dist` is not installed)."""
    from importlib.metadata import PackageNotFoundError, requires, version

    try:
        from packaging.requirements import Requirement
        wanted = [Requirement(text) for text in requires(dist) or []]
    except (ImportError, PackageNotFoundError):
        return None
    for req in wanted:
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra's requirement
        try:
            have = version(req.name)
        except PackageNotFoundError:
            continue
        if not req.specifier.contains(have, prereleases=True):
            return f"{dist} {version(dist)} needs {req.name}{req.specifier} and {req.name} {have} is installed"
    return None


def graph_folder(out: Path, name: str, manifest: Manifest) -> Path:
    """The verified folder of an ONNX Runtime backend's graphs."""
    from seq2trt.exporters.fuse import Target, fused_dir, verify_fused
    from seq2trt.exporters.quantize import quantized_dir, verify_quantized

    graphs = BACKENDS[name].graphs
    if graphs == "plain":
        return Path(out)
    if graphs == "fused-ort":
        verify_fused(out, Target.ORT, manifest)
        return fused_dir(out, Target.ORT)
    if graphs == "int8-ort":
        verify_quantized(out, manifest)
        return quantized_dir(out)
    raise InputError(f"backend {name!r} reads no ONNX Runtime encoder/decoder graphs; choose one of "
                     f"{', '.join(n for n, b in BACKENDS.items() if b.runs == 'onnxruntime')}")


def engine_runners(out: Path, name: str, manifest: Manifest) -> tuple[tuple, dict]:
    """(TensorRT runners of the encoder and decoder engines of `name` under OUT/engines, their build.json), each plan
    checked against build.json and build.json against this export."""
    from seq2trt.exporters.tensorrt_engines import verify_engines
    from seq2trt.reference_model.layout import engine_dir
    from seq2trt.runtime.tensorrt_runner import runner_for

    engines = engine_dir(out, name)
    info = verify_engines(engines)
    return tuple(runner_for(engines, kind, manifest.config, manifest.limits) for kind in spec.GraphKind), info


@contextlib.contextmanager
def open_step_model(out: Path, backend: str, checkpoint: Path | None = None, threads: int = 1
                    ) -> Iterator[tuple[object, Manifest]]:
    """(StepModel, the export's manifest) for `backend` on the export in `out`; runners are closed on exit."""
    graphs, runs = declared(backend, DECODE_BACKENDS).graphs, declared(backend).runs
    out = Path(out)
    manifest = verify(out, [kind.filename for kind in spec.GraphKind])
    if runs == "eager":
        from seq2trt.reference_model.eager import EagerStepModel

        from seq2trt.runtime.reference_loader import load_reference

        model, _ = load_reference(manifest, checkpoint)
        yield EagerStepModel(model), manifest
        return
    if runs == "ort-search":  # the whole search in one session run: not a StepModel
        from seq2trt.runtime.ort_search import GenerateModel

        with GenerateModel(out, manifest, threads, int8=graphs == "generate-int8") as generate:
            yield generate, manifest
        return
    from seq2trt.runtime.step_model import RunnerStepModel

    kinds = list(spec.GraphKind)
    if runs == "tensorrt":
        runners, _ = engine_runners(out, backend, manifest)
    else:
        from seq2trt.runtime.runners import OrtRunner

        folder = graph_folder(out, backend, manifest)
        runners = [OrtRunner(folder / kind.filename, manifest.config, kind, manifest.dtype, manifest.limits,
                             intra_op_threads=threads, name=backend,
                             optimization="extended" if graphs == "int8-ort" else "basic") for kind in kinds]
    with contextlib.ExitStack() as stack:
        for runner in runners:
            stack.enter_context(runner)
        yield RunnerStepModel(*runners), manifest
