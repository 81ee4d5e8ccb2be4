"""The tiny artifact both reliability files damage copies of: built once per test session of this folder."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from seq2trt.cli.main import cli
from seq2trt.exporters import spec
from seq2trt.reference_model.checkpoint import save_checkpoint
from seq2trt.reference_model.tasks import get_task

HAS_RTX = importlib.util.find_spec("tensorrt_rtx") is not None
ENGINES = "engines/tensorrt-rtx-sm_86-fp32"
MAX_BATCH, MAX_LEN = 4, 16


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


@pytest.fixture
def work(artifact, tmp_path) -> Path:
    """A private copy of the artifact (the manifest still names the module's checkpoint, read only)."""
    shutil.copytree(artifact, tmp_path / "w")
    return tmp_path / "w"
