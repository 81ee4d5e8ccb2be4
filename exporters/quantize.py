"""Opt-in int8 for ONNX Runtime on CPU: dynamic quantization of the fused ORT graphs.

`seq2trt quantize OUT` reads `OUT/fused/ort/` (checked against its fusion.json) and writes
`OUT/quantized/ort-int8/`. ONNX Runtime's own quantizer (`onnxruntime.quantization.quantize_dynamic`) gives
every MatMul with a constant weight int8 weights (one scale per tensor, or per output channel) and quantizes its
activations to uint8 at run time; ONNX Runtime's extended optimization level then fuses each such MatMul and its
bias into one `DynamicQuantizeMatMul` (`OrtRunner(optimization="extended")`). Attention, LayerNorm and the
embedding stay float32, and the graph contract (names, dtypes, axes) is unchanged, so the runners, the decoding
loops, `validate` and `bench` run the int8 graphs as they run the others.

`quantization.json` records the method, what was and was not quantized per graph, the sizes, and the sha256 of
the fused graphs each file came from; `verify_quantized` checks all of it before the graphs are used.
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import onnx

from seq2trt.core.errors import ArtifactError, DependencyError, InputError
from seq2trt.core.atomic_files import atomic_write_text
from seq2trt.core.swap import staged_directory

from seq2trt.exporters import graph_files, spec
from seq2trt.core import layout
from seq2trt.core.layout import QUANTIZATION_JSON
from seq2trt.exporters.artifact_checks import check_derived_graphs, load_graph
from seq2trt.exporters.fuse import FUSION_JSON, Target, fused_dir, verify_fused
from seq2trt.exporters.manifest import Manifest, read_manifest

logger = logging.getLogger(__name__)

NAME = layout.QUANTIZED_NAME


@dataclass(frozen=True)
class QuantizeSettings:
    per_channel: bool = False  # one scale per output channel instead of per weight tensor
    # 7-bit weights, for x86 CPUs without AVX512-VNNI/AVX-VNNI: their uint8 x int8 instruction sums pairs of products
    # in int16, which saturates for 8-bit weights, so the graph would not compute what quantization defines.
    # None: decided from this CPU (`saturating_int8_dot`).
    reduce_range: bool | None = None

    def resolved(self) -> "QuantizeSettings":
        return self if self.reduce_range is not None else replace(self, reduce_range=saturating_int8_dot())


def _cpu_flags() -> set[str]:
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return set()


def saturating_int8_dot() -> bool:
    """Whether ONNX Runtime's uint8 x int8 products saturate on this CPU: x86 without VNNI (vpmaddubsw adds two
    products in int16; 255 x 127 x 2 > 32767). Other architectures and VNNI CPUs accumulate in int32."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "i386"):
        return False
    flags = _cpu_flags()
    return bool(flags) and not flags & {"avx512_vnni", "avx_vnni", "amx_int8"}


def quantized_dir(out: Path) -> Path:
    return layout.quantized_dir(out)


def _constant_matmuls(model: onnx.ModelProto) -> tuple[int, int]:
    """(MatMuls whose second input is an initializer, all MatMuls)."""
    weights = {i.name for i in model.graph.initializer}
    matmuls = [n for n in model.graph.node if n.op_type == "MatMul"]
    return sum(n.input[1] in weights for n in matmuls), len(matmuls)


