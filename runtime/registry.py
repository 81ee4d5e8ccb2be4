"""Every backend seq2trt knows, declared once (`BACKENDS`), each pointing at the module of its kind
(`runtime/backends/<module>.py`: how it opens, what it checks before serving, whether it takes concurrent calls, how
the bench times it), and the one opener of a decoding backend on an export.

A declaration says what the name runs, which graph set of the export it reads (`backends/graph_sets.py`, the table
validate uses too), on which device, whether it needs a GPU, which extra installs it, whether it is a whole search,
and which commands offer it. `translate`, `transcribe`, `validate`, `bench`, `serve`, the demo, the Python API and
the Hugging Face model class read their choices from here. Every graph `open_step_model` loads is checked first: the
export against its manifest, fused and int8 graphs against fusion.json / quantization.json, engines against
build.json. A new backend is one module in `runtime/backends/` and one declaration here.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from seq2trt.exporters import spec
from seq2trt.exporters.manifest import Manifest, verify
from seq2trt.core.errors import InputError
from seq2trt.runtime.backends.graph_sets import GRAPH_SETS, graph_set  # noqa: F401  (GRAPH_SETS: the one table)


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
    module: str | None = None  # its kind's module in runtime/backends; None: a baseline only bench runs
    device: str = "cpu"  # where it runs: cpu, or cuda (device 0)
    single_thread: bool = False  # runs one thread whatever it is given (CTranslate2's int8 is slower on more)
    int8: bool = False  # int8 weights: judged by the int8 tolerances, never stops a bench by disagreeing

    def threads_for(self, threads: int) -> int:
        """The threads it really runs on when given `threads`."""
        return 1 if self.single_thread else threads
    # The distribution whose pinned requirements must hold beside what is installed (optimum-onnx 0.1 pins
    # transformers < 4.58: beside transformers 5 it is installed but cannot run).
    peer: str | None = None


def _declare(*backends: Backend) -> dict[str, Backend]:
    return {b.name: b for b in backends}


BACKENDS: dict[str, Backend] = _declare(
    Backend("eager", "eager", "the PyTorch model of the checkpoint, on the CPU", serve=True, demo=True,
            module="eager"),
    Backend("eager-cuda", "eager", "the PyTorch model on a CUDA device", needs_gpu=True, translate=False,
            module="eager", device="cuda"),
    Backend("ort", "onnxruntime", "the exported graphs on ONNX Runtime", graphs="plain", serve=True, hf_model=True,
            validates=True, demo=True, module="onnxruntime"),
    Backend("ort-fused", "onnxruntime", "the fused ONNX Runtime graphs (MultiHeadAttention)", graphs="fused-ort",
            serve=True, hf_model=True, demo=True, module="onnxruntime"),
    Backend("ort-int8", "onnxruntime", "the int8 graphs of `seq2trt quantize`", graphs="int8-ort", serve=True,
            hf_model=True, demo=True, module="onnxruntime", int8=True),
    Backend("tensorrt", "tensorrt", "TensorRT engines of `seq2trt build --backend tensorrt`", needs_gpu=True,
            extra="trt", modules=("tensorrt",), serve=True, hf_model=True, validates=True, module="tensorrt"),
    Backend("tensorrt-rtx", "tensorrt", "TensorRT-RTX engines of `seq2trt build`", needs_gpu=True, extra="rtx",
            modules=("tensorrt_rtx",), serve=True, hf_model=True, validates=True, module="tensorrt"),
    Backend("ort-generate", "ort-search", "generate.onnx: the whole beam search in one ONNX Runtime graph",
            graphs="generate", whole_search=True, module="ort_search"),
    Backend("ort-generate-int8", "ort-search", "generate.onnx over the int8 graphs", graphs="generate-int8",
            whole_search=True, module="ort_search", int8=True),
    Backend("ort-cuda", "onnxruntime", "the fused ONNX Runtime graphs on the CUDA provider, the KV cache on the GPU",
            graphs="fused-ort", needs_gpu=True, extra="gpu", serve=True, hf_model=True, validates=True,
            module="ort_cuda", device="cuda"),
    Backend("ort-generate-cuda", "ort-search", "generate.onnx on ONNX Runtime's CUDA provider", graphs="generate",
            needs_gpu=True, extra="gpu", whole_search=True, module="ort_search", device="cuda"),
    Backend("ct2", "ctranslate2", "CTranslate2, the checkpoint converted", extra="ct2", modules=("ctranslate2",),
            ours=False, translate=False, demo=True),
    Backend("ct2-int8", "ctranslate2", "CTranslate2 with int8 weights", extra="ct2", modules=("ctranslate2",),
            ours=False, translate=False, demo=True, single_thread=True, int8=True),
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


def kind(name: str):
    """The module of a backend's kind (runtime/backends/<module>.py); baselines have none."""
    b = BACKENDS[name]
    if b.module is None:
        raise InputError(f"{name} is a baseline `seq2trt bench` times, not a backend seq2trt runs; choose one of "
                         f"{', '.join(DECODE_BACKENDS)}")
    return importlib.import_module(f"seq2trt.runtime.backends.{b.module}")


def concurrent(name: str) -> bool:
    """Whether one opened model of `name` takes calls from several threads at once."""
    return kind(name).CONCURRENT


CONCURRENT_BACKENDS = tuple(n for n in DECODE_BACKENDS if concurrent(n))
BENCH_DEFAULT = ("eager", "ort", "ct2")  # what `seq2trt bench` times when --backends is not given


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
    """Backend name -> why it cannot run on this machine (no GPU or provider, or a library not installed)."""
    why = {}
    for name in backends:
        b = BACKENDS[name]
        reason = kind(name).unavailable(b) if b.module is not None else None
        if reason:
            why[name] = reason
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
    """The verified folder of an ONNX Runtime backend's encoder and decoder graphs."""
    b = BACKENDS[name]
    if b.runs != "onnxruntime":
        raise InputError(f"backend {name!r} reads no ONNX Runtime encoder/decoder graphs; choose one of "
                         f"{', '.join(n for n, d in BACKENDS.items() if d.runs == 'onnxruntime')}")
    return graph_set(b.graphs).verified_folder(Path(out), manifest)


def engine_runners(out: Path, name: str, manifest: Manifest) -> tuple[tuple, dict]:
    """(TensorRT runners of the encoder and decoder engines of `name` under OUT/engines, their build.json)."""
    from seq2trt.runtime.backends.tensorrt import engine_runners as runners

    return runners(out, name, manifest)


def check_export(out: Path, name: str, manifest: Manifest) -> None:
    """What serving `name` will load, checked before a server starts (its kind's `check`)."""
    kind(name).check(Path(out), BACKENDS[name], manifest)


def step_model_of(name: str, encoder, decoder):
    """The step model `name`'s kind makes of an encoder and a decoder runner (validate builds the runners itself)."""
    return kind(name).step_model(encoder, decoder)


def bench_model(name: str, ctx):
    """`name` opened as the bench times it (`backends.BenchModel`), on the bench's context."""
    return kind(name).bench(ctx, BACKENDS[name])


@contextlib.contextmanager
def open_step_model(out: Path, backend: str, checkpoint: Path | None = None, threads: int = 1
                    ) -> Iterator[tuple[object, Manifest]]:
    """(StepModel, or the whole search for a whole-search backend; the export's manifest) for `backend` on the
    export in `out`; runners are closed on exit."""
    b = declared(backend, DECODE_BACKENDS)
    out = Path(out)
    manifest = verify(out, [k.filename for k in spec.GraphKind])
    with kind(backend).open(out, b, manifest, checkpoint, threads) as model:
        yield model, manifest
