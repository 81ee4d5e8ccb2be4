"""What the reliability tests share: the tiny artifact they damage copies of (built once per test session of this
folder), the helpers that run the CLI on a copy and judge what came back, the `rtx` marker, and the fuzz's seeds,
tools (fuzzing.py) and stand-ins."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
from click.testing import CliRunner, Result

from seq2trt.cli.main import cli
from seq2trt.exporters import spec
from seq2trt.reference_model.checkpoint import save_checkpoint
from seq2trt.reference_model.tasks import get_task

HAS_RTX = importlib.util.find_spec("tensorrt_rtx") is not None
MAX_BATCH, MAX_LEN = 4, 16


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "rtx: needs tensorrt_rtx (a real build, or the engines `artifact` builds "
                                       "with it); skipped with a reason when it is not installed")


def pytest_runtest_setup(item) -> None:
    if item.get_closest_marker("rtx") and not HAS_RTX:
        pytest.skip("tensorrt_rtx is not installed (pip install 'seq2trt[rtx]')")


@pytest.fixture(scope="package")
def artifact(make_model, tmp_path_factory) -> Path:
    """One tiny checkpoint, its export, fused TensorRT graphs, engines (when TensorRT-RTX is here) and a report."""
    from seq2trt.reference_model.checkpoint import source_record
    from seq2trt.exporters.fuse import Target, fuse_artifacts
    from seq2trt.exporters.onnx_export import export

    task = get_task("numbers")
    model = make_model(seed=3, dtype=torch.float32, src_vocab_size=len(task.source_vocab),
                       tgt_vocab_size=len(task.target_vocab), max_src_len=MAX_LEN, max_tgt_len=MAX_LEN,
                       num_heads=1)  # head_dim 32: one the plugin's kernels take, so `build` accepts the fused graphs
    root = tmp_path_factory.mktemp("artifact")
    ckpt = save_checkpoint(root / "ckpt", model, (task.source_vocab, task.target_vocab),
                           extra_files={"metrics.json": json.dumps({"task": "numbers"})})
    export(model, root / "out", limits=spec.Limits.for_model(model.cfg, MAX_BATCH), source=source_record(ckpt))
    fuse_artifacts(root / "out", Target.TRT)
    if HAS_RTX:
        from seq2trt.exporters.tensorrt_engines import EngineRequest, build_engines

        build_engines(root / "out", EngineRequest("tensorrt-rtx", (86,)))
    assert CliRunner().invoke(cli, ["report", str(root / "out")]).exit_code == 0
    return root


@pytest.fixture(scope="session")
def engines() -> str:
    """Where `artifact` puts its engines (when TensorRT-RTX is here), relative to its export (`out`)."""
    return "engines/tensorrt-rtx-sm_86-fp32"


@pytest.fixture
def work(artifact, tmp_path) -> Path:
    """A private copy of the artifact (the manifest still names the module's checkpoint, read only)."""
    shutil.copytree(artifact, tmp_path / "w")
    return tmp_path / "w"


def _snapshot(root: Path) -> dict[str, str]:
    """Every file and folder under `root` (hidden ones included) -> sha256 of its bytes ("dir" for folders)."""
    return {str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}


def _invoke(*args) -> Result:
    """The CLI in process (a subprocess costs seconds per call on our CPUs); arguments may be paths."""
    return CliRunner().invoke(cli, [str(a) for a in args])


def _one_error_line(result: Result, code: int, *fragments: str) -> str:
    """Exit `code`, no traceback, exactly one error line (ours or click's `Error:`) holding every fragment; returns
    that line. Failure messages show at most 2,000 characters of the output (a huge input may be echoed in it)."""
    output = result.output
    assert result.exit_code == code, output[:2000]
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)[:2000]
    assert "Traceback" not in output, output[:2000]
    lines = [line for line in output.splitlines() if line.lower().startswith("error:")]
    assert len(lines) == 1, output[:2000]
    assert all(f in lines[0] for f in fragments), lines[0][:2000]
    return lines[0]


def _rewrite_manifest(out: Path) -> None:
    """Write the export's manifest again from what it holds, re-hashing its files: a deliberate change to a file
    then reaches the stage instead of the sha256 check, and the export looks re-exported (a new generation)."""
    from seq2trt.exporters.manifest import read_manifest, write_manifest

    m = read_manifest(out)
    write_manifest(out, m.config, m.data["settings"], list(m.data["files"]), m.data["source"])


