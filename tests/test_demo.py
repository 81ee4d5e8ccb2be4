"""The one-command first experience, end to end on the trained demo model (about 2 + 2 minutes on 2 cores)."""

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_model_reaches_its_accuracy_target(demo_checkpoint):
    metrics = json.loads((demo_checkpoint / "metrics.json").read_text())
    assert metrics["heldout_examples"] >= 1000
    assert metrics["heldout_exact_match"] >= 0.95


@pytest.mark.slow
def test_demo_runs_the_whole_pipeline(demo_checkpoint, tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "seq2trt.cli.main", "demo", "-o", str(out), "--samples", "100"],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = out / "reports"
    for graphs in ("plain", "fused-ort", "fused-trt"):
        doc = json.loads((reports / f"parity-ort-{graphs}.json").read_text())
        assert doc["passed"] and doc["end_to_end"]["greedy"]["token_agreement"] == 1.0, graphs
    from seq2trt.plugins import trt_compat

    if trt_compat.available("tensorrt-rtx"):  # CI installs the rtx extra: engines are built without a GPU
        build = json.loads(next((out / "engines").glob("tensorrt-rtx-*/build.json")).read_text())
        assert build["graphs"]["decoder"]["plugin_layers"] == 6
    latency = json.loads((reports / "latency.json").read_text())
    assert {"eager", "ort"} <= set(latency["results"]["1"])
    html = (reports / "report.html").read_text()
    assert "data:image/png;base64," in html and "Parity" in html
