"""The one table of graph sets: each `--graphs` name (validate) and each backend's `graphs` (the registry) is a
folder of the export with its verification, the runner options its graphs need, whether it is int8 and whether it
is the whole search (generate.onnx) rather than an encoder and a decoder graph."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from seq2trt.exporters.fuse import Target, fused_dir, verify_fused
from seq2trt.exporters.manifest import Manifest
from seq2trt.exporters.ort_search import generate_dir, verify_generate
from seq2trt.exporters.quantize import quantized_dir, verify_quantized
from seq2trt.core.errors import InputError


@dataclass(frozen=True)
class GraphSet:
    """The folder of one graph set's files (from the export directory), how they are verified against the export,
    and any extra runner options they need for a dtype (e.g. `prepare` / `custom_op_libraries` for plugin graphs)."""

    folder: Callable[[Path], Path]
    verify: Callable[[Path, Manifest], object] | None = None  # None: the export's manifest covers them
    runner_options: Callable[[str], dict] | None = None
    fused_target: Target | None = None  # fused graphs are checked against fusion.json, not the manifest
    quantized: bool = False  # int8 graphs: checked against quantization.json, judged by the int8 tolerances
    whole_search: bool = False  # generate.onnx: the search itself, judged end to end only (generate_validate)

    def verified_folder(self, out: Path, manifest: Manifest) -> Path:
        """The folder, once its files are verified against the export."""
        if self.verify is not None:
            self.verify(Path(out), manifest)
        return self.folder(Path(out))

    def options(self, dtype: str) -> dict:
        return self.runner_options(dtype) if self.runner_options else {}


def _plugin_graph_options(dtype: str) -> dict:
    """Plugin nodes run the op's PyTorch reference inside ONNX Runtime (bf16: on the graph's fp32 twin)."""
    from seq2trt.plugins.plugin_cpu import for_cpu, register_reference_ops
    from seq2trt.runtime.runners import emulate_bf16

    prepare = (lambda m: for_cpu(emulate_bf16(m), "fp32")) if dtype == "bf16" else (lambda m: for_cpu(m, dtype))
    return {"prepare": prepare, "custom_op_libraries": (register_reference_ops(),)}


def _fused(target: Target, runner_options: Callable[[str], dict] | None = None) -> GraphSet:
    return GraphSet(lambda out: fused_dir(out, target), lambda out, m: verify_fused(out, target, m), runner_options,
                    target)


GRAPH_SETS: dict[str, GraphSet] = {
    "plain": GraphSet(Path),
    "fused-ort": _fused(Target.ORT),
    "fused-trt": _fused(Target.TRT, _plugin_graph_options),
    "int8-ort": GraphSet(quantized_dir, verify_quantized, lambda dtype: {"optimization": "extended"}, quantized=True),
    "generate": GraphSet(generate_dir, verify_generate, whole_search=True),
    "generate-int8": GraphSet(lambda out: generate_dir(out, int8=True),
                              lambda out, m: verify_generate(out, m, int8=True), quantized=True, whole_search=True),
}


def graph_set(name: str) -> GraphSet:
    if name not in GRAPH_SETS:
        raise InputError(f"unknown graph set {name!r}; choose one of {', '.join(GRAPH_SETS)}")
    return GRAPH_SETS[name]
