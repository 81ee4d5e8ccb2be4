"""The report renders every stage's record as tables a person reads: no raw JSON, no Python dicts."""

from __future__ import annotations

import json

from seq2trt.reference_model import preset
from seq2trt.validation.reports import bench_table as bench_report
from seq2trt.validation.reports import report
from seq2trt.validation.reports import parity_table as report_parity

CFG = preset("tiny", src_vocab_size=13, tgt_vocab_size=17)  # 2 decoder layers


def _build_json(folder, plugin=True):
    enc = {"input_ids": [[1, 1], [4, 8], [8, 16]], "attention_mask": [[1, 1], [4, 8], [8, 16]]}
    dec = {"input_ids": [[1, 1], [4, 1], [8, 16]], "encoder_attention_mask": [[1, 1], [4, 8], [8, 16]]}
    for i in range(2):
        for part in ("key", "value"):
            dec[f"past_key_values.{i}.encoder.{part}"] = [[1, 4, 1, 16], [4, 4, 8, 16], [8, 4, 16, 16]]
            dec[f"past_key_values.{i}.decoder.{part}"] = [[1, 4, 0, 16], [4, 4, 8, 16], [8, 4, 15, 16]]
    graphs = {name: {"source": f"fused/trt/{name}.onnx", "source_sha256": "ab" * 32, "plan_bytes": 3 * 2**20,
                     "build_seconds": 1.234, "profiles": profiles, "layer_types": {"SHUFFLE": 5, "PLUGIN_V3": 2},
                     "plugin_layers": 2} for name, profiles in (("encoder", enc), ("decoder", dec))}
    folder.mkdir(parents=True)
    (folder / "build.json").write_text(json.dumps({
        "graphs": graphs, "tensorrt_version": "1.7.1.116", "flavour": "tensorrt-rtx", "targets": [86],
        "compute_capabilities": [86], "dtype": "fp16", "limits": {"max_batch": 8, "max_src_len": 16, "max_tgt_len": 16},
        "plugin": {"name": "Seq2TrtAttention", "version": "1", "used": plugin, "layers": {"encoder": 2, "decoder": 4}},
        "builder_optimization_level": 3, "workspace_bytes": None, "created": "2026-11-30T00:00:00+00:00"}))


def test_engines_are_tables_of_builds_graphs_and_profile_axes(tmp_path):
    _build_json(tmp_path / "engines" / "tensorrt-rtx-sm_86-fp16")
    text = "\n".join(report._builds(tmp_path, CFG))
    assert "{" not in text and "```" not in text
    assert ("| tensorrt-rtx-sm_86-fp16 | tensorrt-rtx 1.7.1.116 | sm_86 | fp16 | Seq2TrtAttention v1, 2 encoder + 4 "
            "decoder layers | 3 | default | 2026-11-30 00:00 |") in text
    assert "| tensorrt-rtx-sm_86-fp16 | decoder | 3.0 | 1.23 | 7 | 2 | `fused/trt/decoder.onnx` (`abababababababab…`) |" \
        in text
    for row in ("| batch | 1 / 4 / 8 | 1 / 4 / 8 |", "| src_len | 1 / 8 / 16 | 1 / 8 / 16 |",
                "| tgt_len | – | 1 / 1 / 16 |", "| past_len | – | 0 / 8 / 15 |"):
        assert f"| tensorrt-rtx-sm_86-fp16 {row}" in text


def test_engines_without_the_plugin_and_an_unreadable_record(tmp_path):
    _build_json(tmp_path / "engines" / "a", plugin=False)
    (tmp_path / "engines" / "b").mkdir()
    (tmp_path / "engines" / "b" / "build.json").write_text("{not json")
    text = "\n".join(report._builds(tmp_path, CFG))
    assert "| fp16 | not used |" in text and "engines/b/build.json is unreadable" in text


def test_limits_are_a_table():
    manifest = {"config": {"num_encoder_layers": 2, "num_decoder_layers": 2, "d_model": 64, "num_heads": 4,
                           "d_ff": 128, "src_vocab_size": 13, "tgt_vocab_size": 17, "pre_norm": False,
                           "activation": "relu"},
                "dtype": "fp32", "opset": 18, "settings": {"limits": {"max_batch": 32, "max_src_len": 64,
                                                                       "max_tgt_len": 48}},
                "files": {}}
    lines = report._overview(manifest)
    assert "| max batch | max src len | max tgt len |" in lines and "| 32 | 64 | 48 |" in lines
    assert not any("{'max_batch'" in line for line in lines)


def test_parity_title_names_the_graphs():
    doc = {"passed": True, "backend": "ort", "graphs_set": "fused-trt", "dtype": "fp16", "reference": "eager",
           "cases": 3, "graphs": {}, "graph_failures": [], "end_to_end": None}
    assert report_parity.markdown(doc).startswith("# Parity of the fused-trt graphs on ort, fp16: PASSED\n")


