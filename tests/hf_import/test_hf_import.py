"""`seq2trt import hf`: small random models of each family, made here with the family's own config class, are
imported and then judged by transformers itself (its model and its `generate` on the same directory)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("transformers", reason="the hf extra is not installed")

from seq2trt.cli.main import cli  # noqa: E402
from seq2trt.hf_import import importer as hf_import  # noqa: E402
from seq2trt.reference_model.checkpoint import load_checkpoint  # noqa: E402
from seq2trt.reference_model.decoding import DecodeSettings, greedy_decode, hf_beam_search  # noqa: E402
from seq2trt.reference_model.eager import EagerStepModel  # noqa: E402
from seq2trt.hf_import.families import ACTIVATIONS, FAMILIES  # noqa: E402
from seq2trt.hf_import.proof import load_transformers_model, seeded_sources  # noqa: E402
from seq2trt.reference_model.vocab import pad_batch  # noqa: E402

from helpers.hf_models import hf_rows, import_watching_models  # noqa: E402

# (family, config options, generation settings): post-/pre-LN, every activation, tied/untied, scale on/off,
# shared/separate vocabularies, forced bos, suppressed ids, the three early-stopping modes and length penalties.
CASES = {
    "marian-swish-scaled": ("marian", dict(activation_function="swish", scale_embedding=True),
                            dict(bad_words_ids=[[96]], num_beams=4)),
    "marian-separate-embeddings-untied": ("marian", dict(share_encoder_decoder_embeddings=False,
                                                         activation_function="gelu", tie_word_embeddings=False, scale_embedding=True), {}),
    "bart-forced-bos-early": ("bart", {}, dict(forced_bos_token_id=0, early_stopping=True, length_penalty=0.6, num_beams=4)),
    # (transformers 4.57 does not reload a BART or M2M100 saved with tie_word_embeddings=False: it re-initialises the
    # encoder and decoder embeddings, so its own model is not the one saved; our import then fails, as it should.)
    "bart-relu-scaled": ("bart", dict(activation_function="relu", scale_embedding=True), {}),
    "mbart-gelu_new-never": ("mbart", dict(activation_function="gelu_new", scale_embedding=True),
                             dict(early_stopping="never", length_penalty=1.2, num_beams=5)),
    "m2m_100-forced-lang": ("m2m_100", {}, dict(forced_bos_token_id=5, length_penalty=0.8, num_beams=4)),
    "m2m_100-silu-unscaled": ("m2m_100", dict(activation_function="silu", scale_embedding=False), {}),
    # A summarization checkpoint's settings (BART CNN-style), multi-token bad words, and a sampling model's defaults.
    "bart-cnn-style": ("bart", {}, dict(min_length=8, no_repeat_ngram_size=3, length_penalty=2.0, num_beams=4,
                                        repetition_penalty=1.2, bad_words_ids=[[5], [28, 28]])),
    "marian-sampling-defaults": ("marian", dict(activation_function="swish", scale_embedding=True),
                                 dict(do_sample=True, top_k=10, top_p=0.9, temperature=0.8, num_return_sequences=2,
                                      min_new_tokens=4)),
}


# Without the sqrt(d_model) factor, embeddings at std 0.35 drown in the sinusoid and decode 3 tokens over and over.
STD = {"m2m_100-silu-unscaled": 1.0}


@pytest.mark.parametrize("case", sorted(CASES))
def test_import_equals_transformers_generate(case, make_hf_model, tmp_path):
    family, config, generation = CASES[case]
    src = make_hf_model(tmp_path / "src", family, config, generation, std=STD.get(case, 0.35))
    result = CliRunner().invoke(cli, ["import", "hf", str(src), "-o", str(tmp_path / "ckpt")])
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "ckpt" / "import.json").read_text())
    assert record["family"] == family and record["verification"]["passed"]

    # The judge, independently of the import's own proof: other sources, the checkpoint as written.
    model, _ = load_checkpoint(tmp_path / "ckpt")
    hf_model = load_transformers_model(src)
    gen = json.loads((tmp_path / "ckpt" / "generation.json").read_text())
    ids, mask = pad_batch(seeded_sources(model.cfg, 6, seed=42), model.cfg.pad_id)
    # The model's stored options apply on both sides (transformers reads them from generation_config.json).
    settings = dataclasses.replace(DecodeSettings.for_model(model.cfg, 20, gen), do_sample=False,
                                   num_return_sequences=1)
    for key in ("min_length", "no_repeat_ngram_size", "repetition_penalty", "do_sample", "top_k", "top_p",
                "temperature", "num_return_sequences", "min_new_tokens"):
        assert gen[key] == generation.get(key, {"num_return_sequences": 1, "do_sample": False, "top_k": 50,
                                                "top_p": 1.0, "temperature": 1.0, "repetition_penalty": 1.0,
                                                "min_new_tokens": None}.get(key, 0)), key
    step = EagerStepModel(model)
    ours = greedy_decode(step, ids, mask, settings)
    assert ours == hf_rows(hf_model, ids, mask, 20, model.cfg.eos_id, num_beams=1, num_return_sequences=1)
    assert len({t for row in ours for t in row}) > 3, "degenerate outputs cannot tell a wrong model apart"
    beam = hf_beam_search(step, ids, mask, settings, 4, gen["length_penalty"], gen["early_stopping"])
    assert beam == hf_rows(hf_model, ids, mask, 20, model.cfg.eos_id, num_beams=4, num_return_sequences=1,
                             length_penalty=gen["length_penalty"], early_stopping=gen["early_stopping"])
    assert beam != ours or case.startswith("bart-forced"), "beam search never differed from greedy"
    if generation.get("forced_bos_token_id") is not None:
        assert all(row[0] == generation["forced_bos_token_id"] for row in ours)
    if generation.get("bad_words_ids"):
        singles = [w[0] for w in generation["bad_words_ids"] if len(w) == 1]
        assert all(t not in row for t in singles for row in ours + beam)
        assert gen["bad_words_ids"] == ([w for w in generation["bad_words_ids"] if len(w) > 1] or None)


def _fields(family: str, **changes):
    """A patch of `family`'s adapter: its config fields with `changes` (a wrong architecture for the family)."""
    adapter = FAMILIES[family]
    fields = adapter.config_fields
    return lambda mp: mp.setattr(adapter, "config_fields", lambda src, hf: {**fields(src, hf), **changes})


