"""Decode options and inputs of the Python API and the CLI that ended in an untyped exception, a traceback, or a wrong
result with exit 0 (issue 49, items 6 to 8): each is refused with seq2trt's typed error naming the keyword (API) or
the flag (CLI) and the fix, or now gives the right result. Every rule has one home, the options table
(reference_model/decoding/options.py), checked by DecodeSettings; the API and the CLI name the option their own way."""

from __future__ import annotations

import numpy as np
import pytest

import seq2trt
from seq2trt.reference_model.decoding import DecodeSettings
from seq2trt.core.errors import ConfigError, InputError

from helpers.cli import invoke, one_error_line

TEXTS = ["40213", "7", "999999"]


@pytest.fixture(scope="module")
def translator(numbers_export):
    root, _, _ = numbers_export
    with seq2trt.Translator(root / "ckpt", backend="eager") as opened:
        yield opened


def test_an_iterator_of_texts_is_translated(translator):
    """A generator or a map was consumed by the text check and gave []."""
    want = [h.ids for h in translator.translate(TEXTS)]
    assert [h.ids for h in translator.translate(t for t in TEXTS)] == want
    assert [h.ids for h in translator.translate(map(str, TEXTS))] == want
    assert len(want) == 3


@pytest.mark.parametrize("bad, word", [(b"12", "bytes"), (None, "NoneType"), (12, "int")])
def test_a_text_that_is_not_a_string_is_named(translator, bad, word):
    with pytest.raises(InputError, match=f"text 2 is a {word}, not a string"):
        translator.translate(["12", bad])


@pytest.mark.parametrize("options, name", [
    (dict(max_new_tokens=4.7), "max_new_tokens"), (dict(max_new_tokens="3"), "max_new_tokens"),
    (dict(sample=True, temperature="hot"), "temperature"), (dict(sample=True, seed=1.5), "seed"),
    (dict(sample=True, seed=2 ** 70), "seed"), (dict(sample=True, seed=-1), "seed"),
    (dict(sample="yes"), "sample"), (dict(sample=True, top_k=2.5), "top_k"),
    (dict(repetition_penalty="x"), "repetition_penalty"), (dict(beam_size=2.0), "beam_size"),
    (dict(batch_size="4"), "batch_size"), (dict(length_penalty="x"), "length_penalty")])
def test_api_options_of_the_wrong_type_are_typed_errors_naming_the_keyword(translator, options, name):
    with pytest.raises(InputError) as exc:
        translator.translate(TEXTS, **options)
    assert str(exc.value).startswith(name + " "), str(exc.value)


def test_a_subnormal_temperature_is_refused_as_transformers_refuses_it(translator, numbers_export):
    """1e-45 passed "> 0" and sampled garbage (every logit / T overflows float32 to inf); transformers raises."""
    with pytest.raises(InputError, match="temperature"):
        translator.translate(TEXTS, sample=True, temperature=1e-45, seed=0)
    root, _, _ = numbers_export
    one_error_line(invoke("translate", root / "ckpt", *TEXTS, "--sample", "--temperature", "1e-45"), 2,
                   "--temperature")
    with pytest.raises(ConfigError, match="temperature"):
        DecodeSettings(0, 1, 2, 5, do_sample=True, temperature=1e-40)


def test_length_floors_above_the_length_limit_are_refused(translator, numbers_export):
    with pytest.raises(InputError, match="min_new_tokens 9 .*max_new_tokens 5"):
        translator.translate(TEXTS, max_new_tokens=5, min_new_tokens=9)
    with pytest.raises(InputError, match="min_length 40 .*"):
        translator.translate(TEXTS, max_new_tokens=5, min_length=40)
    root, _, _ = numbers_export
    one_error_line(invoke("translate", root / "ckpt", *TEXTS, "--max-new-tokens", 5, "--min-new-tokens", 9), 2,
                   "--min-new-tokens 9", "--max-new-tokens")


def test_token_logprobs_without_output_ids_is_refused(numbers_export):
    root, _, _ = numbers_export
    one_error_line(invoke("translate", root / "ckpt", *TEXTS, "--token-logprobs"), 2, "--token-logprobs",
                   "--output-ids")


