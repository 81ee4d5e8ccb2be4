"""Runners: feeds are checked against the spec, and the decoding loops of reference_model run unchanged on
ONNX Runtime, giving the tokens of the (independent) eager StepModel."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from seq2trt.exporters import spec
from seq2trt.exporters.manifest import verify
from seq2trt.exporters.onnx_export import export
from seq2trt.reference_model.decoding import DecodeSettings, beam_search, greedy_decode
from seq2trt.reference_model.eager import EagerStepModel
from seq2trt.reference_model.errors import InputError
from seq2trt.reference_model.vocab import pad_batch
from seq2trt.validation.adapter import RunnerStepModel
from seq2trt.validation.end_to_end import PairedStepModel, end_to_end
from seq2trt.validation.runners import EagerRunner, OrtRunner


@pytest.fixture(scope="module")
def setup(make_model, tmp_path_factory):
    model = make_model(seed=2, dtype=torch.float32)
    out = export(model, tmp_path_factory.mktemp("export") / "out")
    manifest = verify(out)
    runners = tuple(OrtRunner(out / k.filename, model.cfg, k, "fp32", manifest.limits) for k in spec.GraphKind)
    for r in runners:
        r.__enter__()
    yield model, runners
    for r in runners:
        r.__exit__(None, None, None)


def _sources(cfg, n, seed=0):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(3, cfg.src_vocab_size, size=int(rng.integers(1, 12)))) + [cfg.eos_id] for _ in range(n)]


def test_feed_is_checked_against_the_spec(setup):
    model, (encoder, decoder) = setup
    ok = {"input_ids": np.ones((2, 3), np.int64), "attention_mask": np.ones((2, 3), np.int64)}
    assert encoder.infer(ok)["encoder_hidden_states"].shape == (2, 3, model.cfg.d_model)
    assert encoder.last_inference_time is not None and encoder.last_inference_time > 0
    assert set(encoder.input_metadata()) == {"input_ids", "attention_mask"}
    with pytest.raises(InputError, match="expected dtype int64"):
        encoder.infer({**ok, "attention_mask": np.ones((2, 3), np.int32)})
    with pytest.raises(InputError, match="missing inputs"):
        decoder.infer(ok)


def test_runner_must_be_active(setup, tmp_path):
    model, (encoder, _) = setup
    idle = OrtRunner(b"", model.cfg, spec.GraphKind.ENCODER, "fp32", encoder.limits)
    with pytest.raises(RuntimeError, match="not active"):
        idle.infer({})


def test_greedy_and_beam_on_ort_give_the_eager_tokens(setup):
    model, runners = setup
    cfg = model.cfg
    settings = DecodeSettings(cfg.bos_id, cfg.eos_id, cfg.pad_id, 12)
    ids, mask = pad_batch(_sources(cfg, 12), cfg.pad_id)
    ort_model, eager = RunnerStepModel(*runners), EagerStepModel(model)
    want = greedy_decode(eager, ids, mask, settings)
    assert greedy_decode(ort_model, ids, mask, settings) == want
    assert len({tuple(w) for w in want}) > 3  # the model says different things to different sources
    ids, mask = ids[:8], mask[:8]  # 8 sources x 3 beams stay within the export's max_batch
    assert beam_search(ort_model, ids, mask, settings, beam_size=3) == beam_search(eager, ids, mask, settings, 3)


def test_paired_decoding_measures_logit_error_along_the_reference_path(setup):
    model, runners = setup
    cfg = model.cfg
    settings = DecodeSettings(cfg.bos_id, cfg.eos_id, cfg.pad_id, 8)
    reference = EagerStepModel(model)
    result = end_to_end(RunnerStepModel(*runners), reference, _sources(cfg, 6, seed=1), settings, "fp32",
                        beam_size=2, batch_size=4)
    assert result, result.failures()
    assert 0 < result.max_logit_abs_err < 1e-4
    assert result.token_agreement == 1.0 and result.to_dict()["sequence_match"] == 1.0
    paired = PairedStepModel(reference, reference)
    ids, mask = pad_batch(_sources(cfg, 3), cfg.pad_id)
    assert greedy_decode(paired, ids, mask, settings) == greedy_decode(reference, ids, mask, settings)
    assert paired.max_abs_err == 0.0 and paired.steps > 0


def test_eager_runner_replays_narrow_inputs_in_float64(setup):
    model, _ = setup
    runner = EagerRunner(lambda: model.double(), spec.GraphKind.ENCODER)
    with runner:
        out = runner.infer({"input_ids": np.full((1, 4), 5, np.int64), "attention_mask": np.ones((1, 4), np.int64)})
    assert out["encoder_hidden_states"].dtype == np.float64
