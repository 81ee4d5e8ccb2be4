"""The one up-front memory check of every stage that holds a model's weights: the stage's peak, estimated from the
bytes of the weights and the copies the stage makes of them (the arithmetic is beside each estimate), against the
machine's memory, refused in one line naming the figures and the way out before any work is done."""

from __future__ import annotations

from pathlib import Path

from seq2trt.core.errors import ConfigError, Seq2TrtError

GiB = 2**30


def import_peak(weights: int) -> int:
    """The import holds one model at a time in its proof (transformers' side runs first and is freed), but building
    ours holds the source's tensors read and our model they are copied into (the proof's activations are bounded by
    proof.proof_scope and small beside them)."""
    return 2 * weights


def export_peak(weights: int, dtype_bytes: int) -> int:
    """Export holds the fp32 model, its copy in the export dtype (none in fp32: the copy shares the weights,
    onnx_export.export_copy) and one traced graph's weights while they are written (at most the copy's)."""
    narrow = weights * dtype_bytes // 4
    return weights + (0 if dtype_bytes == 4 else narrow) + narrow


def quantize_peak(graph_bytes: int, largest_tensor: int = 0) -> int:
    """ONNX Runtime's dynamic quantizer holds, for one graph, the graph it loaded, a deep copy that it saves and
    loads again for shape inference (ONNXQuantizer.__init__), that reloaded copy, and the int8 weights (a quarter).
    onnx.load reads each external tensor into a buffer before copying it into the graph: one more copy of the
    largest tensor while the reload holds the rest (a Marian's embedding is most of its graph)."""
    return graph_bytes * 13 // 4 + largest_tensor


def check_fits(stage: str, need: int, total: int, subject: str, way_out: str,
               error: type[Seq2TrtError] = ConfigError) -> None:
    """Raise `error` when `stage`'s estimated peak `need` passes the machine's memory `total` (config.physical_memory:
    the machine's, not what is free now, so a check gives the same answer on every run)."""
    if need > total:
        raise error(f"{stage} of {subject} needs about {need / GiB:,.1f} GiB of memory at its peak, more than this "
                    f"machine's {total / GiB:,.1f} GiB; {way_out}")


def files_bytes(paths: list[Path]) -> int:
    """Bytes of the files that exist among `paths` (a graph and its data file)."""
    return sum(p.stat().st_size for p in paths if p.is_file())