@pytest.mark.parametrize("alpha", ["1e30", "-1e30"])
def test_a_length_penalty_that_overflows_is_refused(numbers_export, alpha):
    """GNMT's ((5 + n) / 6) ** alpha overflowed (OverflowError) and Hugging Face's length ** alpha made a score -0."""
    root, _, _ = numbers_export
    one_error_line(invoke("translate", root / "ckpt", *TEXTS, "--beam-size", 2, "--length-penalty", alpha), 2, "--length-penalty")
    with seq2trt.Translator(root / "ckpt", backend="eager") as translator:
        with pytest.raises(InputError, match="^length_penalty "):
            translator.translate(TEXTS, beam_size=2, length_penalty=float(alpha))
        translator.translate(TEXTS, beam_size=2, length_penalty=5.0)  # a large penalty that fits is kept


def test_a_beam_the_machine_cannot_hold_is_refused_before_decoding(numbers_export):
    """--beam-size 100000 allocated gigabytes (a traceback) or ran on and on: the import's memory estimate now refuses
    it before the first step."""
    root, _, _ = numbers_export
    one_error_line(invoke("translate", root / "ckpt", *TEXTS, "--beam-size", 10 ** 7), 2, "--beam-size 10000000", "GiB")


@pytest.mark.parametrize("verb", ["translate", "transcribe", "validate", "train"])
@pytest.mark.parametrize("seed", ["99999999999999999999999", "-1"])
def test_seeds_outside_64_bits_are_refused_alike_by_every_verb(numbers_export, tmp_path, verb, seed):
    """transcribe --seed 99999999999999999999999 ended in "Overflow when unpacking long long"; every --seed is
    one click type with DecodeSettings' rule, refused before the verb runs."""
    root, _, _ = numbers_export
    args = {"translate": ("translate", root / "ckpt", "7", "--sample"), "transcribe": ("transcribe", root / "ckpt",
            tmp_path / "a.wav"), "validate": ("validate", root / "out"), "train": ("train", "-o", tmp_path / "t")}
    one_error_line(invoke(*args[verb], "--seed", seed), 2, "--seed", "must be an integer in [0, 2**64)")
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("path", [None, 123])
def test_translator_of_a_non_path_is_a_typed_error(path):
    with pytest.raises(InputError, match="path must be"):
        seq2trt.Translator(path, backend="eager")


def test_translator_of_a_missing_path_says_it_is_missing(tmp_path):
    with pytest.raises(InputError, match="nothing not found; give an export directory") as exc:
        seq2trt.Translator(tmp_path / "nothing", backend="ort")
    assert "is a checkpoint" not in str(exc.value)


def test_threads_of_the_wrong_type_is_a_typed_error(numbers_export):
    root, _, _ = numbers_export
    with pytest.raises(InputError, match="^threads must be an integer"):
        seq2trt.Translator(root / "ckpt", backend="eager", threads="2")


def test_a_decoder_past_its_positions_is_named_in_user_terms(numbers_export):
    """"decoder: past_len + tgt_len = 65 exceeds max_tgt_len 64" named the graph's axes, not what the user did."""
    from seq2trt.runtime.registry import open_step_model

    root, model, _ = numbers_export
    ids = np.asarray([[5, 6, model.cfg.eos_id]], np.int64)
    mask = np.ones_like(ids)
    with open_step_model(root / "out", "ort", None, 1) as (step_model, manifest):
        state, past = step_model.encode(ids, mask), step_model.empty_past(1)
        limit = manifest.limits.max_tgt_len
        _, past = step_model.step(np.full((1, limit), model.cfg.bos_id, np.int64), mask, state, past)
        with pytest.raises(InputError) as exc:
            step_model.step(np.full((1, 1), model.cfg.bos_id, np.int64), mask, state, past)
    message = str(exc.value)
    assert f"the decoder would hold {limit + 1} tokens" in message and f"max_tgt_len {limit}" in message
    assert "past_len" not in message and "max_new_tokens" in message
