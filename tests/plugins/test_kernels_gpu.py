"""The attention kernels on a CUDA device, against the float64 reference: every kind x dtype x head_dim over the
awkward lengths of scripts/gpu_kernels.py, through triton's JIT and through the cubins compiled ahead of time for
this GPU and launched as the TensorRT plugin's enqueue launches them (cuda-python, no triton).

Both run in child processes: the AOT compile, and the sweep, must not share a process with triton's interpreter
(tests/plugins/test_kernels_interpret.py). scripts/gpu_check.sh runs this file on the GPU machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from seq2trt.plugins.op import AttentionKind

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GPU_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_kernels.py"


def _env() -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    return env


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    """Compile every variant for this GPU, then run the script's full correctness sweep (JIT and AOT)."""
    kernels, out = tmp_path_factory.mktemp("kernels"), tmp_path_factory.mktemp("gpu-kernels")
    major, minor = torch.cuda.get_device_capability()
    compile_ = subprocess.run([sys.executable, "-m", "seq2trt.plugins.kernels.aot", "--out", str(kernels),
                               "--targets", f"sm_{10 * major + minor}"],
                              env=_env(), capture_output=True, text=True, timeout=900)
    assert compile_.returncode == 0, compile_.stderr[-4000:]
    run = subprocess.run([sys.executable, str(GPU_SCRIPT), str(out), "--aot-index", str(kernels / "index.json"),
                          "--warmup", "1", "--iters", "3"], env=_env(), capture_output=True, text=True, timeout=900)
    doc = json.loads((out / "gpu_kernels.json").read_text()) if (out / "gpu_kernels.json").exists() else {}
    assert doc, f"gpu_kernels.py wrote no report (exit {run.returncode}):\n{run.stderr[-4000:]}"
    return doc


@pytest.mark.parametrize("route", ["correctness", "aot"], ids=["triton-jit", "aot-cubin"])
@pytest.mark.parametrize("kind", [k.name for k in AttentionKind])
def test_kernels_match_the_float64_reference_on_the_device(report, route, kind):
    checks = [c for c in report[route] if c.get("kind") == kind]
    assert {(c["dtype"], c["head_dim"]) for c in checks} == \
        {(d, h) for d in ("fp32", "fp16", "bf16") for h in (32, 64, 128)}
    failed = [{k: c.get(k) for k in ("dtype", "head_dim", "tgt_len", "kv_len", "max_abs", "present_exact", "error")}
              for c in checks if not c["ok"]]
    assert not failed, failed[:5]


def test_benchmarks_compare_the_same_op(report):
    """Every timed case ran through all three routes, and ours computed what SDPA computed."""
    assert report["benchmarks"] and all("error" not in b and "graph_error" not in b for b in report["benchmarks"])
    for b in report["benchmarks"]:
        assert min(b["triton_ms"], b["aot_ms"], b["torch_sdpa_ms"], b["aot_graph_ms"]) > 0
        assert b["max_abs_vs_sdpa"] < (1e-2 if b["dtype"] == "fp16" else 5e-2), b["name"]
