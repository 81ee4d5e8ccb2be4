"""`seq2trt export` and `seq2trt validate` end to end on a tiny checkpoint, through click."""

from __future__ import annotations

import json

import pytest
import torch

from seq2trt.reference_model.checkpoint import save_checkpoint

from helpers.cli import invoke, invoke_ok


@pytest.fixture(scope="module")
def exported(make_model, tmp_path_factory):
    """A tiny checkpoint exported through the CLI (the export itself is under test here, not only its result)."""
    root = tmp_path_factory.mktemp("cli")
    save_checkpoint(root / "ckpt", make_model(seed=4, dtype=torch.float32))
    invoke_ok("export", root / "ckpt", "-o", root / "out", "--max-batch", 8)
    return root


def test_export_writes_the_artifact_directory(exported):
    out = exported / "out"
    assert {p.name for p in out.iterdir()} == {"manifest.json", "encoder.onnx", "decoder.onnx"}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["dtype"] == "fp32" and manifest["settings"]["limits"]["max_batch"] == 8
    assert manifest["source"]["checkpoint"].endswith("ckpt") and len(manifest["files"]["decoder.onnx"]["sha256"]) == 64


def test_export_prints_a_progress_line_per_step(exported, tmp_path):
    """Lines on stderr (a log file keeps them, unlike a spinner), each with the stage and the time since it began."""
    import re

    output = invoke_ok("export", exported / "ckpt", "-o", tmp_path / "out", "--max-batch", 8)
    lines = [line for line in output.splitlines() if line.startswith("export [")]
    assert all(re.match(r"export \[\d+:\d\d\] \S", line) for line in lines), lines
    for kind in ("encoder", "decoder"):
        assert any(f"tracing the {kind} graph" in line for line in lines), lines
        assert any(f"checking the {kind} graph" in line for line in lines), lines


def test_export_refuses_an_existing_directory(exported):
    result = invoke("export", exported / "ckpt", "-o", exported / "out")
    assert result.exit_code == 2 and "--force" in result.output


def test_validate_passes_and_writes_reports(exported):
    out = exported / "out"
    result = invoke("validate", out, "--samples", "6", "--beam-size", "2")
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "reports" / "parity.json").read_text())
    assert doc["passed"] is True
    assert set(doc["graphs"]) == {"encoder", "decoder"} and "logits" in doc["graphs"]["decoder"]
    e2e = doc["end_to_end"]
    assert e2e["samples"] == 6 and e2e["token_agreement"] == 1.0 and e2e["max_logit_abs_err"] < 1e-4
    assert "# Parity of the plain graphs on ort, fp32: PASSED" in (out / "reports" / "parity.md").read_text()


def test_validate_refuses_a_tampered_graph(exported, tmp_path):
    import shutil

    copy = tmp_path / "out"
    shutil.copytree(exported / "out", copy)
    with open(copy / "encoder.onnx", "ab") as f:
        f.write(b"\0")
    result = invoke("validate", copy, "--samples", "0")
    assert result.exit_code == 2 and "sha256" in result.output


def test_validate_fails_with_exit_1_when_end_to_end_misses_its_target(exported, tmp_path, monkeypatch):
    import shutil

    from seq2trt.validation import end_to_end

    copy = tmp_path / "out"
    shutil.copytree(exported / "out", copy)
    strict = end_to_end.EndToEndTargets(token_agreement=1.0, sequence_match=1.0, max_logit_abs_err=0.0)
    monkeypatch.setitem(end_to_end.TARGETS, "fp32", strict)
    result = invoke("validate", copy, "--samples", "3", "--beam-size", "1")
    assert result.exit_code == 1 and "max_logit_abs_err" in result.output
    assert json.loads((copy / "reports" / "parity.json").read_text())["passed"] is False


def test_validate_lists_failing_outputs_of_a_wrong_graph(exported, tmp_path):
    import shutil

    import onnx

    from seq2trt.exporters.manifest import read_manifest, write_manifest
    from seq2trt.reference_model.config import Seq2SeqConfig

    copy = tmp_path / "out"
    shutil.copytree(exported / "out", copy)
    proto = onnx.load(copy / "decoder.onnx")
    node = next(n for n in proto.graph.node if n.op_type == "DecoderSelfAttention")
    next(a for a in node.attribute if a.name == "scale").f *= 2.0
    onnx.save(proto, copy / "decoder.onnx")
    data = read_manifest(copy).data
    write_manifest(copy, Seq2SeqConfig.from_dict(data["config"]), data["settings"], list(data["files"]), data["source"])
    result = invoke("validate", copy, "--samples", "0")
    assert result.exit_code == 1 and "decoder" in result.output and "logits: max_abs" in result.output
