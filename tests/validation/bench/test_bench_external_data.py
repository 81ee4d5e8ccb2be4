"""`seq2trt bench` and `seq2trt report` on an export whose graphs keep their weights as ONNX external data (the
threshold lowered to 0, `SEQ2TRT_EXTERNAL_DATA_THRESHOLD`), against the same model's plain export: the backends the
bench times decode the eager model's tokens from the data files (the eager model is the judge, not the other
export), the bench covers the same rows, and the report lists every data file with its true size and hash."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from seq2trt.exporters import graph_files
from seq2trt.core.atomic_files import sha256_file
from seq2trt.reference_model.decoding import DecodeSettings, greedy_decode
from seq2trt.reference_model.eager import EagerStepModel
from seq2trt.validation.bench import measure as bench
from seq2trt.validation.bench.backends import sequences
from seq2trt.validation.bench.settings import BenchSettings

from helpers.cli import invoke_ok

BACKENDS = ("eager", "ort", "ort-fused", "ort-int8")
GRAPHS = ("encoder.onnx", "decoder.onnx")


@pytest.fixture(scope="module")
def exports(make_model, tmp_path_factory):
    """One checkpoint exported twice (plain, and every graph with a data file), each fused for ORT, quantized, then
    benched and reported through the CLI."""
    for name in ("onnxscript", "onnx_ir", "torch.onnx", "torch.export", "torch._export"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from seq2trt.reference_model.checkpoint import save_checkpoint

    root = tmp_path_factory.mktemp("bench-external")
    model = make_model(3, torch.float32)
    save_checkpoint(root / "ckpt", model)
    with pytest.MonkeyPatch.context() as patch:
        for name, threshold in (("plain", None), ("external", "0")):
            if threshold is None:
                patch.delenv(graph_files.THRESHOLD_ENV, raising=False)
            else:
                patch.setenv(graph_files.THRESHOLD_ENV, threshold)
            out = root / name
            invoke_ok("export", root / "ckpt", "-o", out, "--max-batch", 8)
            invoke_ok("fuse", out, "--target", "ort")
            invoke_ok("quantize", out)
            invoke_ok("bench", out, "--backends", ",".join(BACKENDS), "--batch-sizes", "1,2", "--repeats", 1,
                      "--warmup", 0, "--new-tokens", 4, "--no-curves")
            invoke_ok("report", out)
    return root, model


def test_the_external_export_really_keeps_its_weights_in_data_files(exports):
    root, _ = exports
    for folder in ("external", "external/fused/ort", "external/quantized/ort-int8"):
        for graph in GRAPHS:
            assert (root / folder / f"{graph}.data").is_file(), (folder, graph)
            assert not (root / folder.replace("external", "plain") / f"{graph}.data").exists()


@pytest.mark.parametrize("backend", ["ort", "ort-fused"])
def test_the_benched_runners_decode_the_eager_models_tokens_from_the_data_files(exports, backend):
    """The very runner the bench times (Bench._make: the registry's bench adapter), opened on the external export,
    decodes greedy tokens equal to the eager model's (float32, the checkpoint's weights) on seeded sources."""
    root, model = exports
    rng = np.random.default_rng(5)
    ids = rng.integers(3, model.cfg.src_vocab_size, size=(4, 7))
    ids[:, -1] = model.cfg.eos_id
    mask = np.ones_like(ids)
    settings = DecodeSettings(model.cfg.bos_id, model.cfg.eos_id, model.cfg.pad_id, 6)
    want = sequences(greedy_decode(EagerStepModel(model), ids, mask, settings))
    run = bench.Bench(root / "external", BenchSettings(backends=(backend,), batch_sizes=(1,)))
    runner = run._make(backend, 1)
    try:
        _, got = runner.search(ids, mask, settings, 1, 1.0)
    finally:
        runner.close()
    assert got == want


def test_bench_covers_the_same_rows_on_both_exports(exports):
    root, _ = exports
    docs = {name: json.loads((root / name / "reports" / "latency.json").read_text()) for name in ("plain", "external")}
    rows = {name: {(t, b, n) for t, by_backend in doc["results"].items() for b, by_batch in by_backend.items()
                   for n in by_batch} for name, doc in docs.items()}
    assert rows["plain"] == rows["external"] == {("1", b, n) for b in BACKENDS for n in ("1", "2")}
    for doc in docs.values():
        assert all(r["tokens_per_s"] > 0 for by_batch in doc["results"]["1"].values() for r in by_batch.values())
    assert docs["plain"]["model"] == docs["external"]["model"]


def test_report_lists_each_data_file_with_its_true_size_and_hash(exports):
    root, _ = exports
    report = (root / "external" / "reports" / "report.md").read_text()
    for graph in GRAPHS:
        for name in (graph, f"{graph}.data"):
            path = root / "external" / name
            assert f"| {name} | {path.stat().st_size:,} | `{sha256_file(path)[:16]}" in report, name
    plain = (root / "plain" / "reports" / "report.md").read_text()
    assert ".onnx.data" not in plain
    assert report.count("## ") == plain.count("## ")  # the same sections, none dropped for data files
