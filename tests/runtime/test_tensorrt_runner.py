"""The TensorRT runner: profile checks and clear refusals on CPU; engines run against ONNX Runtime on a GPU."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from seq2trt.exporters import spec
from seq2trt.core.errors import DependencyError
from seq2trt.runtime.tensorrt_runner import TensorRTRunner, profile_problems

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
@pytest.mark.parametrize("graph", list(spec.GraphKind))
@pytest.mark.parametrize("plugin", [False, True])
def test_engine_matches_onnxruntime(tmp_path, monkeypatch, make_model, graph, plugin):
    """Unfused engines, and fused engines whose attention runs the AOT-compiled kernels through the plugin, within
    the project's fp32 target (validation.parity.TOLERANCES["fp32"]: atol = rtol = 1e-4) of ONNX Runtime, TF32 off,
    on a padded batch (rows 1 and 2 lose 4 and 7 of 9 source tokens) so the key-padding path is compared too."""
    from seq2trt.exporters.fuse import Target, fuse_artifacts
    from seq2trt.exporters.onnx_export import export
    from seq2trt.exporters.tensorrt.engines import EngineRequest, build_engines
    from seq2trt.runtime.runners import OrtRunner
    from seq2trt.exporters.tensorrt.build import BuildSettings
    from seq2trt.validation.parity import TOLERANCES
    from seq2trt.runtime.tensorrt_runner import runner_for

    assert not BuildSettings().allow_tf32  # the builder clears TensorRT's TF32 flag for fp32 graphs
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")  # and no library below it may use TF32 either
    model = make_model(dtype=torch.float32, d_model=64, num_heads=2)  # head_dim 32: a size the kernels take
    limits = spec.Limits(4, 16, 16)
    out = export(model, tmp_path / "art", dtype="fp32", limits=limits)
    if plugin:
        from seq2trt.plugins import cuda_launcher as kernel_launch
        from seq2trt.plugins.kernels import aot

        major, minor = torch.cuda.get_device_capability()
        monkeypatch.setenv("SEQ2TRT_KERNEL_DIR", str(tmp_path / "kernels"))
        aot.compile_all(tmp_path / "kernels", [f"sm_{10 * major + minor}"],
                        [v for v in aot.all_variants() if v.dtype == "fp32"])
        kernel_launch.default_launcher.cache_clear()
        fuse_artifacts(out, Target.TRT)
    engine_dir = build_engines(out, EngineRequest("tensorrt-rtx", ("current",), plugin=plugin))
    rng = np.random.default_rng(0)
    B, S, T, P = 3, 9, 2, 5
    mask = np.ones((B, S), dtype=np.int64)
    mask[1, 5:] = 0
    mask[2, 2:] = 0
    feed = {"input_ids": rng.integers(3, model.cfg.src_vocab_size, (B, S if graph is spec.GraphKind.ENCODER else T)),
            "attention_mask" if graph is spec.GraphKind.ENCODER else "encoder_attention_mask": mask}
    if graph is spec.GraphKind.DECODER:
        for s in spec.inputs(model.cfg, graph)[2:]:
            length = S if spec.parse_kv_name(s.name).side == "encoder" else P
            feed[s.name] = rng.standard_normal((B, model.cfg.num_heads, length, model.cfg.head_dim)).astype(np.float32)
    with OrtRunner(out / graph.filename, model.cfg, graph, "fp32", limits) as ort, \
            runner_for(engine_dir, graph, model.cfg) as trt:
        want, got = ort.infer(feed), trt.infer(feed)
    assert set(got) == set(want)
    target = TOLERANCES["fp32"]["*"]
    assert (target.atol, target.rtol) == (1e-4, 1e-4)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], atol=target.atol, rtol=target.rtol, err_msg=name)
