"""Sampling agreement (validation/sampling.py): exact under the same seed on float32 ONNX Runtime graphs against the
eager float64 model, and the chi-square test of sampled first tokens, which passes the eager model's own sampling
and fails a planted wrong temperature. The test's p-value is checked against closed forms of the chi-square law."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from seq2trt.exporters import spec
from seq2trt.exporters.manifest import verify
from seq2trt.exporters.onnx_export import export
from seq2trt.reference_model.decoding import DecodeSettings, greedy_decode
from seq2trt.reference_model.eager import EagerStepModel
from seq2trt.reference_model.vocab import pad_batch
from seq2trt.runtime.runners import OrtRunner
from seq2trt.runtime.step_model import RunnerStepModel
from seq2trt.validation import sampling, sampling_distribution as distribution

from helpers.sources import random_sources


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(make_model, tmp_path_factory, one_thread):
    """(fp32 model, its ORT fp32 graphs as a StepModel, the eager float64 reference, sources)."""
    model = make_model(seed=3, dtype=torch.float32)
    out = export(model, tmp_path_factory.mktemp("sampling") / "out")
    limits = verify(out).limits
    runners = tuple(OrtRunner(out / k.filename, model.cfg, k, "fp32", limits, intra_op_threads=1)
                    for k in spec.GraphKind)
    for r in runners:
        r.__enter__()
    reference = EagerStepModel(make_model(seed=3, dtype=torch.float64))
    yield model, RunnerStepModel(*runners), reference, random_sources(model.cfg, 24, seed=4)
    for r in runners:
        r.__exit__(None, None, None)


class Biased:
    """A candidate whose logits of one token are off by `bias` (a wrong graph)."""

    def __init__(self, model, token: int, bias: float):
        self.model, self.token, self.bias = model, token, bias

    def __getattr__(self, name):
        return getattr(self.model, name)

    def step(self, *args):
        logits, past = self.model.step(*args)
        logits = logits.copy()
        logits[:, self.token] += self.bias
        return logits, past


def settings_of(cfg, **options) -> DecodeSettings:
    return DecodeSettings(cfg.bos_id, cfg.eos_id, cfg.pad_id, 10, **options)


def test_ort_fp32_samples_the_eager_tokens_under_the_same_seed(models):
    model, ort_model, reference, sources = models
    settings = settings_of(model.cfg)
    result = sampling.sampling_agreement(ort_model, reference, sources, settings, "fp32", batch_size=8, seed=5)
    assert result.mode == "exact" and result, result.failures()
    assert result.exact.identical + result.exact.near_ties == 24 and result.exact.identical >= 22
    assert 0 < result.exact.max_logit_abs_err < 1e-4
    # what was compared is sampling: the eager fp32 model's own samples (seed 5, the first batch of 8), which differ
    # from greedy on these sources
    ids, mask = pad_batch(sources[:8], model.cfg.pad_id)
    sampled = greedy_decode(EagerStepModel(model), ids, mask, sampling.sampling_settings(settings, 5))
    assert sampled != greedy_decode(EagerStepModel(model), ids, mask, settings)
    assert sampled == greedy_decode(ort_model, ids, mask, sampling.sampling_settings(settings, 5))
    doc = result.to_dict()
    assert doc["passed"] and doc["exact"]["rate"] == result.exact.rate and doc["top_k"] == 50


def test_exact_sampling_fails_a_wrong_graph_and_excuses_nothing_past_the_cap(models):
    model, ort_model, reference, sources = models
    settings = sampling.sampling_settings(settings_of(model.cfg, temperature=0.8, top_k=6), seed=1)
    result = sampling.exact_sampling(Biased(ort_model, 5, 0.7), reference, sources, settings, "fp32", batch_size=8)
    assert not result and result.near_ties == 0 and result.identical < 24
    assert all(m["logit_abs_err"] > 1e-4 and not m["tie"] for m in result.mismatches)
    assert "beyond a near-tie" in result.failures()[0]


def test_chi_square_passes_the_eager_sampling_and_fails_a_wrong_temperature(models):
    model, ort_model, reference, sources = models
    for options in ({}, {"temperature": 0.7, "top_k": 5}, {"temperature": 1.3, "top_p": 0.8}):
        settings = settings_of(model.cfg, do_sample=True, **options)
        probs = distribution.first_token_probs(reference, sources[:4], settings)
        if "top_k" in options:
            assert ((probs > 0).sum(1) == 5).all()
        for candidate in (EagerStepModel(model), ort_model):
            counts = distribution.first_token_counts(candidate, sources[:4], settings, probs.shape[1], draws=2048)
            assert counts.sum() == 4 * 2048
            result = distribution.chi_square(counts, probs)
            assert result and result.impossible == 0 and result.dof >= 4, result
        wrong = replace(settings, temperature=settings.temperature * 1.25)  # the planted error
        counts = distribution.first_token_counts(EagerStepModel(model), sources[:4], wrong, probs.shape[1], draws=2048,
                                                 batch_size=256)
        failed = distribution.chi_square(counts, probs)
        assert not failed and failed.p_value < distribution.ALPHA
        assert "below the significance level" in failed.failures()[0]


def test_distribution_mode_for_reduced_precision(models):
    model, ort_model, reference, sources = models
    result = sampling.sampling_agreement(ort_model, reference, sources, settings_of(model.cfg), "fp16", draws=2000)
    assert result.mode == "distribution" and result.exact is None and result, result.failures()
    assert result.distribution.sources == sampling.SOURCES and result.distribution.draws == 2000
    assert result.distribution.null == "candidate" and 0 <= result.distribution.total_variation < 0.01


def test_reduced_precision_is_tested_against_its_own_probabilities(models):
    """A shifted distribution (as int8 shifts it) passes the candidate-null test and is reported as a total
    variation distance; against the eager null the same draws fail, which is why reduced precision is not judged
    there. A planted wrong temperature in the sampling still fails the candidate-null test."""
    model, ort_model, reference, sources = models
    settings = sampling.sampling_settings(settings_of(model.cfg), seed=2)
    shifted = Biased(ort_model, token=int(distribution.first_token_probs(reference, sources[:1], settings)[0].argmax()),
                     bias=-1.0)
    own = distribution.distributional_sampling(shifted, reference, sources[:4], settings, draws=2000, null="candidate")
    assert own and own.total_variation > 0.05, own
    eager = distribution.distributional_sampling(shifted, reference, sources[:4], settings, draws=2000, null="eager")
    assert not eager and eager.p_value < distribution.ALPHA
    probs = distribution.first_token_probs(ort_model, sources[:4], settings)
    wrong = replace(settings, temperature=settings.temperature * 1.25)
    counts = distribution.first_token_counts(ort_model, sources[:4], wrong, probs.shape[1], draws=2000)
    assert not distribution.chi_square(counts, probs)
    with pytest.raises(sampling.ConfigError, match="unknown null 'x'"):
        distribution.distributional_sampling(ort_model, reference, sources[:1], settings, draws=10, null="x")


def test_fast_sampling_draws_the_same_distribution_by_another_stream(models):
    """--fast-sampling (the inverse CDF, one uniform a row and step): its first tokens pass the chi-square test
    against the eager probabilities under the warpers, a planted wrong temperature fails it, a seed repeats its
    samples, and they are not transformers' stream's."""
    model, ort_model, reference, sources = models
    for options in ({}, {"temperature": 0.7, "top_k": 5}, {"temperature": 1.3, "top_p": 0.8, "top_k": 0}):
        settings = settings_of(model.cfg, do_sample=True, fast_sampling=True, **options)
        probs = distribution.first_token_probs(reference, sources[:4], settings)
        counts = distribution.first_token_counts(ort_model, sources[:4], settings, probs.shape[1], draws=2048)
        result = distribution.chi_square(counts, probs)
        assert result and result.impossible == 0, (options, result)
        wrong = replace(settings, temperature=settings.temperature * 1.25)
        failed = distribution.chi_square(distribution.first_token_counts(ort_model, sources[:4], wrong, probs.shape[1],
                                                                         draws=2048), probs)
        assert not failed, options
    ids, mask = pad_batch(sources[:12], model.cfg.pad_id)
    fast = settings_of(model.cfg, do_sample=True, fast_sampling=True, seed=4)
    first = greedy_decode(ort_model, ids, mask, fast)
    assert first == greedy_decode(ort_model, ids, mask, fast)
    assert first != greedy_decode(ort_model, ids, mask, replace(fast, fast_sampling=False))


def test_chi2_survival_function_against_closed_forms():
    for x in (0.1, 1.0, 3.841458820694124, 10.0, 40.0):
        assert distribution.chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-12)  # dof 2: exp(-x/2)
        assert distribution.chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-10)  # dof 1: erfc
        # dof 4: exp(-x/2) (1 + x/2)
        assert distribution.chi2_sf(x, 4) == pytest.approx(math.exp(-x / 2) * (1 + x / 2), rel=1e-12)
    assert distribution.chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)
    assert distribution.chi2_sf(math.inf, 3) == 0.0 and distribution.chi2_sf(5.0, 0) == 1.0


def test_rare_categories_are_pooled_and_impossible_tokens_counted():
    probs = np.array([[0.5, 0.3, 0.19, 0.006, 0.004, 0.0]])  # 1000 draws: expected 500, 300, 190, 6, 4, 0
    counts = np.array([[480, 310, 195, 9, 5, 1]])
    result = distribution.chi_square(counts, probs)
    # the pool of 4 and 0 (expected 4 < 5) joins the smallest category (6): 500, 300, 190, 10
    assert result.categories == 4 and result.dof == 3 and result.impossible == 1
    statistic = sum((o - e) ** 2 / e for o, e in ((480, 500), (310, 300), (195, 190), (15, 10)))
    assert result.statistic == pytest.approx(statistic)
    assert result.p_value == pytest.approx(distribution.chi2_sf(statistic, 3))
    wide = np.array([[0.96, 0.02, 0.006, 0.007, 0.007]])  # every category expected >= 5: nothing pooled ...
    assert distribution.chi_square(np.array([[960, 20, 6, 7, 7]]), wide).categories == 5
    rare = np.array([[0.97, 0.02, 0.003, 0.003, 0.004]])  # ... here 3, 3, 4 pool to 10 and stand alone
    assert distribution.chi_square(np.array([[970, 20, 3, 3, 4]]), rare).categories == 3
    tiny = np.array([[0.996, 0.002, 0.002]])  # a pool of 4 joins the only category left
    assert distribution.chi_square(np.array([[996, 2, 2]]), tiny).categories == 1
