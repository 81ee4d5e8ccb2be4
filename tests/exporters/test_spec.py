"""The graph contract: names, profiles, the parity sweep and the feed check."""

from __future__ import annotations

import numpy as np
import pytest

from seq2trt.exporters import spec
from seq2trt.reference_model import ConfigError, InputError, preset

CFG = preset("tiny", src_vocab_size=13, tgt_vocab_size=17)


def test_names_follow_optimum():
    dec_in = [s.name for s in spec.inputs(CFG, spec.GraphKind.DECODER)]
    assert dec_in[:4] == ["input_ids", "encoder_attention_mask", "past_key_values.0.encoder.key",
                          "past_key_values.0.encoder.value"]
    assert "past_key_values.1.decoder.value" in dec_in and len(dec_in) == 2 + 4 * CFG.num_decoder_layers
    enc_out = [s.name for s in spec.outputs(CFG, spec.GraphKind.ENCODER)]
    assert enc_out[0] == "encoder_hidden_states" and enc_out[-1] == "present.1.encoder.value"
    assert spec.present_to_past_name("present.1.encoder.key") == "past_key_values.1.encoder.key"
    assert spec.present_to_past_name("present.0.decoder.value") == "past_key_values.0.decoder.value"
    with pytest.raises(ValueError, match="not a present"):
        spec.present_to_past_name("past_key_values.0.decoder.value")


def test_kv_flatten_order_is_the_graphs():
    """Layer-major, key before value: the order of the graphs' KV inputs and outputs."""
    pairs = [("k0", "v0"), ("k1", "v1"), ("k2", "v2")]
    assert spec.flatten_kv(pairs) == ["k0", "v0", "k1", "v1", "k2", "v2"]
    assert spec.unflatten_kv(spec.flatten_kv(pairs)) == pairs
    with pytest.raises(ValueError, match="pairs"):
        spec.unflatten_kv(["k0", "v0", "k1"])
    dec_in = [s.name for s in spec.inputs(CFG, spec.GraphKind.DECODER)]
    assert dec_in[2:] == spec.kv_names(CFG, "encoder", "past") + spec.kv_names(CFG, "decoder", "past")
    assert spec.kv_names(CFG, "decoder", "present") == [f"present.{i}.decoder.{p}" for i in range(2)
                                                        for p in ("key", "value")]
    dec_out = [s.name for s in spec.outputs(CFG, spec.GraphKind.DECODER)]
    assert dec_out[1:] == spec.kv_names(CFG, "decoder", "present")


def test_kv_names_parse_and_map_onto_the_next_inputs():
    assert spec.parse_kv_name("present.3.encoder.value") == spec.KVName(3, "encoder", "value", "present")
    assert spec.parse_kv_name("past_key_values.0.decoder.key") == spec.KVName(0, "decoder", "key", "past")
    for other in ("logits", "input_ids", "present.x.decoder.key", "present.0.cross.key", "present.0.decoder.query"):
        assert spec.parse_kv_name(other) is None
    assert spec.present_to_past(CFG, "encoder") == {f"present.{i}.encoder.{p}": f"past_key_values.{i}.encoder.{p}"
                                                    for i in range(2) for p in ("key", "value")}
    outputs = {"logits": 0, "present.0.decoder.key": 1, "present.0.decoder.value": 2, "present.1.decoder.key": 3,
               "present.1.decoder.value": 4}
    assert spec.kv_feed(CFG, "decoder", outputs) == {"past_key_values.0.decoder.key": 1,
                                                    "past_key_values.0.decoder.value": 2,
                                                    "past_key_values.1.decoder.key": 3,
                                                    "past_key_values.1.decoder.value": 4}


def test_profiles_cover_a_zero_past_and_the_model_limits():
    limits = spec.Limits.for_model(CFG, max_batch=8)
    prof = spec.profiles(CFG, limits)[spec.GraphKind.DECODER]
    lo, opt, hi = prof["past_key_values.0.decoder.key"]
    assert lo == (1, CFG.num_heads, 0, CFG.head_dim) and hi == (8, CFG.num_heads, CFG.max_tgt_len - 1, CFG.head_dim)
    assert prof["input_ids"][1] == (min(8, 8), 1)  # opt: one new token
    assert spec.profiles(CFG, limits)[spec.GraphKind.ENCODER]["attention_mask"][2] == (8, CFG.max_src_len)


def test_limits_refuse_more_than_the_model_has():
    with pytest.raises(ConfigError, match="max_src_len"):
        spec.Limits.for_model(CFG, max_src_len=CFG.max_src_len + 1)
    with pytest.raises(ConfigError, match=">= 2"):
        spec.Limits(1, 8, 8)


def test_sweep_has_the_boundaries():
    limits = spec.Limits.for_model(CFG)
    cases = spec.sweep(limits)
    assert 1 in {c.batch for c in cases} and max(c.batch for c in cases) > 1
    assert {0, 1, CFG.max_tgt_len - 1} <= {c.past_len for c in cases}
    assert {1, CFG.max_src_len} <= {c.src_len for c in cases}
    assert any(c.padded for c in cases) and any(c.tgt_len > 1 and c.past_len == 0 for c in cases)
    assert all(c.past_len + c.tgt_len <= limits.max_tgt_len for c in cases)


def _feed(batch=2, src=5, tgt=1, past=3, dtype=np.float32):
    feed = {"input_ids": np.zeros((batch, tgt), np.int64), "encoder_attention_mask": np.ones((batch, src), np.int64)}
    for s in spec.inputs(CFG, spec.GraphKind.DECODER)[2:]:
        length = src if spec.parse_kv_name(s.name).side == "encoder" else past
        feed[s.name] = np.zeros((batch, CFG.num_heads, length, CFG.head_dim), dtype)
    return feed


def test_check_feed_accepts_the_contract_and_a_zero_past():
    limits = spec.Limits.for_model(CFG)
    spec.check_feed(CFG, spec.GraphKind.DECODER, "fp32", limits, _feed())
    spec.check_feed(CFG, spec.GraphKind.DECODER, "fp32", limits, _feed(past=0, batch=1))


def test_check_feed_lists_every_problem():
    limits = spec.Limits.for_model(CFG)
    feed = _feed(dtype=np.float64)
    del feed["input_ids"]
    feed["extra"] = np.zeros(1)
    feed["past_key_values.1.decoder.key"] = np.zeros((3, CFG.num_heads, 3, CFG.head_dim), np.float32)
    with pytest.raises(InputError) as err:
        spec.check_feed(CFG, spec.GraphKind.DECODER, "fp32", limits, feed)
    msg = str(err.value)
    for part in ("missing inputs ['input_ids']", "unexpected inputs ['extra']", "expected dtype float32",
                 "batch is 3"):
        assert part in msg


def test_check_feed_refuses_a_past_beyond_the_positions():
    limits = spec.Limits.for_model(CFG)
    with pytest.raises(InputError, match="exceeds max_tgt_len"):
        spec.check_feed(CFG, spec.GraphKind.DECODER, "fp32", limits, _feed(tgt=2, past=CFG.max_tgt_len - 1))
