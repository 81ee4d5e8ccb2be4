"""The family adapters' registry: a new Hugging Face family is one registered adapter. A throwaway family (BART's
model under another model_type, registered with transformers too so that it stays the judge) is refused until its
adapter is registered, then imports and decodes as transformers' own generate does."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("transformers", reason="the hf extra is not installed")

from seq2trt.cli.main import cli  # noqa: E402
from seq2trt.reference_model.checkpoint import load_checkpoint  # noqa: E402
from seq2trt.reference_model.decoding import DecodeSettings, greedy_decode  # noqa: E402
from seq2trt.reference_model.eager import EagerStepModel  # noqa: E402
from seq2trt.hf_import.families import COMMON_TOKENIZER_FILES, FAMILIES, register  # noqa: E402
from seq2trt.hf_import.families.bart_like import (EMBED_NORMS, LAYER_RENAMES, LEARNED_POSITIONS,  # noqa: E402
                                                           BartLikeAdapter)
from seq2trt.hf_import.proof import load_transformers_model, seeded_sources  # noqa: E402
from seq2trt.reference_model.vocab import pad_batch  # noqa: E402

TYPE = "plain_bart"


@pytest.fixture(scope="module")
def transformers_knows_the_type():
    """transformers' BART classes under the throwaway model_type, so that AutoModelForSeq2SeqLM loads it."""
    import transformers

    config_class = type("PlainBartConfig", (transformers.BartConfig,), {"model_type": TYPE})
    model_class = type("PlainBartForConditionalGeneration", (transformers.BartForConditionalGeneration,),
                       {"config_class": config_class})
    transformers.AutoConfig.register(TYPE, config_class, exist_ok=True)
    transformers.AutoModelForSeq2SeqLM.register(config_class, model_class, exist_ok=True)


@pytest.fixture
def registered():
    """`register` for the test: the adapters it registers are gone from the registry after it."""
    types = []

    def add(cls):
        types.append(register(cls).model_type)
    yield add
    for name in types:
        FAMILIES.pop(name, None)


def _source(make_hf_model, path):
    src = make_hf_model(path, "bart", dict(activation_function="relu", scale_embedding=True))
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "model_type": TYPE}))
    return src


def _adapter(**architecture):
    """The bart adapter's copy (what bart.py declares) under TYPE; `architecture` overrides its fields."""
    class PlainBartAdapter(BartLikeAdapter):
        model_type = TYPE
        title = "plain BART"
        renames = LAYER_RENAMES + EMBED_NORMS + LEARNED_POSITIONS
        tokenizer_files = COMMON_TOKENIZER_FILES + ("vocab.json", "merges.txt")

    PlainBartAdapter.architecture = {**dict(positions="learned", position_offset=2, embed_norm=True, pre_norm=False,
                                            logits_bias=True), **architecture}
    return PlainBartAdapter


def test_a_registered_adapter_imports_a_new_family(transformers_knows_the_type, registered, make_hf_model, tmp_path):
    src = _source(make_hf_model, tmp_path / "src")
    refused = CliRunner().invoke(cli, ["import", "hf", str(src), "-o", str(tmp_path / "a")])
    assert refused.exit_code == 2 and f"'{TYPE}' model" in refused.output
    assert "marian, bart, mbart, m2m_100" in refused.output and not (tmp_path / "a").exists()

    registered(_adapter())
    result = CliRunner().invoke(cli, ["import", "hf", str(src), "-o", str(tmp_path / "ckpt")])
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "ckpt" / "import.json").read_text())
    assert record["family"] == TYPE and record["verification"]["passed"]

    # The judge on other sources than the import's proof: transformers' own model of the directory, greedy.
    model, _ = load_checkpoint(tmp_path / "ckpt")
    ids, mask = pad_batch(seeded_sources(model.cfg, 6, seed=42), model.cfg.pad_id)
    ours = greedy_decode(EagerStepModel(model), ids, mask, DecodeSettings.for_model(model.cfg, 20))
    with torch.inference_mode():
        rows = load_transformers_model(src).generate(input_ids=torch.as_tensor(ids),
                                                     attention_mask=torch.as_tensor(mask), max_new_tokens=20,
                                                     do_sample=False, num_beams=1)[:, 1:].tolist()
    eos = model.cfg.eos_id
    assert ours == [r[: r.index(eos)] if eos in r else r for r in rows]
    assert len({t for row in ours for t in row}) > 3, "degenerate outputs cannot tell a wrong model apart"


def test_a_wrong_adapter_for_the_new_family_fails_the_proof(transformers_knows_the_type, registered, make_hf_model,
                                                            tmp_path):
    """Negative control: the same copy reading the activation wrong loads every tensor but computes another model."""
    src = _source(make_hf_model, tmp_path / "src")
    registered(_adapter(activation="gelu"))  # the source's is relu
    result = CliRunner().invoke(cli, ["import", "hf", str(src), "-o", str(tmp_path / "ckpt")])
    assert result.exit_code == 1 and "failed its verification against transformers" in result.output, result.output
    assert not (tmp_path / "ckpt").exists()
