"""`seq2trt fuse` and `seq2trt validate --graphs fused-*` as a user runs them."""

import json
import subprocess
import sys

import onnx
import onnx.inliner
import pytest
import torch

from seq2trt.exporters import spec
from seq2trt.exporters.manifest import read_manifest, write_manifest
from seq2trt.plugins.op import AttentionKind

from helpers.artifacts import checkpoint_and_export, numbers_model


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "seq2trt.cli.main", *args], capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def exported(make_model, tmp_path_factory):
    """A numbers checkpoint (its task recorded) and its export, which these tests fuse: the module's own."""
    model, task = numbers_model(make_model, seed=8)
    return checkpoint_and_export(tmp_path_factory.mktemp("cli"), model, task, max_batch=4, record_task=True)[1]


@pytest.mark.parametrize("target", ["trt", "ort"])
def test_fuse_then_validate_fused_graphs(exported, target):
    proc = run("fuse", str(exported), "--target", target)
    assert proc.returncode == 0, proc.stderr
    assert "ENCODER_SELF 2/2" in proc.stdout and "DECODER_SELF 2/2, CROSS 2/2" in proc.stdout
    proc = run("validate", str(exported), "--graphs", f"fused-{target}", "--samples", "16", "--beam-size", "2")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((exported / "reports" / f"parity-ort-fused-{target}.json").read_text())
    assert doc["passed"] and doc["end_to_end"]["greedy"]["token_agreement"] == 1.0
    again = run("fuse", str(exported), "--target", target)
    assert again.returncode == 2 and "--force" in again.stderr and "Traceback" not in again.stderr


def test_validate_fused_before_fuse_says_what_to_run(exported, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(exported, copy, ignore=shutil.ignore_patterns("fused", "reports"))
    proc = run("validate", str(copy), "--graphs", "fused-trt", "--samples", "0")
    assert proc.returncode == 2 and "seq2trt fuse" in proc.stderr and "Traceback" not in proc.stderr


def test_partial_fusion_exits_1_and_names_blocks(make_model, tmp_path):
    from seq2trt.exporters.onnx_export import export

    out = export(make_model(seed=9, dtype=torch.float32), tmp_path / "out")
    model = onnx.inliner.inline_selected_functions(
        onnx.load(out / "encoder.onnx"), [(spec.MARKED_DOMAIN, spec.MARKED_OP_TYPES[AttentionKind.ENCODER_SELF])])
    onnx.save(model, out / "encoder.onnx")
    m = read_manifest(out)
    write_manifest(out, m.config, m.data["settings"], list(m.data["files"]))
    proc = run("fuse", str(out), "--target", "trt")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "encoder:encoder_layers.0.self_attn, encoder:encoder_layers.1.self_attn" in proc.stderr
    assert not (out / "fused" / "trt").exists()
    proc = run("fuse", str(out), "--target", "trt", "--allow-partial")
    assert proc.returncode == 0 and "partial fusion" in proc.stderr
