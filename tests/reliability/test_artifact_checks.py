"""Every reader checks the artifact and the limits it is given before using them: readers that outlive their export,
edited or foreign artifacts, non-finite weights, limits no profile can hold, head dims the kernels do not take, flags
that would silently mean "default". Each ends in one error line (exit 2), with nothing written.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from seq2trt.exporters.manifest import MANIFEST, read_manifest
from seq2trt.exporters.tensorrt import trt_compat
from seq2trt.core.errors import ArtifactError


# --- readers whose export is replaced while they run ---------------------------------------------------------------

def test_validate_refuses_to_write_into_an_export_replaced_meanwhile(work, monkeypatch, snapshot, invoke,
                                                                     one_error_line, rewrite_manifest):
    from seq2trt.validation import validate

    real = validate.graph_parity

    def replaced_meanwhile(*args, **kwargs):
        result = real(*args, **kwargs)
        rewrite_manifest(work / "out")
        return result

    monkeypatch.setattr(validate, "graph_parity", replaced_meanwhile)
    monkeypatch.setattr(validate.spec, "sweep", lambda limits, batches=None, cfg=None: [validate.spec.ShapeCase(2, 3, 1, 1, True)])
    before = snapshot(work / "out" / "reports")
    one_error_line(invoke("validate", work / "out", "--samples", "0"), 2, "was replaced while validate ran",
                   "were not written")
    assert snapshot(work / "out" / "reports") == before


def test_report_refuses_to_write_into_an_export_replaced_meanwhile(work, monkeypatch, snapshot, invoke, one_error_line,
                                                                   rewrite_manifest):
    from seq2trt.validation.reports import report

    real = report.render_markdown
    monkeypatch.setattr(report, "render_markdown", lambda out: (real(out), rewrite_manifest(out))[0])
    before = snapshot(work / "out" / "reports")
    one_error_line(invoke("report", work / "out"), 2, "was replaced while report ran")
    assert snapshot(work / "out" / "reports") == before


def test_bench_refuses_to_write_into_an_export_replaced_meanwhile(work, monkeypatch, snapshot, rewrite_manifest):
    from seq2trt.validation.bench import measure as bench
    from seq2trt.validation.bench.settings import BenchSettings

    monkeypatch.setattr(bench.Bench, "run", lambda self: rewrite_manifest(work / "out") or {})
    before = snapshot(work / "out" / "reports")
    with pytest.raises(ArtifactError, match="was replaced while bench ran"):
        bench.run_bench(work / "out", BenchSettings(backends=("ort",), batch_sizes=(1,)))
    assert snapshot(work / "out" / "reports") == before


# --- every consumer verifies what it reads ------------------------------------------------------------------------

def test_hand_edited_manifest_limits_are_refused_by_every_reader(work, snapshot, invoke, one_error_line):
    path = work / "out" / MANIFEST
    data = json.loads(path.read_text())
    data["settings"]["limits"]["max_batch"] = 100000
    path.write_text(json.dumps(data))
    before = snapshot(work)
    for args in (["bench", work / "out", "--backends", "ort"], ["validate", work / "out"], ["report", work / "out"],
                 ["build", work / "out", "--force"], ["fuse", work / "out", "--force"]):
        one_error_line(invoke(*args), 2, "manifest.json was changed after the export", "seq2trt export --force")
    assert snapshot(work) == before


def test_report_refuses_edited_fused_graphs(work, invoke, one_error_line):
    with open(work / "out" / "fused" / "trt" / "decoder.onnx", "ab") as f:
        f.write(b"\0")
    one_error_line(invoke("report", work / "out"), 2, "decoder.onnx does not match its sha256 in fusion.json")


def fake_engines(out: Path, source_sha256: str | None = None) -> Path:
    """An engine directory whose plans match build.json; `source_sha256` None: the graphs' own (a genuine build)."""
    folder = out / "engines" / "tensorrt-rtx-sm_86-fp32"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    fusion = json.loads((out / "fused" / "trt" / "fusion.json").read_text())["files"]
    graphs = {}
    for graph in ("encoder", "decoder"):
        plan = f"plan of {graph}".encode()
        (folder / f"{graph}.plan").write_bytes(plan)
        graphs[graph] = {"plan": f"{graph}.plan", "plan_sha256": hashlib.sha256(plan).hexdigest(), "plan_bytes": 12,
                         "build_seconds": 1.0, "source": f"fused/trt/{graph}.onnx",
                         "source_sha256": source_sha256 or fusion[f"{graph}.onnx"]["sha256"], "profiles": {}}
    (folder / "build.json").write_text(json.dumps({"graphs": graphs, "plugin": {"used": True}, "dtype": "fp32",
                                                   "limits": {"max_batch": 4, "max_src_len": 16, "max_tgt_len": 16}}))
    return folder


def test_report_refuses_engines_built_from_other_graphs(work, invoke, one_error_line):
    fake_engines(work / "out")
    assert invoke("report", work / "out").exit_code == 0  # the control: engines of these very graphs
    fake_engines(work / "out", source_sha256="ab" * 32)  # copied from another export, or build.json edited
    one_error_line(invoke("report", work / "out"), 2, "not built from the graphs of", "seq2trt build")


