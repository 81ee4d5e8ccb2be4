"""TensorRT-RTX engines (built for real on CPU) from a Whisper export: the encoder engine takes `input_features`
(the conv front end inside it, batch its only dynamic axis), every attention block is one plugin layer, and the
decoder's encoder length is the fixed 1500 positions in every profile."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None,
                                reason="tensorrt_rtx is not installed (pip install 'seq2trt[rtx]')")
pytest.importorskip("transformers", reason="the hf extra is not installed")


@pytest.mark.parametrize("dtype", ["fp16"])
def test_whisper_engines_build_with_the_plugin(tmp_path, dtype):
    from seq2trt.exporters import spec
    from seq2trt.exporters.fuse import Target, fuse_artifacts
    from seq2trt.exporters.onnx_export import export
    from seq2trt.exporters.tensorrt.engines import EngineRequest, build_engines, read_build
    from seq2trt.reference_model.checkpoint import load_checkpoint, source_record

    from helpers.audio import whisper_checkpoint
    from helpers.hf_models import whisper_model_dir

    ckpt = whisper_checkpoint(whisper_model_dir(tmp_path / "hf"), tmp_path / "ckpt")
    model, _ = load_checkpoint(ckpt)
    cfg = model.cfg
    out = export(model, tmp_path / "out", dtype=dtype, limits=spec.Limits.for_model(cfg, max_batch=2, max_tgt_len=32),
                 source=source_record(ckpt))
    fuse_artifacts(out, Target.TRT)
    engine_dir = build_engines(out, EngineRequest("tensorrt-rtx", (86,)))
    info = read_build(engine_dir)
    assert info["dtype"] == dtype and info["plugin"]["layers"] == {"encoder": cfg.num_encoder_layers,
                                                                   "decoder": 2 * cfg.num_decoder_layers}
    encoder, decoder = info["graphs"]["encoder"], info["graphs"]["decoder"]
    frames = [cfg.n_mels, 2 * cfg.max_src_len]
    assert encoder["profiles"] == {"input_features": [[1, *frames], [2, *frames], [2, *frames]]}
    assert {tuple(s) for s in decoder["profiles"]["encoder_attention_mask"]} == {(1, 1500), (2, 1500)}
    assert {s[2] for s in decoder["profiles"]["past_key_values.1.encoder.value"]} == {cfg.max_src_len}
    for graph in info["graphs"].values():
        assert graph["plan_bytes"] == (engine_dir / graph["plan"]).stat().st_size > 10_000
        assert graph["source"].startswith("fused/trt/")
