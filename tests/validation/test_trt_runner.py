"""The TensorRT runner: profile checks and clear refusals on CPU; engines run against ONNX Runtime on a GPU."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from seq2trt.exporters import spec
from seq2trt.reference_model.errors import DependencyError
from seq2trt.validation.trt_runner import TensorRTRunner, profile_problems

HAS_RTX = importlib.util.find_spec("tensorrt_rtx") is not None


def test_profile_problems_name_the_limits():
    profile = {"input_ids": ((1, 1), (8, 1), (4, 32)), "mask": ((1, 1), (2, 2), (4, 32))}
    assert profile_problems({"input_ids": (4, 32), "mask": (1, 1)}, profile) == []
    problems = profile_problems({"input_ids": (5, 3), "mask": (2, 33, 1)}, profile)
    assert problems == ["input_ids (5, 3) is outside the engine's profile [(1, 1), (4, 32)]",
                        "mask (2, 33, 1) is outside the engine's profile [(1, 1), (4, 32)]"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_activation_without_gpu_says_so(make_model):
    model = make_model()
    runner = TensorRTRunner(b"", model.cfg, spec.GraphKind.ENCODER, "fp32", spec.Limits(2, 8, 8))
    with pytest.raises(DependencyError, match="NVIDIA GPU"):
        runner.__enter__()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(not HAS_RTX, reason="tensorrt_rtx is not installed (pip install 'seq2trt[rtx]')")
@pytest.mark.parametrize("kind", list(spec.GraphKind))
def test_engine_matches_onnxruntime(tmp_path, make_model, kind):
    from seq2trt.exporters.onnx_export import export
    from seq2trt.exporters.tensorrt_engines import EngineRequest, build_engines
    from seq2trt.validation.runners import OrtRunner
    from seq2trt.validation.trt_runner import runner_for

    model = make_model(dtype=torch.float32)
    limits = spec.Limits(4, 16, 16)
    out = export(model, tmp_path / "art", dtype="fp32", limits=limits)
    engine_dir = build_engines(out, EngineRequest("tensorrt-rtx", ("current",), plugin=False))
    rng = np.random.default_rng(0)
    B, S, T, P = 3, 9, 2, 5
    feed = {"input_ids": rng.integers(3, model.cfg.src_vocab_size, (B, S if kind is spec.GraphKind.ENCODER else T)),
            "attention_mask" if kind is spec.GraphKind.ENCODER else "encoder_attention_mask":
                np.ones((B, S), dtype=np.int64)}
    if kind is spec.GraphKind.DECODER:
        for s in spec.inputs(model.cfg, kind)[2:]:
            length = S if ".encoder." in s.name else P
            feed[s.name] = rng.standard_normal((B, model.cfg.num_heads, length, model.cfg.head_dim)).astype(np.float32)
    with OrtRunner(out / kind.filename, model.cfg, kind, "fp32", limits) as ort, \
            runner_for(engine_dir, kind, model.cfg) as trt:
        want, got = ort.infer(feed), trt.infer(feed)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], atol=2e-3, rtol=2e-3, err_msg=name)
