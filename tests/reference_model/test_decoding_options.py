"""Hugging Face's generation options in the reference decoding (min_length / min_new_tokens, no-repeat n-grams,
repetition penalty, multi-token bad words, early stopping, n-best lists with their scores, sampling), judged by
transformers' own `generate` with the same options on small random models of two families, fp32, eager."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra is not installed")

from seq2trt.reference_model.decoding import DecodeSettings, Hypothesis, greedy_decode, hf_beam_search  # noqa: E402
from seq2trt.reference_model.eager import EagerStepModel  # noqa: E402
from seq2trt.core.errors import ConfigError  # noqa: E402
from seq2trt.hf_import.importer import load_hf_as_model  # noqa: E402
from seq2trt.hf_import.proof import load_transformers_model, seeded_sources  # noqa: E402
from seq2trt.hf_import.families import transformers_major  # noqa: E402
from seq2trt.reference_model.vocab import pad_batch  # noqa: E402

from helpers.hf_models import hf_generate  # noqa: E402

NEW = 16

# Each set changes what these models decode (checked below): the history rules bite on models that repeat.
OPTIONS = {
    "min_length": dict(min_length=12),
    "min_new_tokens": dict(min_new_tokens=9),
    "no_repeat_ngram_2": dict(no_repeat_ngram_size=2),
    "no_repeat_ngram_1": dict(no_repeat_ngram_size=1),
    "repetition_penalty": dict(repetition_penalty=1.8),
    "repetition_reward": dict(repetition_penalty=0.6),
    "bad_words": dict(bad_words_ids="planted"),
    "all": dict(min_length=6, no_repeat_ngram_size=3, repetition_penalty=1.3, bad_words_ids="planted"),
}


# eos made likely (the logits bias): some sources end at once, others run on, so the length floors bite. transformers
# 5 initialises the seeded Marian otherwise (another model; at seed 0 and 8 every source ends at once): a seed and a
# bias of its own, chosen so that every option changes what it decodes.
EOS_BIAS = {"marian": 8.0 if transformers_major() < 5 else 3.0, "bart": 3.0}
SEED = {"marian": 0 if transformers_major() < 5 else 4, "bart": 0}


@pytest.fixture(scope="module", params=sorted(EOS_BIAS))
def models(request, make_hf_model, tmp_path_factory):
    src = make_hf_model(tmp_path_factory.mktemp(request.param), request.param, seed=SEED[request.param])
    hf_model = load_transformers_model(src)
    with torch.no_grad():
        hf_model.final_logits_bias[0, hf_model.config.eos_token_id] += EOS_BIAS[request.param]
    hf_model.save_pretrained(src)
    _, model, _, _ = load_hf_as_model(src)
    ids, mask = pad_batch(seeded_sources(model.cfg, 6, seed=3), model.cfg.pad_id)
    return model, load_transformers_model(src), ids, mask


def _options(name, baseline):
    """The option set, with bad words planted from the baseline's own output (2- and 3-token words it produced)."""
    opts = dict(OPTIONS[name])
    if opts.get("bad_words_ids") == "planted":
        words = {tuple(row[i: i + n]) for row in baseline for n in (2, 3) for i in range(0, len(row) - n, 3)}
        opts["bad_words_ids"] = [list(w) for w in sorted(words)[:6]]
    return opts


def _settings(model, opts, **extra):
    base = DecodeSettings.for_model(model.cfg, NEW)
    opts = {**opts, **({"bad_words_ids": tuple(map(tuple, opts["bad_words_ids"]))} if "bad_words_ids" in opts else {})}
    return dataclasses.replace(base, **opts, **extra)


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_greedy_options_equal_generate(models, name):
    model, hf_model, ids, mask = models
    eos, step = model.cfg.eos_id, EagerStepModel(model)
    baseline = greedy_decode(step, ids, mask, DecodeSettings.for_model(model.cfg, NEW))
    opts = _options(name, baseline)
    want, _ = hf_generate(hf_model, ids, mask, NEW, eos, do_sample=False, num_beams=1, **opts)
    ours = greedy_decode(step, ids, mask, _settings(model, opts))
    assert ours == want
    assert ours != baseline, f"{name} changed nothing: the test could not fail"


# Every option with early_stopping False; the three stopping modes on the length floor and on everything at once.
BEAM_CASES = [(name, False) for name in sorted(OPTIONS)] + [(name, mode) for name in ("all", "min_length")
                                                             for mode in (True, "never")]


