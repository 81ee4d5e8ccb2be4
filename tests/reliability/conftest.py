"""What the reliability tests share: the tiny artifact they damage copies of (built once per test session of this
folder), the helpers that run the CLI on a copy and judge what came back, the `rtx` marker, and the fuzz's seeds,
tools (fuzzing.py) and stand-ins."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
from click.testing import Result

from seq2trt.exporters import spec

from helpers.artifacts import checkpoint_and_export, numbers_model
from helpers.cli import invoke_ok

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
    """One tiny checkpoint, its export, fused TensorRT graphs, engines (when TensorRT-RTX is here) and a report: the
    folder's own, since its tests damage copies of every record a full artifact holds."""
    # num_heads 1: head_dim 32, one the plugin's kernels take, so `build` accepts the fused graphs
    model, task = numbers_model(make_model, seed=3, max_src_len=MAX_LEN, max_tgt_len=MAX_LEN, num_heads=1)
    root = tmp_path_factory.mktemp("artifact")
    _, out = checkpoint_and_export(root, model, task, max_batch=MAX_BATCH, fuse=("trt",), record_task=True)
    if HAS_RTX:
        from seq2trt.exporters.tensorrt.engines import EngineRequest, build_engines

        build_engines(out, EngineRequest("tensorrt-rtx", (86,)))
    invoke_ok("report", out)
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
    """helpers.cli.invoke, as the folder's tests take it."""
    from helpers.cli import invoke

    return invoke


@pytest.fixture(scope="session")
def one_error_line() -> Callable[..., str]:
    """helpers.cli.one_error_line, as the folder's tests take it."""
    from helpers.cli import one_error_line

    return one_error_line


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

# A new run seed every run (drawn in tests/conftest.py, printed in the session header), unless replaying one:
# SEQ2TRT_FUZZ_SEED=<seed printed by a failure or the header>. CI (CI=true) runs
# one fixed seed instead: fresh seeds keep finding new crashes, but a gate that fails on the draw would block every
# submission; what they find is reported from the developers' runs.
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

    monkeypatch.setattr(spec, "sweep", lambda limits, batches=None, cfg=None: [spec.ShapeCase(2, 3, 1, 1, True)])
    return lambda out, graphs="plain": run_validation(out, ValidateSettings(graphs=graphs, samples=0,
                                                                            localize_budget_s=2.0))


@pytest.fixture
def stub_build(monkeypatch):
    """build_engines without TensorRT's compile (seconds a case): every check of the files it reads still runs."""
    from seq2trt.exporters.tensorrt import engines as tensorrt_engines
    from seq2trt.exporters.tensorrt.build import BuildResult, NetworkInfo
    from seq2trt.exporters.tensorrt.engines import EngineRequest, build_engines
    from seq2trt.exporters.tensorrt import trt_compat

    info = NetworkInfo({}, {}, {}, 0, 0)
    monkeypatch.setattr(tensorrt_engines, "build", lambda path, *a, **k: BuildResult(
        path.read_bytes()[:64], info, 0.0, "1.7.1.116", (86,)))
    monkeypatch.setattr(trt_compat, "load", lambda flavour: None)
    return lambda out: build_engines(out, EngineRequest("tensorrt-rtx", (86,), force=True))
