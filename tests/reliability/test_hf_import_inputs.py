"""`seq2trt import hf` on damaged, absurd or hostile source directories: each is one `error:` line naming the file,
the key and the value (in the source's own key names, not ours), exit 2, and nothing written."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def machine_of_64_gib(monkeypatch):
    """The size checks against a machine of 64 GiB, whatever this one has: the absurd sizes below exceed it."""
    from seq2trt.hf_import import importer as hf_import

    monkeypatch.setattr(hf_import, "physical_memory", lambda: 64 * 2**30)


def _edit(name: str, **changes):
    """Set keys of a JSON file of the source (None: JSON null; the value `_NAN`: a bare NaN)."""
    def damage(src: Path) -> None:
        doc = json.loads((src / name).read_text()) if (src / name).exists() else {}
        doc.update(changes)
        (src / name).write_text(json.dumps(doc).replace('"__nan__"', "NaN"))
    return damage


_NAN = "__nan__"


def _sharded(weight_map_of):
    """The weights as a one-shard index whose weight_map is `weight_map_of(real weight map)`."""
    def damage(src: Path) -> None:
        from safetensors.torch import load_file

        keys = list(load_file(str(src / "model.safetensors")))
        (src / "model.safetensors").rename(src / "model-00001-of-00001.safetensors")
        real = {k: "model-00001-of-00001.safetensors" for k in keys}
        (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map_of(real)}))
    return damage


def _outside_shard(src: Path) -> None:
    _sharded(lambda real: {k: "../../x.safetensors" for k in real})(src)
    (src.parent.parent / "x.safetensors").write_bytes((src / "model-00001-of-00001.safetensors").read_bytes())


def _shard_is_directory(src: Path) -> None:
    _sharded(lambda real: {k: "shard" for k in real})(src)
    (src / "shard").mkdir()


def _second_shard(src: Path) -> None:
    """One tensor's entry names a shard (a copy of the first, without that tensor) that does not hold it."""
    from safetensors.torch import load_file, save_file

    key = "model.encoder.layers.0.fc1.weight"
    state = load_file(str(src / "model-00001-of-00001.safetensors"))
    save_file({k: v for k, v in state.items() if k != key}, str(src / "model-00002.safetensors"))
    _edit("model.safetensors.index.json")(src)
    doc = json.loads((src / "model.safetensors.index.json").read_text())
    doc["weight_map"][key] = "model-00002.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(doc))


def _weights_directory(src: Path) -> None:
    (src / "model.safetensors").unlink()
    (src / "model.safetensors").mkdir()


def _int_weight(src: Path) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(src / "model.safetensors"))
    key = "model.encoder.layers.0.fc1.weight"
    state[key] = state[key].to(torch.int32)
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})


def _config_loop(src: Path) -> None:
    (src / "config.json").unlink()
    (src / "config.json").symlink_to("config.json")


def _garbage_spm(src: Path) -> None:
    (src / "source.spm").write_bytes(b"\x00garbage" * 40)
    (src / "target.spm").write_bytes(b"\x00garbage" * 40)
    (src / "vocab.json").write_text(json.dumps({"</s>": 0, "<unk>": 1, "<pad>": 96}))


