"""seq2trt as a library: one function per stage (`seq2trt.export`, `fuse`, `quantize`, `ort_search`, `build`,
`validate`, `import_hf`, `bench`, `serve`, each returning a typed result; `serve` the running server),
`seq2trt.Translator` decodes with a checkpoint or an export through any backend, `seq2trt.Transcriber` transcribes
speech with a Whisper one (typed `Transcription`s; also `Translator.transcribe`), and
`seq2trt.hf.Seq2TrtModelForSeq2SeqLM` lets transformers' `generate()` and `pipeline()` drive an export's graphs.

The stages' subpackages (`seq2trt.reference_model`, `seq2trt.exporters`, `seq2trt.validation`, ...) install
beside this one. Names load on first use, so `import seq2trt` costs nothing until one is touched.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_STAGES = ["train", "import_hf", "export", "fuse", "quantize", "ort_search", "build", "validate", "bench", "report",
           "serve", "TrainResult", "ImportResult", "ExportResult", "FuseResult", "QuantizeResult", "OrtSearchResult",
           "BuildResult", "ValidationResult", "BenchResult", "ReportResult",
           "generate", "GenerateResult"]  # the old names of ort_search and its result (deprecated)

__all__ = ["Translator", "Transcriber", "Hypothesis", "Transcription", "TranscribedSegment", "DECODE_BACKENDS", *_STAGES, "Seq2TrtError", "InputError", "ConfigError",
           "CheckpointError", "ArtifactError", "DependencyError", "CheckFailed"]

# public name -> the module that defines it
_HOMES = {"Translator": "seq2trt.translator", "Transcriber": "seq2trt.transcriber", "Hypothesis": "seq2trt.translator",
          "Transcription": "seq2trt.runtime.transcription", "TranscribedSegment": "seq2trt.runtime.transcription",
          "DECODE_BACKENDS": "seq2trt.runtime.registry", **{name: "seq2trt.stages" for name in _STAGES},
          **{name: "seq2trt.core.errors" for name in __all__ if name.endswith(("Error", "Failed"))}}

if TYPE_CHECKING:
    from seq2trt.core.errors import (ArtifactError, CheckFailed, CheckpointError, ConfigError, DependencyError,
                                     InputError, Seq2TrtError)
    from seq2trt.runtime.registry import DECODE_BACKENDS

    from seq2trt.stages import (BenchResult, BuildResult, ExportResult, FuseResult, GenerateResult, ImportResult,
                                OrtSearchResult, QuantizeResult, ReportResult, TrainResult, ValidationResult, bench,
                                build, export, fuse, generate, import_hf, ort_search, quantize, report, serve, train,
                                validate)
    from seq2trt.runtime.transcription import TranscribedSegment, Transcription
    from seq2trt.transcriber import Transcriber
    from seq2trt.translator import Hypothesis, Translator


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'seq2trt' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
