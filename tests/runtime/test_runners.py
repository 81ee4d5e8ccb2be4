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
from seq2trt.core.errors import InputError
from seq2trt.reference_model.sources import ordinary_ids
from seq2trt.reference_model.vocab import pad_batch
from seq2trt.runtime.step_model import RunnerStepModel
from seq2trt.validation.end_to_end import PairedStepModel, end_to_end
from seq2trt.runtime.runners import EagerRunner, OrtRunner

from helpers.sources import random_sources


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
    ids, mask = pad_batch(random_sources(cfg, 12), cfg.pad_id)
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
    result = end_to_end(RunnerStepModel(*runners), reference, random_sources(cfg, 6, seed=1), settings, "fp32",
                        beam_size=2, batch_size=4)
    assert result, result.failures()
    assert 0 < result.max_logit_abs_err < 1e-4
    assert result.token_agreement == 1.0 and result.to_dict()["sequence_match"] == 1.0
    paired = PairedStepModel(reference, reference)
    ids, mask = pad_batch(random_sources(cfg, 3), cfg.pad_id)
    assert greedy_decode(paired, ids, mask, settings) == greedy_decode(reference, ids, mask, settings)
    assert paired.max_abs_err == 0.0 and paired.steps > 0


@pytest.mark.parametrize("narrow", [np.float16, np.float32])
def test_eager_runner_replays_narrow_inputs_in_float64(setup, narrow):
    """Float feeds of a narrow dtype (the decoder's past K/V, rounded to the graph's dtype) are replayed exactly in
    float64: the runner's outputs equal the float64 model's own decode_step on the same values, bit for bit (a
    runner computing in float32, or rounding a float32 feed to float16, differs)."""
    import copy

    model, _ = setup
    reference = copy.deepcopy(model).double()
    cfg, rng = model.cfg, np.random.default_rng(0)
    B, S, T, P = 2, 5, 2, 3
    tgt_ids = ordinary_ids(cfg, cfg.tgt_vocab_size)
    feed = {"input_ids": tgt_ids[rng.integers(0, tgt_ids.size, (B, T))],
            "encoder_attention_mask": np.ones((B, S), np.int64)}
    for s in spec.inputs(cfg, spec.GraphKind.DECODER)[2:]:
        length = S if spec.parse_kv_name(s.name).side == "encoder" else P
        feed[s.name] = rng.standard_normal((B, cfg.num_heads, length, cfg.head_dim)).astype(narrow)
    with EagerRunner(lambda: copy.deepcopy(reference), spec.GraphKind.DECODER) as runner:
        out = runner.infer(feed)
    t = {k: torch.from_numpy(v.astype(np.int64 if v.dtype.kind == "i" else np.float64)) for k, v in feed.items()}
    kv = lambda side: [(t[spec.kv_name(i, side, "key", "past")], t[spec.kv_name(i, side, "value", "past")])
                       for i in range(cfg.num_decoder_layers)]
    with torch.no_grad():
        logits, present = reference.decode_step(t["input_ids"], t["encoder_attention_mask"], kv("encoder"), kv("decoder"))
    assert out["logits"].dtype == np.float64
    np.testing.assert_array_equal(out["logits"], logits.numpy())
    np.testing.assert_array_equal(out[spec.kv_name(0, "decoder", "key", "present")], present[0][0].numpy())


_THREADS_SCRIPT = """
import json, logging, sys
from seq2trt.exporters import spec
from seq2trt.exporters.manifest import verify
from seq2trt.reference_model.decoding import DecodeSettings, greedy_decode
from seq2trt.reference_model.vocab import pad_batch
from seq2trt.runtime.step_model import RunnerStepModel
from seq2trt.runtime.runners import OrtRunner

logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
out, sources = sys.argv[1], json.loads(sys.argv[2])
manifest = verify(out)
cfg = manifest.config
ids, mask = pad_batch(sources, cfg.pad_id)
settings = DecodeSettings(cfg.bos_id, cfg.eos_id, cfg.pad_id, 8)
result = []
for threads in (1, 2, 1, 3):
    pair = [OrtRunner(f"{out}/{k.filename}", cfg, k, "fp32", manifest.limits, intra_op_threads=threads)
            for k in spec.GraphKind]
    with pair[0], pair[1]:
        result.append([pair[0].threading, pair[1].threading, greedy_decode(RunnerStepModel(*pair), ids, mask, settings)])
print(json.dumps(result))
"""


def test_thread_policy_shares_one_pool_and_keeps_results(setup):
    """One thread: a session of its own. More: one spinning pool shared by every session of the process, created
    once; ONNX Runtime then refuses private pools, so later sessions join it (a warning when they asked for
    another size). The tokens never depend on the threading. In a child process: the pool is process-wide."""
    import json
    import subprocess
    import sys

    model, (encoder, _) = setup
    out = str(encoder._source.parent)
    sources = random_sources(model.cfg, 6, seed=5)
    run = subprocess.run([sys.executable, "-c", _THREADS_SCRIPT, out, json.dumps(sources)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout)
    shared = "shared spinning pool of 2 threads"
    assert [r[:2] for r in result] == [["1 thread"] * 2, [shared] * 2, [shared] * 2, [shared] * 2]
    assert all(r[2] == result[0][2] for r in result)
    assert run.stderr.count("allows one thread pool per process") == 4  # the pairs that asked for 1 and 3
    ids, mask = pad_batch(sources, model.cfg.pad_id)
    settings = DecodeSettings(model.cfg.bos_id, model.cfg.eos_id, model.cfg.pad_id, 8)
    assert result[0][2] == greedy_decode(EagerStepModel(model), ids, mask, settings)