CASES = {  # name: (damage, fragments of the one error line)
    "vocab_size-abc": (_edit("config.json", vocab_size="abc"), ["config.json", "vocab_size", '"abc"']),
    "vocab_size-string": (_edit("config.json", vocab_size="1000"), ["config.json", "vocab_size", '"1000"']),
    "vocab_size-fraction": (_edit("config.json", vocab_size=1000.7), ["config.json", "vocab_size", "1000.7"]),
    "max_position_embeddings-null": (_edit("config.json", max_position_embeddings=None),
                                     ["config.json", "max_position_embeddings", "null"]),
    "max_position_embeddings-64x": (_edit("config.json", max_position_embeddings="64x"),
                                    ["config.json", "max_position_embeddings", '"64x"']),
    "max_position_embeddings-0": (_edit("config.json", max_position_embeddings=0),
                                  ["config.json", "max_position_embeddings", "0"]),
    "d_model-true": (_edit("config.json", d_model=True), ["config.json", "d_model", "true"]),
    "encoder_layers-100000": (_edit("config.json", encoder_layers=100000),
                              ["config.json", "encoder_layers", "100000", "2 encoder layers"]),
    "encoder_layers-1e9": (_edit("config.json", encoder_layers=10 ** 9),
                           ["config.json", "parameters", "memory", "encoder_layers"]),
    "vocab_size-1e12": (_edit("config.json", vocab_size=10 ** 12), ["config.json", "memory", "vocab_size"]),
    "max_position_embeddings-1e9": (_edit("config.json", max_position_embeddings=10 ** 9),
                                    ["config.json", "memory", "max_position_embeddings"]),
    "num_beams-four": (_edit("generation_config.json", num_beams="four"),
                       ["generation_config.json", "num_beams", '"four"']),
    "num_beams-negative": (_edit("generation_config.json", num_beams=-3), ["generation_config.json", "num_beams", "-3"]),
    "num_beams-1e6": (_edit("generation_config.json", num_beams=10 ** 6),
                      ["generation_config.json", "num_beams", "1000000", "memory"]),
    "length_penalty-x": (_edit("generation_config.json", length_penalty="x"),
                         ["generation_config.json", "length_penalty", '"x"']),
    "length_penalty-nan": (_edit("generation_config.json", length_penalty=_NAN),
                           ["generation_config.json", "length_penalty", "NaN"]),
    "max_length-0": (_edit("generation_config.json", max_length=0), ["generation_config.json", "max_length", "0"]),
    "max_length-negative": (_edit("generation_config.json", max_length=-5),
                            ["generation_config.json", "max_length", "-5"]),
    "max_length-string": (_edit("generation_config.json", max_length="20"),
                          ["generation_config.json", "max_length", '"20"']),
    "max_new_tokens-0": (_edit("generation_config.json", max_new_tokens=0),
                         ["generation_config.json", "max_new_tokens", "0"]),
    "early_stopping-maybe": (_edit("generation_config.json", early_stopping="maybe"),
                             ["generation_config.json", "early_stopping", '"maybe"']),
    "decoder_start_token_id-5000": (_edit("generation_config.json", decoder_start_token_id=5000),
                                    ["generation_config.json", "decoder_start_token_id", "5000", "vocab_size 97"]),
    "pad_token_id-string": (_edit("config.json", pad_token_id="1"), ["config.json", "pad_token_id", '"1"']),
    "forced_bos_token_id-5000": (_edit("generation_config.json", forced_bos_token_id=5000),
                                 ["generation_config.json", "forced_bos_token_id", "5000"]),
    "suppress_tokens-string": (_edit("generation_config.json", suppress_tokens="5"),
                               ["generation_config.json", "suppress_tokens", '"5"']),
    "suppress_tokens-out-of-range": (_edit("generation_config.json", suppress_tokens=[500]),
                                     ["generation_config.json", "suppress_tokens", "500"]),
    "bad_words_ids-out-of-range": (_edit("generation_config.json", bad_words_ids=[[500]]),
                                   ["generation_config.json", "bad_words_ids", "500"]),
    "length_penalty-overflow": (_edit("generation_config.json", length_penalty=10 ** 12),
                                ["generation_config.json", "length_penalty", "1000000000000", "overflows"]),
    "activation_dropout-huge": (_edit("config.json", activation_dropout=1e308),
                                ["config.json", "activation_dropout", "1e+308"]),
    "index-metadata-list": (lambda src: (_sharded(lambda real: real)(src), _edit(
        "model.safetensors.index.json", metadata=["a"])(src)), ["model.safetensors.index.json", "metadata"]),
    "weight_map-wrong-shard": (lambda src: (_sharded(lambda real: real)(src), _second_shard(src)),
                               ["model.safetensors.index.json", "model.encoder.layers.0.fc1.weight", "does not hold"]),
    "weight_map-list": (_sharded(lambda real: list(real)), ["model.safetensors.index.json", "weight_map"]),
    "weight_map-null": (_sharded(lambda real: {**real, next(iter(real)): None}),
                        ["model.safetensors.index.json", "weight_map", "null"]),
    "shard-outside": (_outside_shard, ["model.safetensors.index.json", "../../x.safetensors", "outside"]),
    "shard-directory": (_shard_is_directory, ["shard", "is a directory"]),
    "weights-directory": (_weights_directory, ["model.safetensors", "is a directory"]),
    "weight-int32": (_int_weight, ["model.safetensors", "encoder.layers.0.fc1.weight", "int32"]),
    "config-symlink-loop": (_config_loop, ["config.json", "symlink"]),
    "garbage-spm": (_garbage_spm, ["tokenizer", "source.spm"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_source_is_one_error_line_and_nothing_is_written(case, make_hf_model, invoke, one_error_line, tmp_path):
    damage, fragments = CASES[case]
    family = "marian" if case == "garbage-spm" else "bart"
    src = make_hf_model(tmp_path / "a" / "src", family)
    damage(src)
    line = one_error_line(invoke("import", "hf", src, "-o", tmp_path / "ckpt"), 2, *fragments)
    assert not any(word in line for word in ("bos_id", "suppress_ids", "max_src_len", "max_tgt_len")), line
    assert not (tmp_path / "ckpt").exists() and not list(tmp_path.glob(".ckpt*"))


def test_a_source_that_is_a_symlink_loop(invoke, one_error_line, tmp_path):
    (tmp_path / "src").symlink_to("src")
    one_error_line(invoke("import", "hf", tmp_path / "src", "-o", tmp_path / "ckpt"), 2, str(tmp_path / "src"),
                   "symlink")
    assert not (tmp_path / "ckpt").exists()


def test_a_tokenizer_with_ids_beyond_the_vocabulary_is_refused(make_hf_model, make_marian_tokenizer, invoke,
                                                              one_error_line, tmp_path):
    """Ids the model cannot embed would make every text holding them fail at translate (transformers' own model
    raises an IndexError on them): the import refuses the pair."""
    src = make_hf_model(tmp_path / "src", "marian", dict(vocab_size=60, pad_token_id=59, decoder_start_token_id=59))
    make_marian_tokenizer(src, 80)
    one_error_line(invoke("import", "hf", src, "-o", tmp_path / "ckpt"), 2, "tokenizer", "up to 78", "vocab_size 60")
    assert not (tmp_path / "ckpt").exists()


def test_import_onto_a_full_disk_is_the_usual_write_error(make_hf_model, invoke, one_error_line, tmp_path,
                                                          monkeypatch):
    """safetensors reports ENOSPC as its own SafetensorError (text as safetensors 0.8 writes it on a full tmpfs)."""
    import safetensors.torch
    from safetensors import SafetensorError

    def full(*args, **kwargs):
        raise SafetensorError(f"Error while serializing: I/O error: {os.strerror(errno.ENOSPC)} (os error 28)")

    src = make_hf_model(tmp_path / "src", "bart")
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    one_error_line(invoke("import", "hf", src, "-o", tmp_path / "ckpt"), 2, "cannot write",
                   str(tmp_path / "ckpt" / "model.safetensors"), "no space left", "free some space")
    assert not (tmp_path / "ckpt").exists() and not list(tmp_path.glob(".ckpt*"))