@pytest.mark.parametrize("name,early_stopping", BEAM_CASES)
def test_beam_options_nbest_and_scores_equal_generate(models, name, early_stopping):
    model, hf_model, ids, mask = models
    eos, step = model.cfg.eos_id, EagerStepModel(model)
    nbest = dict(num_return_sequences=3, output_scores=True)
    baseline = hf_beam_search(step, ids, mask, _settings(model, {}, **nbest), 4, 1.0, early_stopping)
    opts = _options(name, [h.tokens for row in baseline for h in row])
    want, out = hf_generate(hf_model, ids, mask, NEW, eos, do_sample=False, num_beams=4, num_return_sequences=3,
                          early_stopping=early_stopping, output_scores=True, **opts)
    ours = hf_beam_search(step, ids, mask, _settings(model, opts, **nbest), 4, 1.0, early_stopping)
    assert all(isinstance(h, Hypothesis) for row in ours for h in row)
    assert [h.tokens for row in ours for h in row] == want
    np.testing.assert_allclose([h.score for row in ours for h in row], out.sequences_scores.numpy(), rtol=1e-5)
    assert ours != baseline, f"{name} changed nothing: the test could not fail"
    plain = hf_beam_search(step, ids, mask, _settings(model, opts), 4, 1.0, early_stopping)
    assert plain == [row[0].tokens for row in ours]


def test_greedy_scores_are_the_transition_scores(models):
    model, hf_model, ids, mask = models
    eos = model.cfg.eos_id
    want, out = hf_generate(hf_model, ids, mask, NEW, eos, do_sample=False, num_beams=1, output_scores=True,
                          repetition_penalty=1.3)
    ours = greedy_decode(EagerStepModel(model), ids, mask, _settings(model, dict(repetition_penalty=1.3),
                                                                     output_scores=True))
    steps = hf_model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True).numpy()
    totals = [steps[i, : len(row) + (len(row) < NEW)].sum() for i, row in enumerate(want)]  # eos counted
    assert [row[0].tokens for row in ours] == want
    np.testing.assert_allclose([row[0].score for row in ours], totals, rtol=1e-5)


def _transitions(hf_model, out, want, beams: bool) -> list[list[float]]:
    """transformers' per-token scores of each returned sequence, cut after its eos (compute_transition_scores)."""
    steps = (hf_model.compute_transition_scores(out.sequences, out.scores, out.beam_indices) if beams else
             hf_model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)).numpy()
    return [steps[i, : len(row) + (len(row) < steps.shape[1])].tolist() for i, row in enumerate(want)]


def test_greedy_and_sampled_token_logprobs_are_the_transition_scores(models):
    model, hf_model, ids, mask = models
    eos, step = model.cfg.eos_id, EagerStepModel(model)
    for opts, extra in ((dict(repetition_penalty=1.3), {}), (dict(temperature=0.7, top_k=5), dict(do_sample=True))):
        torch.manual_seed(5)
        want, out = hf_generate(hf_model, ids, mask, NEW, eos, num_beams=1, output_scores=True, do_sample=bool(extra),
                              **opts)
        ours = greedy_decode(step, ids, mask, _settings(model, opts, output_token_logprobs=True, seed=5, **extra))
        assert [row[0].tokens for row in ours] == want
        got = [list(row[0].token_logprobs) for row in ours]
        assert [len(g) for g in got] == [len(w) + (len(w) < NEW) for w in want]  # the closing eos has one too
        for g, w, row in zip(got, _transitions(hf_model, out, want, beams=False), ours):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
            assert abs(sum(g) - row[0].score) <= 1e-6 * max(1.0, abs(row[0].score))  # the score is their sum
    assert greedy_decode(step, ids, mask, _settings(model, {}, output_scores=True))[0][0].token_logprobs is None


@pytest.mark.parametrize("early_stopping", [False, True])
def test_beam_token_logprobs_are_the_transition_scores(models, early_stopping):
    model, hf_model, ids, mask = models
    eos, step = model.cfg.eos_id, EagerStepModel(model)
    opts = dict(min_length=4, no_repeat_ngram_size=2)
    want, out = hf_generate(hf_model, ids, mask, NEW, eos, do_sample=False, num_beams=4, num_return_sequences=3,
                          early_stopping=early_stopping, output_scores=True, **opts)
    ours = hf_beam_search(step, ids, mask, _settings(model, opts, num_return_sequences=3, output_token_logprobs=True),
                          4, 1.0, early_stopping)
    hyps = [h for row in ours for h in row]
    assert [h.tokens for h in hyps] == want
    for h, w in zip(hyps, _transitions(hf_model, out, want, beams=True)):
        np.testing.assert_allclose(h.token_logprobs, w, rtol=1e-5, atol=1e-5)
        # the beam score is their sum over the length (eos counted), to the length_penalty 1.0
        assert abs(sum(h.token_logprobs) / len(h.token_logprobs) - h.score) <= 1e-5 * max(1.0, abs(h.score))


def test_gnmt_beam_token_logprobs_sum_to_the_unpenalised_score(make_model):
    from seq2trt.reference_model.decoding import beam_search, length_penalty

    model = make_model(seed=2, dtype=torch.float32)
    ids, mask = pad_batch(seeded_sources(model.cfg, 4, seed=1), model.cfg.pad_id)
    settings = dataclasses.replace(DecodeSettings.for_model(model.cfg, 12), num_return_sequences=2,
                                   output_token_logprobs=True)
    for row in beam_search(EagerStepModel(model), ids, mask, settings, beam_size=3, alpha=0.6):
        for h in row:
            ended = len(h.token_logprobs) == len(h.tokens) + 1
            assert len(h.token_logprobs) in (len(h.tokens), len(h.tokens) + 1)
            penalised = sum(h.token_logprobs) / length_penalty(len(h.tokens) + ended, 0.6)
            assert abs(penalised - h.score) <= 1e-9 * max(1.0, abs(h.score)), (penalised, h.score)


