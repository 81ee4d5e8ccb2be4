"""benchmarks/gpu_runtime.py, the GPU check's runtime benchmark, resolves on a CPU (--dry-run): both shapes convert
to seq2trt's config and build, the dtypes pass the exporter's rules, the export's limits hold every row count, and
ort-cuda is declared with its module. A plan that would fail on the GPU fails here."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_runtime.py"


@pytest.fixture
def bench():
    spec = importlib.util.spec_from_file_location("gpu_runtime", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_dry_run_resolves_every_run(bench, capsys):
    assert bench.main(["--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("whisper-base: whisper, 73 M parameters, export max_batch 160, max_tgt_len 33")
    assert any(line.startswith("flan-t5-base: t5, 248 M parameters, export max_batch 128") for line in lines)
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
    monkeypatch.setitem(bench.SHAPES, "flan-t5-base", (*t5[:4], ("fp16", "fp32")))  # flan-t5 overflows fp16
    assert bench.main(["--dry-run", "--shapes", "flan-t5-base", "--batches", "1"]) == 1
    assert "fp16 is refused for gated-FFN T5 models" in capsys.readouterr().err
    monkeypatch.setitem(bench.SHAPES, "flan-t5-base", t5)
    monkeypatch.delitem(registry.BACKENDS, "ort-cuda")  # the backend it times, undeclared
    assert bench.main(["--dry-run", "--shapes", "flan-t5-base", "--batches", "1"]) == 1
    assert "does not resolve" in capsys.readouterr().err
    assert bench.main(["--dry-run", "--shapes", "t5-huge"]) == 1
