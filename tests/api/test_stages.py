"""The stage functions of `import seq2trt` on a tiny random checkpoint: export -> fuse(ort) -> validate, their
typed results checked against the files on disk, their errors, and the same manifest as the CLI's export."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import onnx
import pytest
import torch

import seq2trt
from seq2trt.core.atomic_files import sha256_file
from seq2trt.reference_model.checkpoint import save_checkpoint

from helpers.cli import invoke_ok


@pytest.fixture(scope="module")
def staged(make_model, tmp_path_factory):
    """root/ckpt exported by the API to root/out (max batch 4) and fused for ORT, with the progress messages."""
    root = tmp_path_factory.mktemp("stages")
    save_checkpoint(root / "ckpt", make_model(seed=4, dtype=torch.float32))
    messages: dict[str, list[str]] = {"export": [], "fuse": []}
    exported = seq2trt.export(root / "ckpt", root / "out", max_batch=4, progress=messages["export"].append)
    fused = seq2trt.fuse(root / "out", "ort", progress=messages["fuse"].append)
    return root, exported, fused, messages


def test_export_result_describes_the_files_written(staged):
    root, result, _, messages = staged
    assert isinstance(result, seq2trt.ExportResult) and result.out == root / "out"
    on_disk = json.loads(result.manifest_path.read_text())
    assert result.manifest == on_disk and result.dtype == "fp32" == on_disk["dtype"]
    assert result.limits == on_disk["settings"]["limits"] and result.limits["max_batch"] == 4
    assert set(result.graphs) == {"encoder", "decoder"}
    for path in result.graphs.values():
        assert isinstance(path, Path) and path.parent == result.out
        assert sha256_file(path) == on_disk["files"][path.name]["sha256"]
    assert json.loads(json.dumps(result.to_dict()))["out"] == str(root / "out")
    assert messages["export"] and all(isinstance(m, str) for m in messages["export"])


def test_each_stage_reports_each_graph_as_it_goes(staged, tmp_path):
    """A big model's stage takes minutes per graph: export, fuse and quantize each say, graph by graph, what they
    are doing (each graph traced, written and checked; fused and written; quantized), in order."""
    root, _, _, messages = staged
    for kind in ("encoder", "decoder"):
        steps = [next(i for i, m in enumerate(messages["export"]) if m.startswith(f"{what} the {kind} graph"))
                 for what in ("tracing", "writing", "checking", "exported")]
        assert steps == sorted(steps), messages["export"]
        fused = [i for i, m in enumerate(messages["fuse"]) if f"the {kind} graph" in m or f"fused {kind} graph" in m]
        assert len(fused) == 2 and "attention blocks fused" in messages["fuse"][fused[1]], messages["fuse"]
    assert messages["export"].index("tracing the encoder graph") < messages["export"].index("tracing the decoder graph")
    quantized: list[str] = []
    seq2trt.quantize(root / "out", force=True, progress=quantized.append)
    assert [m for m in quantized if m.endswith(" graph")] == ["quantizing the encoder graph",
                                                                "quantizing the decoder graph"]


def test_a_stage_the_machine_cannot_hold_is_refused_before_any_work(staged, tmp_path, monkeypatch):
    """Export and quantize estimate their peak from the weights' bytes (reference_model/memory.py) and refuse, in
    one line naming the figures and the way out, when it passes the machine's memory: nothing is written."""
    from seq2trt.reference_model import config, memory

    root, _, _, _ = staged
    weights = sum(config.memory_parts(config.Seq2SeqConfig.load(root / "ckpt" / "config.json")).values())
    monkeypatch.setattr(config, "physical_memory", lambda: memory.export_peak(weights, 4) - 1)
    with pytest.raises(seq2trt.ConfigError, match=r"a fp32 export of .* needs about .* GiB .*more than this machine"):
        seq2trt.export(root / "ckpt", tmp_path / "new")
    assert not (tmp_path / "new").exists()
    monkeypatch.setattr(config, "physical_memory", lambda: memory.export_peak(weights, 4))  # exactly enough
    seq2trt.export(root / "ckpt", tmp_path / "new", max_batch=4)

    graphs = root / "out" / "fused" / "ort"
    largest = max((graphs / name).stat().st_size for name in ("encoder.onnx", "decoder.onnx"))
    tensor = max(max(len(t.raw_data) for t in onnx.load(str(graphs / name)).graph.initializer)
                 for name in ("encoder.onnx", "decoder.onnx"))  # onnx.load reads external tensors into raw_data
    monkeypatch.setattr(config, "physical_memory", lambda: memory.quantize_peak(largest, tensor) - 1)
    seq2trt.fuse(tmp_path / "new", "ort")
    with pytest.raises(seq2trt.InputError, match="int8 quantization of .*more than this machine.*--backend ort-fused"):
        seq2trt.quantize(tmp_path / "new")
    assert not (tmp_path / "new" / "quantized").exists()