SAMPLING = {"default-top50": {}, "temperature": dict(temperature=0.7), "top_k": dict(top_k=5),
            "top_p": dict(top_p=0.8, top_k=0), "all": dict(temperature=1.3, top_k=20, top_p=0.9)}


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("name", sorted(SAMPLING))
def test_sampling_equals_generate_with_the_same_seed(models, name, n):
    """Rows finish at different steps and leave our batch; the draws still follow transformers' (full batch)."""
    model, hf_model, ids, mask = models
    eos, opts = model.cfg.eos_id, SAMPLING[name]
    torch.manual_seed(11)
    want, _ = hf_generate(hf_model, ids, mask, NEW, eos, do_sample=True, num_beams=1, num_return_sequences=n,
                        min_length=3, **opts)
    settings = _settings(model, dict(min_length=3, **opts), do_sample=True, seed=11, num_return_sequences=n)
    ours = greedy_decode(EagerStepModel(model), ids, mask, settings)
    ours = [h.tokens for row in ours for h in row] if n > 1 else ours
    assert ours == want
    assert len({len(r) for r in ours}) > 1, "every row ended together: dropping rows went untested"
    other = greedy_decode(EagerStepModel(model), ids, mask, dataclasses.replace(settings, seed=12))
    assert other != greedy_decode(EagerStepModel(model), ids, mask, settings)


def test_options_that_cannot_hold_are_refused(models):
    model, _, ids, mask = models
    step = EagerStepModel(model)
    with pytest.raises(ConfigError, match="num_return_sequences 5 is more than the 4 beams"):
        hf_beam_search(step, ids, mask, _settings(model, {}, num_return_sequences=5), 4)
    with pytest.raises(ConfigError, match="greedy search returns one sequence"):
        greedy_decode(step, ids, mask, _settings(model, {}, num_return_sequences=2))
    for bad, message in ((dict(top_p=0.0), "top_p must be a number in"),
                         (dict(temperature=0.0), "temperature must be a number > 0"),
                         (dict(temperature=1e-45), "temperature must be at least 1.18e-38 .the smallest normal float32"),
                         (dict(repetition_penalty=-1.0), "repetition_penalty must be a number > 0"),
                         (dict(max_new_tokens=4.7), "max_new_tokens must be an integer"),
                         (dict(seed=2 ** 64), r"seed must be an integer in \[0, 2\*\*64\)")):
        with pytest.raises(ConfigError, match=message):
            _settings(model, bad)


def _teacher_forced_logprob(model, source: list[int], tokens: list[int], settings) -> float:
    """The log-probability of `tokens` then eos given `source`, one forward pass of the eager model (no search)."""
    cfg = model.cfg
    ids, mask = pad_batch([source], cfg.pad_id)
    target = [settings.bos_id] + tokens
    with torch.inference_mode():
        logits = model(torch.as_tensor(ids), torch.as_tensor(mask), torch.as_tensor([target]))
    logp = torch.log_softmax(logits[0].double(), -1)
    return float(sum(logp[i, t] for i, t in enumerate(tokens + [settings.eos_id])))


def test_gnmt_beam_n_best_are_its_best_hypotheses_with_their_scores(make_model):
    """Models trained here: the n-best of GNMT's beam search, best first, each scored log P(y|x) / lp(|y| + 1)
    (the eos counted) as an independent forward pass of the model computes it; the first is the plain search's."""
    from seq2trt.reference_model.decoding import beam_search, length_penalty

    model = make_model(7)
    sources = [[3, 5, 7, 2], [4, 4, 2], [9, 1, 6, 8, 2]]
    ids, mask = pad_batch(sources, model.cfg.pad_id)
    step = EagerStepModel(model)
    base = DecodeSettings.for_model(model.cfg, 10)
    nbest = beam_search(step, ids, mask, dataclasses.replace(base, num_return_sequences=3), beam_size=4, alpha=0.6)
    assert [row[0].tokens for row in nbest] == beam_search(step, ids, mask, base, beam_size=4, alpha=0.6)
    for source, row in zip(sources, nbest):
        assert len(row) == 3 and len({tuple(h.tokens) for h in row}) == 3
        assert [h.score for h in row] == sorted((h.score for h in row), reverse=True)
        for h in row:
            if len(h.tokens) < 10:  # ended with eos (a hypothesis cut by the limit has no eos to count)
                want = _teacher_forced_logprob(model, source, h.tokens, base) / length_penalty(len(h.tokens) + 1, 0.6)
                assert h.score == pytest.approx(want, rel=1e-6)
