"""The GPU check cannot rot: its dry run resolves everything a run on a lent GPU would use (and fails on a planted
copy with moved paths), onnxruntime-gpu's parts survive the trip (split, staged, joined, sha256-checked; a damaged
or missing part is named), the device calls fit what a call may carry, a run records its steps, and the T5 and
Whisper family check runs end to end on the CPU against transformers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


def _script(name: str):
    """A script of scripts/ as a module (registered: its dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(f"_scripts_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _plan():
    return _script("gpu_check_plan")


def _env(**extra) -> dict:
    return {**os.environ, "SEQ2TRT_PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **extra}


def test_dry_run_resolves_every_step():
    proc = subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh"), "--dry-run"], env=_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "dry run: ok" in proc.stdout
    for step in _plan().STEPS:
        assert f"ok  step {step.name}:" in proc.stdout
    collected = int(proc.stdout.split(" gpu-marked tests collected")[0].split()[-1])
    assert collected >= 10  # the kernels' and the TensorRT runner's, at least


def test_dry_run_fails_on_a_planted_copy_with_moved_paths(tmp_path):
    """A copy of the check whose steps name a moved script, a renamed subcommand, a flag the script lacks and a
    `seq2trt` name that does not exist: the dry run fails and names each."""
    planted = tmp_path / "scripts"
    shutil.copytree(SCRIPTS, planted, ignore=shutil.ignore_patterns("__pycache__"))
    plan = planted / "gpu_check_plan.py"
    text = plan.read_text()
    for old, new in [('"scripts/gpu_check_families.py"', '"scripts/checks/gpu_check_families.py"'),
                     ('"scripts/gpu_check.py", "tensorrt"', '"scripts/gpu_check.py", "trt"'),
                     ('"--bias-speed-only"', '"--bias-only"')]:
        assert old in text
        text = text.replace(old, new)
    plan.write_text(text)
    check = planted / "gpu_check.py"
    check.write_text(check.read_text().replace("from seq2trt.plugins.eager_kernels import cubin_run",
                                               "from seq2trt.plugins.eager_kernels import cubin_launch"))
    proc = subprocess.run([sys.executable, str(plan), "dry-run", "--root", str(ROOT)], env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-4000:]
    out = proc.stdout
    assert "no such script" in out and "checks/gpu_check_families.py" in out
    assert "no subcommand ['trt']" in out
    assert "refuses" in out and "--bias-only" in out
    assert "has no 'cubin_launch'" in out
    assert "dry run: 4 problem(s)" in out


def test_pytest_resolution_names_missing_and_left_out_test_files():
    plan = _plan()
    missing, _ = plan.resolve_pytest(["-m", "gpu", str(ROOT / "tests/plugins/test_kernels_moved.py")], ROOT)
    assert missing == [f"gpu_tests: no such test file {ROOT / 'tests/plugins/test_kernels_moved.py'}"]
    problems, ids = plan.resolve_pytest(["-m", "gpu", str(ROOT / "tests/plugins/test_kernels_gpu.py"),
                                         str(ROOT / "tests/test_packaging.py")], ROOT)
    assert "gpu_tests: tests/test_packaging.py collects no gpu-marked test" in problems
    assert any("has gpu-marked tests but the step does not run it" in p and "test_kernels_bias.py" in p
               for p in problems)
    assert any(i.startswith("tests/plugins/test_kernels_gpu.py::") for i in ids)
    gpu_file = str(ROOT / "tests/plugins/test_kernels_gpu.py")
    bad_option, _ = plan.resolve_pytest(["-m", "gpu", "--no-such-option", gpu_file], ROOT)
    assert bad_option and "collection failed" in bad_option[0]


def test_cli_resolution_checks_verbs_flags_and_choices():
    plan = _plan()
    assert plan.resolve_cli(["validate", "EXPORT", "--backend", "ort"]) == []
    assert plan.resolve_cli(["validat", "EXPORT"])[0].startswith("seq2trt has no verb 'validat'")
    assert plan.resolve_cli(["validate", "EXPORT", "--backends", "ort"]) == \
        ["seq2trt validate has no option --backends"]
    (bad,) = plan.resolve_cli(["validate", "EXPORT", "--backend", "no-such-backend"])
    assert "no-such-backend" in bad and "'ort'" in bad


# --- onnxruntime-gpu in parts -----------------------------------------------------------------------------------

def _ort():
    return _script("gpu_check_ort")


def test_wheel_parts_round_trip_and_damage_is_named(tmp_path):
    ort = _ort()
    wheel = tmp_path / "onnxruntime_gpu-9.9.9-cp312-cp312-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(os.urandom((5 << 20) + 12345))  # 5 MiB and a bit: six parts of 1 MiB, the last short
    manifest = ort.split(wheel, tmp_path / "parts", part_mib=1)
    folders = sorted((tmp_path / "parts").iterdir())
    assert len(folders) == len(manifest["parts"]) == 6
    assert all(p["bytes"] <= 1 << 20 for p in manifest["parts"]) and manifest["parts"][-1]["bytes"] == 12345
    store = tmp_path / "store"
    for folder in folders[:-1]:
        ort.stage(folder, store)
    with pytest.raises(ort.PartsError, match="part-6"):
        ort.assemble(store)
    # the shell's staging verb, as a device call runs it
    proc = subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh"), "--stage-ort", str(folders[-1])],
                          env=_env(SEQ2TRT_ORT_STORE=str(store)), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "6/6 parts" in proc.stdout, proc.stderr
    joined = ort.assemble(store)
    assert joined.name == wheel.name and joined.read_bytes() == wheel.read_bytes()
    (store / manifest["parts"][2]["name"]).write_bytes(b"damaged")
    joined.unlink()
    with pytest.raises(ort.PartsError, match="part-3"):
        ort.assemble(store)
    bad = folders[0] / manifest["parts"][0]["name"]
    bad.write_bytes(bad.read_bytes()[:-1] + b"\0")
    with pytest.raises(ort.PartsError, match="sha256"):
        ort.stage(folders[0], store)


def test_device_calls_stay_under_the_carry_limit(tmp_path):
    """Five parts of 56 MiB (onnxruntime-gpu's ~244 MiB): four staging calls, then the check, which carries the
    last part when it fits; every call under 64 MiB with the tracked tree. A part too large is flagged."""
    plan = _plan()
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "README").write_text("tree\n")
    subprocess.run(["git", "-C", str(tmp_path), "add", "README"], check=True)
    sizes = [56 << 20] * 4 + [20 << 20]
    for k, size in enumerate(sizes, 1):
        (tmp_path / f".gpu/ort/part-{k}").mkdir(parents=True)
        with open(tmp_path / f".gpu/ort/part-{k}/w.part{k}", "wb") as f:
            f.truncate(size)  # sparse: the sizes are what matter
    (tmp_path / ".gpu/kernels").mkdir(parents=True)
    with open(tmp_path / ".gpu/kernels/index.json", "wb") as f:
        f.truncate(30 << 20)
    calls = plan.device_calls(tmp_path)
    assert [c["command"] for c in calls[:4]] == [plan.STAGE_COMMAND.format(part=f".gpu/ort/part-{k}")
                                                for k in range(1, 5)]
    assert calls[4]["command"] == plan.CHECK_COMMAND and calls[4]["carry"][-1] == ".gpu/ort/part-5"
    assert all(c["bytes"] <= plan.CARRY_LIMIT for c in calls)
    with open(tmp_path / ".gpu/ort/part-1/w.part1", "wb") as f:
        f.truncate(70 << 20)
    assert plan.device_calls(tmp_path)[0]["bytes"] > plan.CARRY_LIMIT


def test_run_records_chosen_steps_and_refuses_unknown_ones(tmp_path):
    plan = SCRIPTS / "gpu_check_plan.py"
    proc = subprocess.run([sys.executable, str(plan), "run", str(tmp_path / "out")], env=_env(SEQ2TRT_GPU_STEPS="env"),
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "out/summary.json").read_text())
    assert summary["env"]["status"] == 0 and set(summary) == {s.name for s in _plan().STEPS}
    assert all(s["status"] == "skipped" for name, s in summary.items() if name != "env")
    env = json.loads((tmp_path / "out/env.json").read_text())
    assert env["cuda_available"] is False and "CPUExecutionProvider" in env["onnxruntime_providers"]
    proc = subprocess.run([sys.executable, str(plan), "run", str(tmp_path / "out")],
                          env=_env(SEQ2TRT_GPU_STEPS="env,kernel"), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "['kernel']" in proc.stdout
    # a spent budget: no step starts, each says why, and the summary is still written
    proc = subprocess.run([sys.executable, str(plan), "run", str(tmp_path / "spent")],
                          env=_env(SEQ2TRT_GPU_BUDGET_S="5"), capture_output=True, text=True, timeout=60)
    summary = json.loads((tmp_path / "spent/summary.json").read_text())
    assert proc.returncode == 0 and "budget is spent" in summary["env"]["why"]


def test_family_check_runs_on_the_cpu_against_transformers(tmp_path):
    """The families step's code end to end on the CPU (the suite's tiny models): seq2trt's eager route decodes T5
    and Whisper token-equal to transformers' generate, greedy and beam 4."""
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    proc = subprocess.run([sys.executable, str(SCRIPTS / "gpu_check_families.py"), str(tmp_path / "f.json"),
                           "--device", "cpu", "--small", "--sources", "3"], env=_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "f.json").read_text())
    assert report["ok"]
    for family in ("t5", "whisper"):
        assert report[family]["eager"] == {**report[family]["eager"], "greedy_equal": 3, "beam_equal": 3, "ok": True}
