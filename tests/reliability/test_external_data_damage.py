"""A damaged data file (exporters/graph_files.py: a graph's weights in `<graph>.onnx.data`) of every artifact kind -
missing, truncated, or another model's of the same shape (same size, other weights) - is one error line naming
the file and the command that rewrites it, exit 2, and nothing in the export changes; never a result from wrong
weights."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from seq2trt.exporters import graph_files

from helpers.artifacts import checkpoint_and_export, numbers_model
from helpers.cli import invoke_ok

HAS_RTX = importlib.util.find_spec("tensorrt_rtx") is not None

# artifact kind: (its folder in the export, the graph damaged, the reading command, the fix named)
KINDS = {
    "export": (".", "decoder.onnx", ["validate", "{out}", "--graphs", "plain", "--samples", "2"],
               "seq2trt export --force"),
    "fused-ort": ("fused/ort", "encoder.onnx", ["validate", "{out}", "--graphs", "fused-ort", "--samples", "2"],
                  "seq2trt fuse {out} --target ort --force"),
    "fused-trt": ("fused/trt", "decoder.onnx", ["validate", "{out}", "--graphs", "fused-trt", "--samples", "2"],
                  "seq2trt fuse {out} --target trt --force"),
    "int8": ("quantized/ort-int8", "decoder.onnx", ["validate", "{out}", "--graphs", "int8-ort", "--samples", "2"],
             "seq2trt quantize {out} --force"),
    "generate": ("generate/ort", "generate.onnx", ["translate", "{out}", "--backend", "ort-generate", "12"],
                 "seq2trt ort-search {out} --force"),
}
if HAS_RTX:  # the TensorRT-RTX parser reads the fused graph's data file itself: checked before it parses
    KINDS["fused-trt build"] = ("fused/trt", "encoder.onnx", ["build", "{out}", "--backend", "tensorrt-rtx",
                                                              "--target", "sm_86"],
                                "seq2trt fuse {out} --target trt --force")


def _every_artifact(root: Path, model, task) -> Path:
    _, out = checkpoint_and_export(root, model, task, max_batch=4, fuse=("ort", "trt"), record_task=True)
    invoke_ok("quantize", out)
    invoke_ok("ort-search", out)
    return out


@pytest.fixture(scope="module")
def exports(make_model, tmp_path_factory):
    """Two models of one shape (seeds 3 and 4), every artifact kind of each written with external data (threshold
    0): the second's data files are the "another model's" damage of the first's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(graph_files.THRESHOLD_ENV, "0")
        made = []
        for seed in (3, 4):
            # num_heads 1: head_dim 32, one the plugin's kernels take, so `build` accepts the fused graphs
            model, task = numbers_model(make_model, seed=seed, max_src_len=16, max_tgt_len=16, num_heads=1)
            made.append(_every_artifact(tmp_path_factory.mktemp(f"seed{seed}"), model, task))
    return made


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["missing", "truncated", "another model's"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_damaged_data_file_is_one_line_and_nothing_changes(exports, tmp_path, kind, damage, snapshot, invoke,
                                                             one_error_line):
    out = tmp_path / "out"
    shutil.copytree(exports[0], out)
    folder, graph, command, fix = KINDS[kind]
    data = out / folder / graph_files.data_name(graph)
    assert data.is_file()
    if damage == "missing":
        data.unlink()
    elif damage == "truncated":
        with open(data, "r+b") as f:
            f.truncate(data.stat().st_size // 2)
    else:
        other = exports[1] / folder / data.name
        assert other.stat().st_size == data.stat().st_size and other.read_bytes() != data.read_bytes()
        shutil.copyfile(other, data)
    before = snapshot(out)
    result = invoke(*[part.format(out=out) for part in command])
    one_error_line(result, 2, data.name, fix.format(out=out))
    assert snapshot(out) == before