@pytest.mark.parametrize("family, patch", [
    ("bart", lambda mp: mp.setitem(ACTIVATIONS, "gelu", "gelu_tanh")),  # close, but not BART's GELU
    ("marian", _fields("marian", positions="sinusoid")),  # interleaved
    ("m2m_100", _fields("m2m_100", position_offset=0)),
    ("mbart", _fields("mbart", logits_bias=False)),
], ids=["bart-activation", "marian-positions", "m2m_100-offset", "mbart-unknown-bias"])
def test_a_wrong_mapping_fails_the_import_and_writes_nothing(family, patch, make_hf_model, tmp_path, monkeypatch):
    """Negative controls: a mapping that loads but computes something else fails transformers' judgement (exit 1);
    one whose tensors do not fit is refused before (exit 2). Either way nothing is written."""
    src = make_hf_model(tmp_path / "src", family)
    patch(monkeypatch)
    result = CliRunner().invoke(cli, ["import", "hf", str(src), "-o", str(tmp_path / "ckpt")])
    if family == "mbart":  # final_logits_bias has nowhere to go
        assert result.exit_code == 2 and "unexpected keys ['logits_bias']" in result.output, result.output
    else:
        assert result.exit_code == 1, result.output
        assert "failed its verification against transformers" in result.output
    assert not (tmp_path / "ckpt").exists()


