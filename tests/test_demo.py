"""The one-command first experience, end to end on the trained demo model (about 2 + 2 minutes on 2 cores)."""

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_model_learned_its_task(demo_checkpoint):
    """Judged against references the case defines, not a score measured on one machine's model (another CPU trains
    another model from the same seed, and the seeds differ: 0.74 to 0.99 held-out exact match measured): the
    recorded figure is this checkpoint's own, its loss is below predicting uniformly, and it beats the same model
    untrained."""
    import math

    import torch

    from seq2trt.reference_model.checkpoint import load_checkpoint
    from seq2trt.reference_model.model import Seq2SeqTransformer
    from seq2trt.reference_model.tasks import get_task
    from seq2trt.reference_model.train import heldout_exact_match

    metrics = json.loads((demo_checkpoint / "metrics.json").read_text())
    model, _ = load_checkpoint(demo_checkpoint)
    task = get_task(metrics["task"])
    assert metrics["heldout_examples"] >= 1000
    n = metrics["heldout_examples"]
    # float32 sums may round differently with another thread count: a near-tie may flip, one example each
    assert abs(heldout_exact_match(model.eval(), task, n) - metrics["heldout_exact_match"]) <= 2 / n
    assert metrics["final_loss"] < math.log(model.cfg.tgt_vocab_size)
    torch.manual_seed(metrics["settings"]["seed"])
    untrained = Seq2SeqTransformer(model.cfg).eval()
    assert metrics["heldout_exact_match"] > heldout_exact_match(untrained, task, 200)


@pytest.mark.slow
def test_demo_runs_the_whole_pipeline(demo_checkpoint, tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "seq2trt.cli.main", "demo", "-o", str(out), "--samples", "40"],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = out / "reports"
    for graphs in ("plain", "fused-ort", "fused-trt", "int8-ort"):
        doc = json.loads((reports / f"parity-ort-{graphs}.json").read_text())
        greedy = doc["end_to_end"]["greedy"]
        judged = greedy["judged_token_agreement"]
        assert doc["passed"] and doc["graph_failures"] == [], graphs
        if graphs != "int8-ort":  # float32: every divergence must be a near-tie within the measured logit error
            assert (greedy["token_agreement"] if judged is None else judged) == 1.0, graphs
    from seq2trt.exporters.tensorrt import trt_compat

    if trt_compat.available("tensorrt-rtx"):  # CI installs the rtx extra: engines are built without a GPU
        build = json.loads(next((out / "engines").glob("tensorrt-rtx-*/build.json")).read_text())
        cfg = json.loads((demo_checkpoint / "config.json").read_text())
        assert build["graphs"]["decoder"]["plugin_layers"] == 2 * cfg["num_decoder_layers"]
    latency = json.loads((reports / "latency.json").read_text())
    assert {"eager", "ort"} <= set(latency["results"]["1"])
    html = (reports / "report.html").read_text()
    assert "data:image/png;base64," in html and "Parity" in html


def _perturbed(checkpoint, seed: int, relative: float):
    """The demo model with every weight moved by Gaussian noise of `relative` times that tensor's own spread: a
    model as another machine's training run could have made (its held-out score moves, its near-ties move)."""
    import torch

    from seq2trt.reference_model.checkpoint import load_checkpoint

    model, vocabs = load_checkpoint(checkpoint)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=generator) * relative * p.std())
    return model, vocabs


@pytest.mark.slow
@pytest.mark.parametrize("seed, relative", [(1, 0.02), (2, 0.05)])
def test_demo_validations_pass_for_other_demo_models(demo_checkpoint, tmp_path, seed, relative):
    """The demo's validation steps with bounds of their own (fused ORT, plugin graphs on CPU, int8; the plain graphs'
    fp32 bounds are the fused ones') pass for demo models other than this machine's: no bound of validate may
    depend on the one model measured."""
    from seq2trt.exporters.fuse import Target, fuse_artifacts
    from seq2trt.exporters.onnx_export import export
    from seq2trt.exporters.quantize import quantize_artifacts
    from seq2trt.reference_model.checkpoint import save_checkpoint, source_record
    from seq2trt.validation.validate import ValidateSettings, run_validation

    model, vocabs = _perturbed(demo_checkpoint, seed, relative)
    checkpoint = save_checkpoint(tmp_path / "ckpt", model, vocabs,
                                 extra_files={"metrics.json": (demo_checkpoint / "metrics.json").read_text()})
    out = export(model, tmp_path / "out", source=source_record(checkpoint))
    for target in Target:
        fuse_artifacts(out, target)
    quantize_artifacts(out)
    for graphs in ("fused-ort", "fused-trt", "int8-ort"):
        doc = run_validation(out, ValidateSettings(graphs=graphs, samples=40, localize_budget_s=0))
        assert doc["passed"] and doc["graph_failures"] == [], graphs
