import json

import pytest

from seq2trt.reference_model import PRESETS, ConfigError, Seq2SeqConfig, preset


def test_base_preset_is_the_paper():
    cfg = preset("base")
    assert (cfg.d_model, cfg.d_ff, cfg.num_heads, cfg.num_encoder_layers, cfg.num_decoder_layers) == (512, 2048, 8, 6, 6)
    assert cfg.head_dim == 64 and cfg.activation == "relu" and not cfg.pre_norm


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip_through_json(name, tmp_path):
    cfg = preset(name)
    cfg.save(tmp_path / "config.json")
    assert Seq2SeqConfig(**json.loads((tmp_path / "config.json").read_text())) == cfg


@pytest.mark.parametrize("overrides, message", [
    ({"d_model": 30, "num_heads": 4}, "divisible"),
    ({"dropout": 1.5}, "dropout"),
    ({"activation": "swish"}, "activation"),
    ({"num_encoder_layers": 0}, "num_encoder_layers"),
    ({"share_vocab": True, "src_vocab_size": 10, "tgt_vocab_size": 12}, "share_vocab"),
    ({"eos_id": 0}, "must differ"),
    ({"bos_id": 99, "tgt_vocab_size": 20}, "bos_id"),
    ({"max_new_tokens": 0}, r"max_new_tokens must be null or in \[1, 255\]"),
    ({"max_new_tokens": 256}, "max_new_tokens"),
    ({"max_new_tokens": "9"}, "max_new_tokens must be an integer or null"),
])
def test_invalid_values_raise(overrides, message):
    with pytest.raises(ConfigError, match=message):
        Seq2SeqConfig(**overrides)


def test_unknown_preset_and_key():
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("huge")
    with pytest.raises(ConfigError, match="unknown config keys"):
        Seq2SeqConfig.from_dict({"d_model": 8, "colour": "red"})