def test_unsupported_models_and_options_are_named(make_hf_model, tmp_path):
    import transformers

    transformers.LongT5ForConditionalGeneration(transformers.LongT5Config(
        vocab_size=50, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8)).save_pretrained(tmp_path / "longt5")
    result = CliRunner().invoke(cli, ["import", "hf", str(tmp_path / "longt5"), "-o", str(tmp_path / "a")])
    assert result.exit_code == 2 and "'longt5' model" in result.output and "marian, bart, mbart, m2m_100" in result.output

    src = make_hf_model(tmp_path / "ngram", "bart", generation=dict(encoder_no_repeat_ngram_size=3, num_beams=4))
    result = CliRunner().invoke(cli, ["import", "hf", str(src), "-o", str(tmp_path / "b")])
    assert result.exit_code == 2 and "encoder_no_repeat_ngram_size=3" in result.output

    src = make_hf_model(tmp_path / "heads", "marian", config=dict(decoder_attention_heads=2))
    result = CliRunner().invoke(cli, ["import", "hf", str(src), "-o", str(tmp_path / "c")])
    assert result.exit_code == 2 and "decoder_attention_heads=2" in result.output
    assert not any((tmp_path / n).exists() for n in "abc")


def test_pickled_code_in_bin_weights_is_refused(make_hf_model, tmp_path):
    src = make_hf_model(tmp_path / "src", "bart")
    state = {k: torch.zeros(1) for k in ("a",)}
    state["payload"] = np.dtype  # anything that needs code to unpickle
    (src / "model.safetensors").unlink()
    torch.save(state, src / "pytorch_model.bin")
    result = CliRunner().invoke(cli, ["import", "hf", str(src), "-o", str(tmp_path / "ckpt")])
    assert result.exit_code == 2 and "refusing" in result.output and "pickled" in result.output
    assert not (tmp_path / "ckpt").exists()


def test_bin_weights_import_and_existing_output_needs_force(make_hf_model, tmp_path):
    from safetensors.torch import load_file

    src = make_hf_model(tmp_path / "src", "m2m_100")
    torch.save(load_file(str(src / "model.safetensors")), src / "pytorch_model.bin")
    (src / "model.safetensors").unlink()
    out = tmp_path / "ckpt"
    assert CliRunner().invoke(cli, ["import", "hf", str(src), "-o", str(out)]).exit_code == 0
    before = (out / "model.safetensors").read_bytes()
    result = CliRunner().invoke(cli, ["import", "hf", str(src), "-o", str(out)])
    assert result.exit_code == 2 and "--force" in result.output
    assert (out / "model.safetensors").read_bytes() == before
    assert "--ids-file" in CliRunner().invoke(cli, ["import", "hf", str(src), "-o", str(out), "--force"]).output


@pytest.mark.parametrize("damage, message", [
    (lambda src: (src / "config.json").write_text("{not json"), "not valid JSON"),
    (lambda src: (src / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes()[:200]),
     "truncated or not a safetensors file"),
    (lambda src: (src / "model.safetensors").unlink(), "holds no weights"),
    (lambda src: (src / "config.json").write_text('{"model_type": "bart", "d_model": 32}'), "lacks"),
    (lambda src: (src / "config.json").write_text('{"d_model": 32}'), "names no model_type"),
], ids=["config-not-json", "weights-truncated", "weights-missing", "config-incomplete", "not-hf"])
def test_damaged_or_foreign_sources_are_named_and_nothing_is_written(damage, message, make_hf_model, tmp_path):
    src = make_hf_model(tmp_path / "src", "bart")
    damage(src)
    result = CliRunner().invoke(cli, ["import", "hf", str(src), "-o", str(tmp_path / "ckpt")])
    assert result.exit_code == 2 and message in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("early_stopping", [True, False])
