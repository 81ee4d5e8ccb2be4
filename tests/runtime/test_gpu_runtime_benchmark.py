"""benchmarks/gpu_runtime.py, the GPU check's runtime benchmark, resolves on a CPU (--dry-run): both shapes convert
to seq2trt's config and build, the dtypes pass the exporter's rules, the export's limits hold every row count, and
ort-cuda is declared with its module. A plan that would fail on the GPU fails here."""

from __future__ import annotations

import importlib.util
import re
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_runtime.py"


@pytest.fixture
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_runtime", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_runtime", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_dry_run_resolves_every_run(bench, capsys):
    assert bench.main(["--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("whisper-base: whisper, 73 M parameters, export max_batch 160, max_tgt_len 33")
    # flan-t5-base is untied: 248 M under transformers 4.x; 5.x's config says tied for every T5 and the import unties
    # only on seeing a stored head, which a dry run (no weights) does not read: 223 M there.
    assert any(re.match(r"flan-t5-base: t5, (248|223) M parameters, export max_batch 128", line) for line in lines)
    runs = [line for line in lines if line.startswith("  ")]
    # 2 shapes x (greedy, beam) x 2 batches x 4 routes, each of 32 new tokens
    assert len(runs) == 32 and all(line.endswith(" 32 new tokens") for line in runs)
    assert sum(" ort-cuda " in line for line in runs) == 16
    assert Counter(line.split("B=")[0].strip() for line in runs) == {"greedy": 16, "beam 5": 8, "beam 4": 8}
    assert Counter(line.split()[line.split().index("greedy") + 1 if "greedy" in line else 2] for line in runs) == {
        "B=1": 16, "B=32": 16}


def test_a_plan_the_gpu_could_not_run_fails_the_dry_run(bench, monkeypatch, capsys):
    from seq2trt.runtime import registry

    t5 = bench.SHAPES["flan-t5-base"]
    monkeypatch.setitem(bench.SHAPES, "flan-t5-base", replace(t5, dtypes=("fp16", "fp32")))  # flan-t5 overflows fp16
    assert bench.main(["--dry-run", "--shapes", "flan-t5-base", "--batches", "1"]) == 1
    assert "fp16 is refused for gated-FFN T5 models" in capsys.readouterr().err
    monkeypatch.setitem(bench.SHAPES, "flan-t5-base", t5)
    monkeypatch.delitem(registry.BACKENDS, "ort-cuda")  # the backend it times, undeclared
    assert bench.main(["--dry-run", "--shapes", "flan-t5-base", "--batches", "1"]) == 1
    assert "does not resolve" in capsys.readouterr().err
    assert bench.main(["--dry-run", "--shapes", "t5-huge"]) == 1


def test_the_measuring_path_runs_end_to_end_on_tiny_shapes(bench, monkeypatch, tmp_path, capsys):
    """The path the GPU runs, smoke-run on the CPU: tiny shapes of both families, the torch routes on the CPU and
    ort-cuda's sessions on the CPU provider (a CUDA provider reported). Every planned row is measured, the ratios
    are to transformers, and ort-cuda's fp32 greedy tokens equal the eager model's, as the GPU run checks."""
    import json

    pytest.importorskip("transformers", reason="the hf extra is not installed")
    from helpers.hf_models import T5_SMALL, WHISPER_IDS, WHISPER_SMALL

    from seq2trt.exporters import ort_session
    from seq2trt.exporters.tensorrt import trt_compat

    cpu_providers = ort_session.providers
    monkeypatch.setattr(ort_session, "has_cuda", lambda: True)
    monkeypatch.setattr(trt_compat, "has_gpu", lambda: True)
    monkeypatch.setattr(ort_session, "providers", lambda device="cpu", device_id=0: cpu_providers("cpu"))
    ids = WHISPER_IDS
    monkeypatch.setattr(bench, "SHAPES", {
        "whisper-tiny": bench.Shape("WhisperConfig", "WhisperForConditionalGeneration", WHISPER_SMALL, 3,
                                    ("bf16", "fp32"), generation=dict(
                                        decoder_start_token_id=ids["sot"], bos_token_id=ids["eot"],
                                        eos_token_id=ids["eot"], pad_token_id=ids["eot"], max_length=448,
                                        no_timestamps_token_id=ids["no_timestamps"], is_multilingual=False,
                                        begin_suppress_tokens=[7, 100], suppress_tokens=[1, 2])),
        "t5-tiny": bench.Shape("T5Config", "T5ForConditionalGeneration",
                               {**T5_SMALL, "pad_token_id": 0, "eos_token_id": 1}, 2, ("bf16", "fp32"))})
    assert bench.main(["--out", str(tmp_path), "--device", "cpu", "--batches", "1,2", "--new-tokens", "4",
                       "--repeats", "1"]) == 0
    rows = json.loads((tmp_path / "gpu_runtime.json").read_text())
    assert len(rows) == 2 * 2 * 2 * 4  # shapes x searches x batches x routes
    for row in rows:
        assert row["error"] is None and row["tokens_per_s"] > 0 and len(row["seconds"]) == 1
        if row["route"].startswith("transformers"):
            assert row["vs_transformers"] == 1.0
    greedy = [r for r in rows if r["search"] == "greedy"]
    assert all(r["fp32_tokens_equal_eager"] is True for r in greedy)
    assert "x transformers" in capsys.readouterr().out


def test_a_failing_route_is_recorded_and_the_others_go_on(bench, capsys):
    """One route raising (a provider refusing, memory) leaves the others' timings and says so in the exit status."""
    class Runs:
        shape = "toy"

        def decode(self, route, dtype, ids, mask, beams):
            if route == "broken":
                raise RuntimeError("CUDA out of memory\nmore detail")
            return 0.5, [[1, 2]]

    seconds, tokens, failed = bench.time_routes(Runs(), [("ok", "fp32"), ("broken", "fp16")], None, None, 1, 2)
    assert seconds == {"ok": [0.5, 0.5], "broken": []} and tokens == {"ok": [[1, 2]]}
    assert failed == {"broken": "RuntimeError: CUDA out of memory"}
    assert "toy broken: failed: RuntimeError: CUDA out of memory" in capsys.readouterr().err
