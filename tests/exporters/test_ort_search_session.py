"""The ort-generate session's settings reach the subgraphs inside BeamSearch: ONNX Runtime's profiler, run on the
graph of a tiny export, names the kernels the decoder steps ran (runtime/ort_search.session_options)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from seq2trt.exporters import spec
from seq2trt.exporters.fuse import Target, fuse_artifacts
from seq2trt.exporters.ort_search import FILENAME, generate_artifacts, generate_dir
from seq2trt.exporters.onnx_export import export
from seq2trt.runtime.ort_search import session_options

ort = pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def graph(make_model, tmp_path_factory):
    model = make_model(seed=7, dtype=torch.float32)
    out = tmp_path_factory.mktemp("generate-session") / "out"
    export(model, out, limits=spec.Limits.for_model(model.cfg, max_batch=8))
    fuse_artifacts(out, Target.ORT)
    generate_artifacts(out)
    return generate_dir(out) / FILENAME, model.cfg


def _kernels(path, cfg, options, disabled, tmp_path) -> set[str]:
    options.enable_profiling, options.profile_file_prefix = True, str(tmp_path / "profile")
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"], disabled_optimizers=disabled)
    ids = np.array([[3, 4, 5, cfg.eos_id]], np.int32)
    session.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids), "max_length": np.array([6], np.int32),
                       "min_length": np.array([0], np.int32), "num_beams": np.array([2], np.int32),
                       "length_penalty": np.array([1.0], np.float32),
                       "repetition_penalty": np.array([1.0], np.float32),
                       "num_return_sequences": np.array([1], np.int32)})
    with open(session.end_profiling()) as f:
        events = json.load(f)
    return {e["args"]["op_name"] for e in events if e.get("cat") == "Node" and "op_name" in e.get("args", {})}


def test_the_subgraphs_run_layer_norm_unfused(graph, tmp_path):
    path, cfg = graph
    ran = _kernels(path, cfg, *session_options(ort, 1, int8=False), tmp_path)
    assert "BeamSearch" in ran and "LayerNormalization" in ran and "SkipLayerNormalization" not in ran


def test_the_default_level_would_fuse_skip_layer_norm(graph, tmp_path):
    """The control: without the settings, ONNX Runtime fuses Add + LayerNormalization in the subgraphs (if a later
    ONNX Runtime stops doing so, the setting and its docstring are stale)."""
    path, cfg = graph
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    assert "SkipLayerNormalization" in _kernels(path, cfg, options, [], tmp_path)
