"""`fuse --target trt` refuses a model whose head_dim the plugin's kernels do not take (a multiple of 8 up to 256),
naming the head_dim and both ways around it; nothing is written, and the ONNX Runtime target still fuses it."""

from __future__ import annotations

import pytest
import torch

from seq2trt.exporters.fuse import Target, fuse_artifacts, fused_dir
from seq2trt.exporters.onnx_export import export
from seq2trt.core.errors import InputError

from helpers.cli import invoke


@pytest.mark.parametrize("head_dim,heads", [(12, 2), (264, 1)])
def test_fuse_for_tensorrt_refuses_a_head_dim_the_kernels_do_not_take(make_model, tmp_path, head_dim, heads):
    model = make_model(seed=0, dtype=torch.float32, d_model=head_dim * heads, num_heads=heads, d_ff=16,
                       num_encoder_layers=1, num_decoder_layers=1)
    assert model.cfg.head_dim == head_dim
    out = export(model, tmp_path / "out")
    with pytest.raises(InputError, match=rf"head_dim a multiple of 8 up to 256; this model's is {head_dim};") as e:
        fuse_artifacts(out, Target.TRT)
    assert "--no-plugin" in str(e.value) and "--target ort" in str(e.value)
    assert not fused_dir(out, Target.TRT).exists() and not any(fused_dir(out, Target.TRT).parent.glob("*"))
    result = invoke("fuse", out)
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert f"this model's is {head_dim}" in result.output and "--target ort" in result.output
    if head_dim == 12:
        assert fuse_artifacts(out, Target.ORT).complete  # the way around it that needs no kernels