def test_latency_builds_are_a_table():
    doc = {"settings": {"src_len": 8, "new_tokens": 8, "repeats": 1, "warmup": 0}, "machine": {},
           "model": {"num_encoder_layers": 2, "num_decoder_layers": 2, "d_model": 64}, "dtype": "fp32",
           "results": {}, "ratios": {},
           "builds": {"tensorrt-rtx-sm_86-fp32": {"encoder": {"build_seconds": 0.687, "plan_bytes": 13763684}},
                      "ct2": {"convert_seconds": 1.5, "model_bytes": 2**21}}}
    text = bench_report.markdown(doc, {})
    assert "| tensorrt-rtx-sm_86-fp32 | encoder.plan | 0.69 | 13.1 |" in text
    assert "| ct2 conversion | model.bin | 1.50 | 2.0 |" in text and "```" not in text


# --- `seq2trt report` on a real artifact: its tables hold the records' values, its verdicts follow them ------------

import pytest  # noqa: E402

from helpers.artifacts import numbers_model  # noqa: E402
from helpers.cli import invoke  # noqa: E402


@pytest.fixture(scope="module")
def reported(make_model, tmp_path_factory):
    """A tiny numbers model exported, validated (a few samples), benchmarked (two batch sizes, one repetition), all
    through the CLI: its records are what `report` reads."""
    from seq2trt.reference_model.checkpoint import save_checkpoint

    model, task = numbers_model(make_model, seed=4)
    root = tmp_path_factory.mktemp("report")
    ckpt = save_checkpoint(root / "ckpt", model, (task.source_vocab, task.target_vocab),
                           extra_files={"metrics.json": json.dumps({"task": "numbers"})})
    out = root / "out"
    for args in (["export", ckpt, "-o", out, "--max-batch", 4], ["validate", out, "--samples", 8, "--beam-size", 2],
                 ["bench", out, "--backends", "eager,ort", "--batch-sizes", "1,2", "--repeats", 1, "--warmup", 0,
                  "--new-tokens", 2, "--src-len", 4, "--no-curves"], ["report", out]):
        result = invoke(*args)
        assert result.exit_code in (0, 1), result.output  # validate exits 1 when a random model misses a target
    return out


def _render(out):
    return report.render_markdown(out)


def test_report_tables_hold_the_parity_and_latency_records(reported):
    text = (reported / "reports" / "report.md").read_text()
    parity = json.loads((reported / "reports" / "parity.json").read_text())
    verdict = "PASSED" if parity["passed"] else "FAILED"
    assert f"# Parity of the plain graphs on ort, {parity['dtype']}: {verdict}" in text
    assert f"| parity-ort-plain | ort | plain | {parity['dtype']} | {'yes' if parity['passed'] else 'NO'} |" in text
    rows = 0
    for graph, outputs in parity["graphs"].items():
        for name, row in outputs.items():
            line = next(line for line in text.splitlines() if line.startswith(f"| {graph} | {name} | "))
            cells = [c.strip() for c in line.strip("|").split("|")]
            assert float(cells[2]) == pytest.approx(row["max_abs"], rel=5.01e-3), line  # max abs, 3 significant digits
            assert float(cells[6]) == pytest.approx(row["rms"], rel=5.01e-3), line  # rms error, 3 significant digits
            assert float(cells[7]) == pytest.approx(row["min_cosine"], abs=1e-7), line
            assert cells[-1] == f"{len(row['failed_cases'])}/{row['cases']}", line
            rows += 1
    assert rows == sum(len(o) for o in parity["graphs"].values()) > 5
    latency = json.loads((reported / "reports" / "latency.json").read_text())
    seen = 0
    for threads, backends in latency["results"].items():
        for backend, batches in backends.items():
            for batch, r in batches.items():
                line = next(line for line in text.splitlines() if line.startswith(f"| {backend} | {batch} | "))
                cells = [c.strip() for c in line.strip("|").split("|")]
                assert float(cells[2]) == pytest.approx(r["tokens_per_s"], abs=0.0501), line
                assert float(cells[3]) == pytest.approx(r["step_ms_p50"], abs=5.001e-4), line  # 3 decimals, half up
                ratio = latency["ratios"][threads][backend][batch]["vs_eager"]
                assert float(cells[7].rstrip("×")) == pytest.approx(ratio, abs=5.01e-3), line
                seen += 1
    assert seen == 4  # eager and ort at batch 1 and 2


def test_report_verdict_follows_a_failing_parity_record(reported, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(reported, copy)
    for path in (copy / "reports").glob("parity*.json"):
        doc = json.loads(path.read_text())
        doc["passed"] = False
        row = doc["graphs"]["decoder"]["logits"]
        row["failed_cases"] = ["B1-S2-T1-P0"]
        doc["graph_failures"] = ["decoder B1-S2-T1-P0 logits: max_abs 9 (atol 1e-4)"]
        path.write_text(json.dumps(doc))
    text = _render(copy)
    assert f"# Parity of the plain graphs on ort, {doc['dtype']}: FAILED" in text and ": PASSED" not in text
    assert f"| parity-ort-plain | ort | plain | {doc['dtype']} | NO |" in text
    line = next(line for line in text.splitlines() if line.startswith("| decoder | logits | "))
    assert line.rstrip().endswith(f"| 1/{row['cases']} |"), line
