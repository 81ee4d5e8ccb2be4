"""Every architecture option of Seq2SeqConfig through the pipeline: the cached decoder equals a full recompute in
float64, and the exported, fused (both targets) graphs match the float64 eager model over the spec's sweep and
decode its tokens (`validate`). The Hugging Face families' options are also judged by transformers in
tests/hf_import/test_hf_import.py; `bias=False` (the tutorials' model) has no outside implementation."""

from __future__ import annotations

import pytest
import torch

from seq2trt.reference_model.checkpoint import save_checkpoint
from seq2trt.reference_model.decoding import DecodeSettings, greedy_decode
from seq2trt.reference_model.eager import EagerStepModel, RecomputeStepModel
from seq2trt.reference_model.vocab import pad_batch

from helpers.cli import invoke

VARIANTS = {
    "no-bias": dict(bias=False),
    "bart-like": dict(positions="learned", position_offset=2, embed_norm=True, logits_bias=True, activation="gelu"),
    "mbart-like-no-bias": dict(positions="learned", position_offset=2, embed_norm=True, pre_norm=True,
                               activation="gelu_tanh", bias=False),
    "marian-like": dict(positions="sinusoid_halves", logits_bias=True, activation="silu", share_vocab=True,
                        src_vocab_size=17, bos_id=0, forced_eos=True, suppress_ids=(0,)),
    "m2m-like": dict(positions="sinusoid_fairseq", position_offset=1, pad_position_zero=True, pre_norm=True,
                     forced_bos_id=5),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cached_decoding_equals_recompute(variant, make_model):
    model = make_model(seed=2, **VARIANTS[variant])
    ids, mask = pad_batch([[3, 4, 5, 2], [6, 7, 2], [8, 9, 10, 11, 12, 2]], model.cfg.pad_id)
    settings = DecodeSettings.for_model(model.cfg, 12)
    cached = greedy_decode(EagerStepModel(model), ids, mask, settings)
    assert cached == greedy_decode(RecomputeStepModel(model), ids, mask, settings)
    if model.cfg.forced_bos_id is not None:
        assert all(row[0] == model.cfg.forced_bos_id for row in cached)
    if model.cfg.suppress_ids:
        assert not set(model.cfg.suppress_ids) & {t for row in cached for t in row}


def test_a_pad_token_reads_no_position_only_when_configured(make_model):
    for zero in (False, True):
        model = make_model(seed=2, positions="sinusoid_fairseq", position_offset=1, pad_position_zero=zero)
        ids = torch.tensor([[3, model.cfg.pad_id]])
        embedded = model.embed(ids, decoder=True)
        plain = model.tgt_embed(ids) * model.embed_scale
        pad_position = (embedded - plain)[0, 1]
        assert torch.equal(pad_position, torch.zeros_like(pad_position)) == zero
        assert not torch.equal((embedded - plain)[0, 0], torch.zeros_like(pad_position))


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_exports_fuses_and_validates(variant, make_model, tmp_path):
    model = make_model(seed=2, dtype=torch.float32, **VARIANTS[variant])
    save_checkpoint(tmp_path / "ckpt", model)
    out = tmp_path / "out"
    for args in (["export", tmp_path / "ckpt", "-o", out, "--max-batch", 4], ["fuse", out, "--target", "ort"],
                 ["fuse", out, "--target", "trt"]):
        result = invoke(*args)
        assert result.exit_code == 0, result.output
    # The plugin graphs (the op's PyTorch reference as a Python op on CPU) end to end only where the variant reaches
    # the attention op (projections without bias); positions, norms and activations are the ORT graphs' too.
    for graphs in ("plain", "fused-ort", "fused-trt"):
        samples = 0 if graphs == "fused-trt" and VARIANTS[variant].get("bias", True) else 16
        result = invoke("validate", out, "--graphs", graphs, "--samples", samples)
        assert result.exit_code == 0 and "parity passed" in result.output, result.output