def test_finished_sources_leave_the_beam_batch_and_tokens_stay_transformers(early_stopping, make_hf_model, tmp_path):
    """hf_beam_search drops a source's K rows once its result is final (transformers keeps them running): on sources
    that end at different steps (eos made likely by the logits bias) the step model sees fewer rows as they end,
    and the tokens are still transformers' own beam search's. Its first step runs one row a source."""
    src = make_hf_model(tmp_path / "src", "bart", {}, dict(early_stopping=early_stopping, num_beams=4))
    hf_model = load_transformers_model(src)
    with torch.no_grad():
        hf_model.final_logits_bias[0, hf_model.config.eos_token_id] += 5.0
    hf_model.save_pretrained(src)
    assert CliRunner().invoke(cli, ["import", "hf", str(src), "-o", str(tmp_path / "ckpt")]).exit_code == 0
    model, _ = load_checkpoint(tmp_path / "ckpt")
    ids, mask = pad_batch(seeded_sources(model.cfg, 8, seed=7), model.cfg.pad_id)
    rows: list[int] = []

    class Counted(EagerStepModel):
        def step(self, input_ids, *args):
            rows.append(len(input_ids))
            return super().step(input_ids, *args)

    beam = hf_beam_search(Counted(model), ids, mask, DecodeSettings.for_model(model.cfg, 20), 4, 1.0, early_stopping)
    assert beam == hf_rows(hf_model, ids, mask, 20, model.cfg.eos_id, num_beams=4, length_penalty=1.0,
                             early_stopping=early_stopping)
    lengths = {len(row) for row in beam}
    assert len(lengths) > 2, f"the sources must end at different steps to test this: lengths {sorted(lengths)}"
    # The first step runs one row a source (the K beams start identical), then K rows a live source.
    assert rows[0] == 8 and rows[1] <= 32 and rows[1:] == sorted(rows[1:], reverse=True) and rows[-1] < 32, rows
    assert all(r % 4 == 0 for r in rows[1:])


# transformers' own limits: max_length counts the decoder start token; max_new_tokens wins when both are set.
LIMITS = {"marian-max_length": ("marian", dict(max_length=10)),
          "bart-both-beam": ("bart", dict(max_length=30, max_new_tokens=6, num_beams=3))}


@pytest.mark.parametrize("case", sorted(LIMITS))
def test_the_models_own_length_limits_bound_translate_as_generate(case, make_hf_model, tmp_path):
    """translate with no --max-new-tokens stops where transformers' generate, given no length either, stops; a flag
    still overrides the model's limit."""
    family, generation = LIMITS[case]
    src = make_hf_model(tmp_path / "src", family, generation=generation)
    assert CliRunner().invoke(cli, ["import", "hf", str(src), "-o", str(tmp_path / "ckpt")]).exit_code == 0
    model, _ = load_checkpoint(tmp_path / "ckpt")
    sources = seeded_sources(model.cfg, 6, seed=42)
    (tmp_path / "ids.jsonl").write_text("".join(json.dumps(s) + "\n" for s in sources))
    ids, mask = pad_batch(sources, model.cfg.pad_id)
    with torch.inference_mode():
        rows = load_transformers_model(src).generate(input_ids=torch.as_tensor(ids),
                                                     attention_mask=torch.as_tensor(mask))[:, 1:].tolist()
    eos = model.cfg.eos_id
    want = [r[: r.index(eos)] if eos in r else r for r in rows]
    limit = generation.get("max_new_tokens") or generation["max_length"] - 1
    assert max(len(r) for r in want) in (limit - 1, limit), "the sources must reach the limit to test it"

    def translate(*flags):
        out = tmp_path / "out.jsonl"
        result = CliRunner().invoke(cli, ["translate", str(tmp_path / "ckpt"), "--ids-file", str(tmp_path / "ids.jsonl"),
                                          "--output-ids", str(out), *flags])
        assert result.exit_code == 0, result.output
        return [json.loads(line) for line in out.read_text().splitlines()]

    assert translate() == want
    assert max(len(r) for r in translate("--max-new-tokens", "20")) > limit


