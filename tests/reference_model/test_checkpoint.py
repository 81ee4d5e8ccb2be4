"""Checkpoint I/O: bit-exact round trips, `.pt` state dicts, and every bad file refused with one clear error."""

import os
import pickle

import pytest
import torch
from safetensors.torch import load_file, save_file

from seq2trt.reference_model import CheckpointError
from seq2trt.reference_model.checkpoint import load_checkpoint, save_checkpoint

from helpers.artifacts import numbers_model


@pytest.fixture
def saved(make_model, tmp_path):
    model, task = numbers_model(make_model, seed=0, tie_embeddings=True)
    return model, save_checkpoint(tmp_path / "ckpt", model, (task.source_vocab, task.target_vocab))


def test_round_trip_is_bit_exact(saved):
    model, path = saved
    loaded, vocabs = load_checkpoint(path)
    assert loaded.cfg == model.cfg and vocabs is not None
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    assert loaded.lm_head.weight.data_ptr() == loaded.tgt_embed.weight.data_ptr()


def test_existing_directory_is_not_overwritten(saved, make_model):
    _, path = saved
    before = (path / "model.safetensors").read_bytes()
    with pytest.raises(Exception, match="--force"):
        save_checkpoint(path, make_model(seed=9, dtype=torch.float32))
    assert (path / "model.safetensors").read_bytes() == before
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")], "a temporary directory was left"


@pytest.mark.parametrize("with_alias", [False, True])
def test_plain_pt_state_dict_loads(saved, with_alias):
    model, path = saved
    state = model.state_dict() if with_alias else {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    torch.save(state, path / "model.pt")
    os.remove(path / "model.safetensors")
    loaded, _ = load_checkpoint(path)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /tmp/seq2trt-pwned",))


def test_pickled_code_is_refused(saved):
    _, path = saved
    os.remove(path / "model.safetensors")
    with open(path / "model.pt", "wb") as f:
        pickle.dump({"weight": Evil()}, f)
    with pytest.raises(CheckpointError, match="pickled code"):
        load_checkpoint(path)
    assert not os.path.exists("/tmp/seq2trt-pwned")


def test_truncated_safetensors(saved):
    _, path = saved
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(path)


def test_every_problem_is_listed_at_once(saved):
    _, path = saved
    state = load_file(path / "model.safetensors")
    del state["encoder_layers.0.ffn.fc1.bias"]
    state["encoder_layers.1.ffn.fc2.weight"] = torch.zeros(3, 3)
    state["decoder_layers.0.extra"] = torch.zeros(1)
    save_file(state, path / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    text = str(err.value)
    assert "missing keys ['encoder_layers.0.ffn.fc1.bias']" in text
    assert "unexpected keys ['decoder_layers.0.extra']" in text
    assert "encoder_layers.1.ffn.fc2.weight: weights have shape (3, 3)" in text


def test_config_contradicting_weights(saved):
    _, path = saved
    cfg = (path / "config.json").read_text().replace('"d_ff": 64', '"d_ff": 128')
    (path / "config.json").write_text(cfg)
    with pytest.raises(CheckpointError, match=r"fc1.weight: weights have shape \(64, 32\), config expects \(128, 32\)"):
        load_checkpoint(path)


def test_missing_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "nope")


@pytest.mark.parametrize("key, value, message", [
    ("num_encoder_layers", 100000, "num_encoder_layers is 100000 but"),
    ("num_encoder_layers", 10 ** 9, "more than this machine's"),
    ("tgt_vocab_size", 10 ** 12, "src_vocab_size, tgt_vocab_size, d_model"),
], ids=["layers-the-weights-lack", "layers-beyond-memory", "vocabulary-beyond-memory"])
def test_sizes_are_checked_before_the_model_is_built(saved, monkeypatch, key, value, message):
    """Refused before any allocation (a config of 100,000 layers took minutes to build before it failed)."""
    import json

    from seq2trt.reference_model import checkpoint

    _, path = saved
    doc = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**doc, key: value}))
    monkeypatch.setattr(checkpoint, "physical_memory", lambda: 64 * 2**30)
    monkeypatch.setattr(checkpoint, "Seq2SeqTransformer", lambda cfg: pytest.fail("the model was built"))
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path)


def test_a_dicts_tensors_are_checked_and_copied_in_row_blocks(saved, monkeypatch):
    """A state dict's tensors (a Hugging Face source's, mapped from its file) are checked and copied a row block at a
    time, not whole (a 2 GB embedding's finiteness mask and pages): every block is copied, and a NaN in the last
    block of the embedding is still found."""
    from seq2trt.reference_model import checkpoint
    from seq2trt.reference_model.model import Seq2SeqTransformer

    model, _ = saved
    row_bytes = 4 * model.cfg.d_model
    monkeypatch.setattr(checkpoint, "BLOCK_BYTES", 3 * row_bytes)  # 3 rows a block
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    loaded = Seq2SeqTransformer(model.cfg)
    checkpoint.load_state_dict_checked(loaded, dict(state), "state")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    state["tgt_embed.weight"][-1, 0] = float("nan")
    with pytest.raises(CheckpointError, match=r"NaN or infinite weights in 1 tensor\(s\): tgt_embed.weight"):
        checkpoint.load_state_dict_checked(Seq2SeqTransformer(model.cfg), state, "state")
