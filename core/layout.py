"""Where every artifact lives: the files of a checkpoint directory and of an export directory (OUT).

Every stage finds its inputs and outputs here, so a folder or file name is spelled once (docs/design.md, "Artifact
layout"). Functions take the directory and return paths; nothing here reads or writes.
"""

from __future__ import annotations

from pathlib import Path

from seq2trt.core.errors import ArtifactError

# -- a checkpoint directory (`seq2trt train`, `seq2trt import hf`) ---------------------------------------------------
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
LEGACY_WEIGHTS = "model.pt"
VOCAB = "vocab.json"  # the vocabularies of a model trained here
METRICS = "metrics.json"  # training's held-out figures
TOKENIZER_DIR = "tokenizer"  # an imported model's tokenizer files
GENERATION = "generation.json"  # an imported model's generation settings
IMPORT_RECORD = "import.json"  # what an import came from and how it was checked

# -- an export directory (OUT) ---------------------------------------------------------------------------------------
FEATURES = "features.onnx"  # a speech model's log-mel front end (exporters/whisper_features.py)
MANIFEST = "manifest.json"  # the plain graphs, their hashes, the config and limits (`seq2trt export`)
FUSION_JSON = "fusion.json"  # beside fused graphs (`seq2trt fuse`)
QUANTIZATION_JSON = "quantization.json"  # beside int8 graphs (`seq2trt quantize`)
GENERATE_JSON = "generate.json"  # beside generate.onnx (`seq2trt ort-search`)
BUILD_JSON = "build.json"  # beside TensorRT engines (`seq2trt build`)
ENGINES = "engines"
REPORTS = "reports"
OPTIMUM = "optimum"  # Optimum's export of an imported model's source directory (bench)
CT2 = "ct2"  # CTranslate2 conversions (bench)
QUANTIZED_NAME = "ort-int8"


def fused_dir(out: Path, target: str) -> Path:
    """OUT/fused/<target>: the fused graphs for one target ("ort" or "trt")."""
    return Path(out) / "fused" / target


def quantized_dir(out: Path) -> Path:
    return Path(out) / "quantized" / QUANTIZED_NAME


def generate_dir(out: Path, int8: bool = False) -> Path:
    """OUT/generate/ort (from the fused ORT graphs) or OUT/generate/ort-int8 (from the int8 graphs)."""
    return Path(out) / "generate" / ("ort-int8" if int8 else "ort")


def engines_root(out: Path) -> Path:
    return Path(out) / ENGINES


def engine_dir_name(flavour: str, target_tag: str, dtype: str, plugin: bool = True) -> str:
    return f"{flavour}-{target_tag}-{dtype}" + ("" if plugin else "-noplugin")


def engine_dir(out: Path, flavour: str) -> Path:
    """The one engine directory of `flavour` ("tensorrt" or "tensorrt-rtx") under OUT/engines (newest when several)."""
    candidates = sorted(engines_root(out).glob(f"{flavour}-*/{BUILD_JSON}"), key=lambda p: p.stat().st_mtime)
    candidates = [p for p in candidates if flavour != "tensorrt" or not p.parent.name.startswith("tensorrt-rtx")]
    if not candidates:
        raise ArtifactError(f"{out}/{ENGINES} holds no {flavour} engines; build them with "
                            f"`seq2trt build {out} --backend {flavour}`")
    return candidates[-1].parent


def reports_dir(out: Path) -> Path:
    return Path(out) / REPORTS


def ct2_dir(out: Path, quantization: str) -> Path:
    return Path(out) / CT2 / quantization


def optimum_dir(out: Path) -> Path:
    return Path(out) / OPTIMUM