def test_a_wrong_reading_of_the_length_limit_fails_the_import(make_hf_model, tmp_path, monkeypatch):
    """Negative control of the proof: max_length read as new tokens (the start token not counted) is caught."""
    src = make_hf_model(tmp_path / "src", "marian", generation=dict(max_length=10))
    monkeypatch.setattr(hf_import, "own_limit", lambda gen, positions: gen["max_length"])
    result = CliRunner().invoke(cli, ["import", "hf", str(src), "-o", str(tmp_path / "ckpt")])
    assert result.exit_code == 1 and "stops after 9 new tokens" in result.output, result.output
    assert "greedy tokens differ" in result.output and not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("generation, message", [
    (dict(do_sample=True, num_beams=4), "do_sample=True with num_beams=4 (beam sampling)"),
    (dict(do_sample=True, typical_p=0.5), "typical_p=0.5"),
    (dict(num_return_sequences=3, num_beams=2), "num_return_sequences 3 is more than num_beams 2"),
    (dict(top_p=1.5), "top_p must be a number in (0, 1]"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
    (dict(min_length=-1), "min_length must be an integer >= 0"),
    (dict(bad_words_ids=[[5], []]), "bad_words_ids must be a list of token-id lists"),
], ids=["beam-sampling", "typical_p", "n-best-over-beams", "top_p", "repetition_penalty", "min_length", "empty-word"])
def test_generation_options_still_unsupported_or_out_of_range_are_named(generation, message, make_hf_model, tmp_path):
    src = make_hf_model(tmp_path / "src", "bart")  # written by hand: save_pretrained refuses some of these itself
    path = src / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **generation}))
    result = CliRunner().invoke(cli, ["import", "hf", str(src), "-o", str(tmp_path / "ckpt")])
    assert result.exit_code == 2 and message in result.output and "generation_config.json" in result.output, \
        result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "ckpt").exists()


def test_typical_p_without_sampling_changes_nothing_and_imports(make_hf_model, tmp_path):
    src = make_hf_model(tmp_path / "src", "bart")
    path = src / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "typical_p": 0.5}))
    assert CliRunner().invoke(cli, ["import", "hf", str(src), "-o", str(tmp_path / "ckpt")]).exit_code == 0


@pytest.mark.parametrize("speech", [False, True], ids=["text", "speech"])
def test_a_big_models_proof_runs_on_fewer_inputs_and_records_it(make_hf_model, tmp_path, monkeypatch, speech):
    """Past hf_verify.BIG_MODEL_BYTES of fp32 weights the proof runs on BIG_MODEL_SOURCES inputs a set (a
    whisper-large-v3 takes minutes an input on two cores); what was proven is printed and kept in import.json. Below
    it the proof is unchanged (8 sources a set; 4 feature batches)."""
    from seq2trt.hf_import import proof as hf_verify
    from helpers.hf_models import whisper_model_dir

    src = whisper_model_dir(tmp_path / "hf", config={}) if speech else make_hf_model(tmp_path / "src", "marian")
    usual = hf_import.import_hf(src, tmp_path / "usual")["verification"]
    assert not usual["scope"]["bounded"] and usual["seeded"]["sources"] == (4 if speech else 8)
    monkeypatch.setattr(hf_verify, "BIG_MODEL_BYTES", usual["scope"]["weights_bytes"] - 1)  # this model is big
    messages: list[str] = []
    record = hf_import.import_hf(src, tmp_path / "big", progress=messages.append)
    proof = record["verification"]
    want = hf_verify.BIG_MODEL_SOURCES["speech" if speech else "text"]
    assert proof["passed"] and proof["scope"]["bounded"] and proof["scope"]["sources_per_set"] == want
    assert proof["seeded"]["sources"] == want and proof["seeded"]["greedy_equal"] == proof["seeded"]["beam_equal"] == want
    assert json.loads((tmp_path / "big" / "import.json").read_text())["verification"]["scope"] == proof["scope"]
    assert any(f"the proof runs on {want} input(s) a set" in m for m in messages), messages
    assert any(m.startswith("comparing ") for m in messages) and any("beam" in m for m in messages)


def test_a_text_import_holds_one_model_at_a_time(make_hf_model, tmp_path, monkeypatch):
    """A text model's proof runs transformers' side first and frees its model before ours is built (the 2.3 GB
    Marian's import held both): when our model starts loading, transformers' is gone, and the proof still compares
    the step logits and the tokens of every source."""
    src = make_hf_model(tmp_path / "hf", "bart", generation=dict(num_beams=2, max_length=12))
    record, alive = import_watching_models(src, tmp_path / "ckpt", monkeypatch)
    verification = record["verification"]
    assert alive == [[False]] and verification["passed"]
    assert verification["seeded"]["greedy_equal"] == verification["seeded"]["sources"] == 8
    assert verification["seeded"]["step_logits_compared"] > 0