@pytest.mark.parametrize("edit, fragment", [
    (lambda info: info["limits"].update(max_batch=100000), "--max-batch 100000 (the export's max_batch is 4)"),
    (lambda info: info.update(dtype="fp16"), "dtype 'fp16', the export's is 'fp32'"),
    (lambda info: info.pop("limits"), "it lacks 'limits'"),
], ids=["limits", "dtype", "no-limits"])
def test_report_refuses_an_edited_build_json(work, edit, fragment, invoke, one_error_line):
    record = fake_engines(work / "out") / "build.json"
    info = json.loads(record.read_text())
    edit(info)
    record.write_text(json.dumps(info))
    one_error_line(invoke("report", work / "out"), 2, "build.json does not fit the export", fragment)


def test_the_tensorrt_runner_checks_source_sha256_too(work):
    from seq2trt.exporters import spec
    from seq2trt.runtime.tensorrt_runner import runner_for

    engines = fake_engines(work / "out", source_sha256="ab" * 32)
    with pytest.raises(ArtifactError, match="not built from the graphs of"):
        runner_for(engines, spec.GraphKind.ENCODER, read_manifest(work / "out").config)


# --- non-finite weights, and statistics on nothing finite ---------------------------------------------------------

def poison(w: Path, *names: str) -> None:
    from safetensors.torch import load_file, save_file

    path = w / "ckpt" / "model.safetensors"
    state = load_file(str(path))
    for i, name in enumerate(names):
        state[name].view(-1)[0] = float("nan") if i % 2 == 0 else float("inf")
    save_file(state, str(path))


def test_non_finite_weights_are_refused_at_load_naming_the_tensors(work, snapshot, invoke, one_error_line):
    poison(work, "lm_head.weight", "tgt_embed.weight")
    before = snapshot(work)
    for args in (["translate", work / "ckpt", "123"], ["export", work / "ckpt", "-o", work / "new"]):
        one_error_line(invoke(*args), 2, "NaN or infinite weights in 2 tensor(s)", "lm_head.weight",
                       "tgt_embed.weight")
    assert snapshot(work) == before


@pytest.mark.parametrize("candidate, reference", [
    (np.full(6, np.nan), np.full(6, np.nan)),
    (np.full(6, np.inf), np.ones(6)),
    (np.ones(6), np.full(6, np.nan)),
    (np.zeros((0, 3)), np.zeros((0, 3))),
], ids=["all-nan", "all-inf", "reference-nan", "empty"])
def test_parity_statistics_are_safe_on_nothing_finite(candidate, reference):
    from seq2trt.validation.parity import Tolerance, compare_output

    stats = compare_output("logits", candidate, reference, Tolerance(1e-5, 1e-5, 0.999))
    assert bool(stats) == (candidate.size == 0)


def test_validate_samples_are_bounded(work, invoke, one_error_line):
    one_error_line(invoke("validate", work / "out", "--samples", "100000000"), 2, "--samples 100000000",
                   "at most 100000")


# --- limits and flags --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, fragment", [
    (["--max-batch", "0"], "max_batch must be an integer >= 2"),
    (["--max-src-len", "0"], "max_src_len must be an integer >= 2"),
    (["--max-batch", "1000000000"], "more than a TensorRT profile can"),
], ids=["batch-0", "src-len-0", "batch-absurd"])
def test_export_refuses_limits_that_are_zero_or_absurd(work, flags, fragment, snapshot, invoke, one_error_line):
    before = snapshot(work)
    one_error_line(invoke("export", work / "ckpt", "-o", work / "new", *flags), 2, fragment)
    assert snapshot(work) == before


@pytest.fixture
def tensorrt_here(monkeypatch):
    """As if TensorRT-RTX were installed (its import only): build's own checks run; TensorRT is never called."""
    from seq2trt.exporters.tensorrt import engines as tensorrt_engines

    monkeypatch.setattr(trt_compat, "load", lambda flavour: None)
    monkeypatch.setattr(tensorrt_engines, "build", lambda *a, **k: pytest.fail("TensorRT was called"))


@pytest.mark.parametrize("flags, fragment", [
    (["--max-batch", "0"], "max_batch must be an integer >= 2"),
    (["--max-batch", "64"], "--max-batch 64 (the export's max_batch is 4)"),
    (["--max-src-len", "0"], "max_src_len must be an integer >= 2"),
], ids=["batch-0", "batch-beyond-export", "src-len-0"])
def test_build_refuses_profiles_of_zero_or_beyond_the_export(work, tensorrt_here, flags, fragment, snapshot, invoke,
                                                             one_error_line):
    before = snapshot(work)
    one_error_line(invoke("build", work / "out", "--target", "sm_86", "--force", *flags), 2, fragment)
    assert snapshot(work) == before


def test_build_for_the_current_gpu_without_one_is_a_clear_error(work, tensorrt_here, monkeypatch, snapshot, invoke,
                                                                one_error_line):
    monkeypatch.setattr(trt_compat, "has_gpu", lambda: False)
    before = snapshot(work)
    one_error_line(invoke("build", work / "out", "--target", "current", "--force"), 2, "--target current",
                   "none is visible", "--target sm_86")
    assert snapshot(work) == before


def test_head_dims_the_kernels_do_not_take_are_refused_at_build(work, tensorrt_here, monkeypatch, snapshot, invoke,
                                                                one_error_line):
    from seq2trt.plugins.kernels import launch_plan as launch

    monkeypatch.setattr(launch, "HEAD_DIMS", (64, 128))  # the artifact's head_dim is 32
    before = snapshot(work)
    one_error_line(invoke("build", work / "out", "--target", "sm_86", "--force"), 2, "this model's is 32",
                   "--no-plugin", "--target ort")
    assert snapshot(work) == before