def _seq2trt(*args, cwd: Path | None = None) -> subprocess.Popen:
    """The CLI in a real process (for signals and races), stdout and stderr captured as text."""
    return subprocess.Popen([sys.executable, "-m", "seq2trt.cli.main", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd)


def _signal_while_staging(proc: subprocess.Popen, folder: Path, pattern: str, sig: int) -> str:
    """Send `sig` to `proc` once it has started writing its staged directory (`pattern` matches it in `folder`);
    returns its stderr once it has exited."""
    deadline = time.monotonic() + 120
    while not list(folder.glob(pattern)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(sig)
    return proc.communicate(timeout=120)[1]


@pytest.fixture(scope="session")
def snapshot() -> Callable[[Path], dict[str, str]]:
    return _snapshot


@pytest.fixture(scope="session")
def invoke() -> Callable[..., Result]:
    return _invoke


@pytest.fixture(scope="session")
def one_error_line() -> Callable[..., str]:
    return _one_error_line


@pytest.fixture(scope="session")
def rewrite_manifest() -> Callable[[Path], None]:
    return _rewrite_manifest


@pytest.fixture(scope="session")
def seq2trt() -> Callable[..., subprocess.Popen]:
    return _seq2trt


@pytest.fixture(scope="session")
def signal_while_staging() -> Callable[..., str]:
    return _signal_while_staging


# --- the fuzz (test_fuzz_*.py): its seeds, its tools (fuzzing.py) and its stand-ins -------------------------------

# A new run seed every run, unless replaying one: SEQ2TRT_FUZZ_SEED=<seed printed by a failure>. CI (CI=true) runs
# one fixed seed instead: fresh seeds still find crashes (2 of 7 local runs on 2026-11-30: a float as
# source.checkpoint, a flipped byte in decoder.onnx reaching validate as a TypeError; both fixed since), and a gate that fails on the
# draw would block every submission; those finds belong in issues, found by the developers' runs.
CI_RUN_SEED = 20261130
RUN_SEED = int(os.environ.get("SEQ2TRT_FUZZ_SEED")
               or (CI_RUN_SEED if os.environ.get("CI") else int.from_bytes(os.urandom(4), "little")))



def _load_fuzzing():
    """fuzzing.py, beside this file: test modules cannot import each other (--import-mode=importlib), so the fuzz
    tests get it from the `fuzz` fixture."""
    location = importlib.util.spec_from_file_location("seq2trt_reliability_fuzzing",
                                                      Path(__file__).with_name("fuzzing.py"))
    module = importlib.util.module_from_spec(location)
    sys.modules[location.name] = module  # its dataclasses look their module up by name
    location.loader.exec_module(module)
    return module


_fuzzing = _load_fuzzing()


@pytest.fixture(scope="session")
def fuzz():
    return _fuzzing


def _test_path(request) -> str:
    return f"{request.node.path}::{request.node.name}"


@pytest.fixture
def outcomes(request):
    """The fuzz test's cases (seeded from the run seed) and what came of them; a failure names the run seed."""
    return _fuzzing.Outcomes(RUN_SEED, f"SEQ2TRT_FUZZ_SEED={RUN_SEED} pytest {_test_path(request)}")


@pytest.fixture
def quick_validation(monkeypatch):
    """Validation over one shape case: the files are fuzzed, not the sweep."""
    from seq2trt.validation.validate import ValidateSettings, run_validation

    monkeypatch.setattr(spec, "sweep", lambda limits, batches=None: [spec.ShapeCase(2, 3, 1, 1, True)])
    return lambda out, graphs="plain": run_validation(out, ValidateSettings(graphs=graphs, samples=0,
                                                                            localize_budget_s=2.0))


@pytest.fixture
def stub_build(monkeypatch):
    """build_engines without TensorRT's compile (seconds a case): every check of the files it reads still runs."""
    from seq2trt.exporters import tensorrt_engines
    from seq2trt.exporters.tensorrt_build import BuildResult, NetworkInfo
    from seq2trt.exporters.tensorrt_engines import EngineRequest, build_engines
    from seq2trt.plugins import trt_compat

    info = NetworkInfo({}, {}, {}, 0, 0)
    monkeypatch.setattr(tensorrt_engines, "build", lambda path, *a, **k: BuildResult(
        path.read_bytes()[:64], info, 0.0, "1.7.1.116", (86,)))
    monkeypatch.setattr(trt_compat, "load", lambda flavour: None)
    return lambda out: build_engines(out, EngineRequest("tensorrt-rtx", (86,), force=True))
