"""Comparison statistics and tolerances, on arrays whose answers are known by hand."""

from __future__ import annotations

import numpy as np
import pytest

from seq2trt.validation.parity import TOLERANCES, Tolerance, compare_output, tolerance_for
from seq2trt.validation.end_to_end import agreement

TOL = Tolerance(atol=1e-3, rtol=0.0, min_cosine=0.99)


def test_statistics_by_hand():
    ref = np.array([1.0, -2.0, 3.0, 0.0])
    got = ref + np.array([0.0, 5e-4, -2e-3, 0.0])
    stats = compare_output("x", got.astype(np.float32), ref, TOL)
    assert stats.max_abs == pytest.approx(2e-3, rel=1e-4)
    assert stats.mean_abs == pytest.approx(2.5e-3 / 4, rel=1e-4)
    assert stats.violations == 1 and not stats
    assert stats.max_rel == pytest.approx(2e-3 / 3, rel=1e-3)
    assert compare_output("x", ref, ref, TOL) and compare_output("x", ref, ref, TOL).cosine == pytest.approx(1.0)


def test_nan_and_inf_fail_even_within_tolerance():
    ref = np.ones(4)
    for bad in (np.nan, np.inf):
        got = ref.copy()
        got[2] = bad
        stats = compare_output("x", got, ref, Tolerance(atol=1e9, rtol=1e9, min_cosine=-1))
        assert not stats and (stats.nan or stats.inf)


def test_low_cosine_fails():
    ref = np.array([1.0, 0.0])
    assert not compare_output("x", np.array([0.0, 1.0]), ref, Tolerance(atol=10, rtol=0, min_cosine=0.5))


def test_tolerances_are_data_per_dtype():
    assert tolerance_for("fp32", "logits") is TOLERANCES["fp32"]["*"]
    assert tolerance_for("fp32", "logits").atol <= 1e-4  # the target
    assert tolerance_for("fp16", "logits").atol < tolerance_for("bf16", "logits").atol


def test_agreement_counts_positions_and_the_first_divergence():
    eos = 2
    ref = [[5, 6, 7], [5, 6], [9]]
    got = [[5, 6, 7], [5, 8], [9, 9]]
    a = agreement(ref, got, eos)
    # positions (eos appended): 4/4, then [5,6,eos] vs [5,8,eos] 2/3, then [9,eos] vs [9,9,eos] 1/3
    assert a.token_agreement == pytest.approx(7 / 10)
    assert a.sequence_match == pytest.approx(1 / 3)
    assert a.first_divergent_step == 1 and a.divergent_samples == [1, 2]
    assert agreement(ref, ref, eos).token_agreement == 1.0 and agreement(ref, ref, eos).first_divergent_step is None