def test_fuse_result_matches_fusion_json(staged):
    root, _, result, messages = staged
    assert isinstance(result, seq2trt.FuseResult) and result.folder == root / "out" / "fused" / "ort"
    doc = json.loads((result.folder / "fusion.json").read_text())
    assert result.complete and doc["complete"] and result.target == "ort" == doc["target"]
    for name, path in result.graphs.items():
        assert sha256_file(path) == doc["files"][path.name]["sha256"]
        counts = {k: doc["graphs"][name][k] for k in ("expected", "fused", "nodes_before", "nodes_after")}
        assert {k: result.audit[name][k] for k in counts} == counts and sum(counts["fused"].values()) > 0
    assert messages["fuse"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.complete = False  # type: ignore[misc]


def test_validate_fused_graphs_through_the_api(staged):
    root, _, _, _ = staged
    messages: list[str] = []
    result = seq2trt.validate(root / "out", graphs="fused-ort", samples=4, beam_size=2, localize_budget_s=0,
                              progress=messages.append)
    assert isinstance(result, seq2trt.ValidationResult) and result.passed and result.cases > 0
    parity = json.loads((root / "out" / "reports" / "parity.json").read_text())
    assert parity["passed"] and parity["cases"] == result.cases == result.document["cases"]
    assert result.report.is_file() and result.report.parent == root / "out" / "reports"
    assert result.end_to_end is not None and result.end_to_end["samples"] == 4
    assert result.end_to_end["token_agreement"] == parity["end_to_end"]["token_agreement"]
    sampled = parity["sampling"]  # float32 graphs: sampled token for token under one seed, beside greedy and beam
    assert sampled["mode"] == "exact" and sampled["passed"] and sampled["exact"]["sequences"] == 4
    assert sampled["exact"]["identical"] + sampled["exact"]["near_ties"] == 4 and sampled["distribution"] is None
    assert "## Sampling (temperature 1, top-k 50, top-p 1, seed 0): passed" in result.report.read_text()
    assert any("parity" in m for m in messages)


def test_validate_bad_settings_raise_the_library_error(staged):
    root, _, _, _ = staged
    with pytest.raises(seq2trt.InputError, match="--samples"):
        seq2trt.validate(root / "out", samples=-1)


def test_bad_input_raises_and_writes_nothing(staged, tmp_path):
    root, _, _, _ = staged
    with pytest.raises(seq2trt.ConfigError, match="unknown dtype 'fp8'"):
        seq2trt.export(root / "ckpt", tmp_path / "new", dtype="fp8")
    with pytest.raises(seq2trt.ConfigError, match="opset"):
        seq2trt.export(root / "ckpt", tmp_path / "new", opset=1)
    assert not (tmp_path / "new").exists()
    before = {p.name: sha256_file(p) for p in (root / "out").iterdir() if p.is_file()}
    with pytest.raises(seq2trt.ArtifactError, match="--force"):
        seq2trt.export(root / "ckpt", root / "out")
    assert {p.name: sha256_file(p) for p in (root / "out").iterdir() if p.is_file()} == before
    with pytest.raises(seq2trt.InputError, match="unknown fusion target"):
        seq2trt.fuse(root / "out", "tensorrt")
    with pytest.raises(seq2trt.ArtifactError, match="not an export directory"):
        seq2trt.fuse(tmp_path, "ort")


def test_api_and_cli_export_the_same_graphs(staged):
    root, result, _, _ = staged
    invoke_ok("export", root / "ckpt", "-o", root / "cli_out", "--max-batch", 4)
    cli_manifest = json.loads((root / "cli_out" / "manifest.json").read_text())
    assert cli_manifest["files"] == result.manifest["files"]
    assert cli_manifest["settings"]["limits"] == result.limits and cli_manifest["config"] == result.manifest["config"]


def test_generate_and_report_through_the_api(staged):
    """generate.onnx from the fused graphs and the report of what the stages wrote, as the CLI writes them."""
    root, _, _, _ = staged
    generated = seq2trt.ort_search(root / "out")
    assert isinstance(generated, seq2trt.OrtSearchResult) and generated.graph.is_file()
    assert generated.graph == root / "out" / "generate" / "ort" / "generate.onnx"
    on_disk = json.loads((generated.graph.parent / "generate.json").read_text())
    assert generated.record["semantics"] == on_disk["semantics"]
    with pytest.raises(seq2trt.ArtifactError, match="pass --force"):
        seq2trt.ort_search(root / "out")
    rendered = seq2trt.report(root / "out")
    assert rendered.markdown.is_file() and rendered.html.is_file()
    assert rendered.markdown.parent == root / "out" / "reports"
    assert rendered.to_dict() == {"markdown": str(rendered.markdown), "html": str(rendered.html)}


def test_train_through_the_api(tmp_path):
    """A few steps on the built-in task: the checkpoint and metrics.json written, progress called per step; a
    bad task name and an existing folder are refused before any work."""
    steps: list[int] = []
    trained = seq2trt.train(tmp_path / "ckpt", preset="tiny", steps=3, eval_examples=4,
                            progress=lambda step, loss: steps.append(step))
    assert isinstance(trained, seq2trt.TrainResult) and trained.checkpoint == tmp_path / "ckpt"
    assert json.loads((tmp_path / "ckpt" / "metrics.json").read_text()) == trained.metrics
    assert (tmp_path / "ckpt" / "model.safetensors").is_file() and len(steps) >= 1
    with pytest.raises(seq2trt.InputError):
        seq2trt.train(tmp_path / "other", task="no-such-task", steps=1)
    assert not (tmp_path / "other").exists()
    before = (tmp_path / "ckpt" / "model.safetensors").read_bytes()
    with pytest.raises(seq2trt.ArtifactError, match="--force"):
        seq2trt.train(tmp_path / "ckpt", preset="tiny", steps=1)
    assert (tmp_path / "ckpt" / "model.safetensors").read_bytes() == before