class _PreprocessAdvice(logging.Filter):
    """The quantizer advises shape-inference pre-processing on the root logger; it serves static quantization
    of convolutional models, not dynamic MatMul quantization of graphs whose shapes are already inferred."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "pre-processing before quantization" not in record.getMessage()


@contextlib.contextmanager
def _quiet_quantizer():
    advice = _PreprocessAdvice()
    root = logging.getLogger()
    root.addFilter(advice)
    try:
        yield
    finally:
        root.removeFilter(advice)


def quantize_graph(source: Path, target: Path, settings: QuantizeSettings,
                   load: Callable[[Path], onnx.ModelProto]) -> dict:
    """Quantize one graph file into `target`; returns its audit entry. `load` parses and checks a graph (the
    source before, the int8 graph after: the contract must still hold)."""
    try:
        from onnxruntime.quantization import QuantType, quantize_dynamic
    except ImportError:
        raise DependencyError("onnxruntime's quantization tools are missing; pip install onnxruntime") from None
    before = load(source)
    constant, total = _constant_matmuls(before)
    # a big source's int8 graph keeps external data too (the quantizer names it `<graph>.data`, graph_files' rule)
    external = graph_files.tensor_bytes(before) > graph_files.threshold()
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch, _quiet_quantizer():
        quantize_dynamic(source, Path(scratch) / target.name, weight_type=QuantType.QInt8,
                         per_channel=settings.per_channel, reduce_range=settings.reduce_range,
                         op_types_to_quantize=["MatMul"], extra_options={"MatMulConstBOnly": True},
                         use_external_data_format=external)
        for path in graph_files.graph_files(Path(scratch) / target.name)[::-1]:  # the data file first
            path.replace(target.parent / path.name)
    after = load(target)
    ops = Counter(n.op_type for n in after.graph.node)
    return {"matmuls": total, "constant_weight_matmuls": constant, "quantized": ops.get("MatMulInteger", 0),
            "float_matmuls_left": ops.get("MatMul", 0), "bytes_before": sum(p.stat().st_size for p in graph_files.graph_files(source)),
            "bytes_after": sum(p.stat().st_size for p in graph_files.graph_files(target)), "nodes_before": len(before.graph.node),
            "nodes_after": len(after.graph.node)}


def _check_memory(source_dir: Path) -> None:
    """Refuse before any work a graph the quantizer could not hold (memory.quantize_peak of the largest graph and
    the largest tensor)."""
    from seq2trt.reference_model import config, memory

    largest = max(memory.files_bytes(graph_files.graph_files(source_dir / kind.filename)) for kind in spec.GraphKind)
    fix = "re-fuse the graphs (`seq2trt fuse OUT --target ort --force`)"
    tensor = max(graph_files.tensor_bytes(graph_files.load_structure(source_dir / kind.filename, fix), largest=True)
                 for kind in spec.GraphKind)
    memory.check_fits("int8 quantization", memory.quantize_peak(largest, tensor), config.physical_memory(),
                      f"{source_dir} (its largest graph: {largest / memory.GiB:,.1f} GiB)",
                      "quantize on a machine with more memory, or run the fused graphs as they are "
                      "(`--backend ort-fused`)", InputError)


def quantize_artifacts(out: Path, settings: QuantizeSettings = QuantizeSettings(), force: bool = False,
                       progress: Callable[[str], None] = logger.info) -> dict:
    """Quantize `out/fused/ort/` into `out/quantized/ort-int8/` with quantization.json; returns that document."""
    import onnxruntime

    out = Path(out)
    if not (fused_dir(out, Target.ORT) / FUSION_JSON).exists():
        raise InputError(f"{out} has no fused ORT graphs; run `seq2trt fuse {out} --target ort` first (int8 "
                         "quantizes the graphs ONNX Runtime runs fastest)")
    fusion = verify_fused(out, Target.ORT)
    if not fusion.get("complete"):
        raise InputError(f"{fused_dir(out, Target.ORT)} is a partial fusion; re-run `seq2trt fuse {out} --target ort "
                         "--force` without --allow-partial before quantizing")
    manifest = read_manifest(out)  # verify_fused has checked it and the export's hashes
    if manifest.dtype != "fp32":
        raise InputError(f"{out} is a {manifest.dtype} export; int8 dynamic quantization starts from float32 "
                         f"graphs: export with `--dtype fp32` into another folder")
    source_dir = fused_dir(out, Target.ORT)
    _check_memory(source_dir)
    settings = settings.resolved()
    doc = {"method": "onnxruntime dynamic quantization (int8 weights, uint8 activations quantized at run time)",
           "onnxruntime": onnxruntime.__version__, **asdict(settings), "graphs": {}, "files": {}}
    with staged_directory(quantized_dir(out), force, "int8 graphs", kind=QUANTIZATION_JSON) as tmp:
        for kind in spec.GraphKind:
            source = source_dir / kind.filename
            progress(f"quantizing the {kind.value} graph")
            entry = quantize_graph(source, tmp / kind.filename, settings,
                                   lambda path: load_graph(path, manifest.config, kind, manifest.dtype))
            if entry["quantized"] != entry["constant_weight_matmuls"]:
                raise ArtifactError(f"quantizing {source}: {entry['quantized']} of {entry['constant_weight_matmuls']} "
                                    "weight MatMuls became int8; re-fuse the graphs (`seq2trt fuse --force`)")
            doc["graphs"][kind.value] = entry
            doc["files"].update(graph_files.file_records(
                tmp / kind.filename, source_sha256=graph_files.graph_sha256(fusion["files"], kind.filename)))
        atomic_write_text(tmp / QUANTIZATION_JSON, json.dumps(doc, indent=2) + "\n")
    return doc


def verify_quantized(out: Path, manifest: Manifest | None = None) -> dict:
    """Check the int8 graphs against quantization.json, and that they come from the current fused graphs (and
    those from the current export; `manifest` as in `verify_fused`)."""
    out = Path(out)
    if not (quantized_dir(out) / QUANTIZATION_JSON).exists():
        raise ArtifactError(f"{quantized_dir(out) / QUANTIZATION_JSON} not found; run `seq2trt quantize {out}` first")
    fusion = verify_fused(out, Target.ORT, manifest)
    sources = {kind.filename: graph_files.graph_sha256(fusion["files"], kind.filename) for kind in spec.GraphKind}
    return check_derived_graphs(quantized_dir(out), QUANTIZATION_JSON, sources, "quantization",
                                "quantized from older fused graphs", f"seq2trt quantize {out}")
