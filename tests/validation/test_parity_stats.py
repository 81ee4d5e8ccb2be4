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
    assert tolerance_for("fp32", "logits").atol <= 1e-4  # fp32 logits agree to 1e-4 or better
    assert set(TOLERANCES) == {"fp32"}  # reduced precision gets bounds made for each case (precision.py)


def test_reduced_precision_bounds_scale_with_the_case():
    """The precision bound is the eager model's own error in that dtype times the factors, floored at one rounding
    of the output: a case whose numbers are 1000x larger gets a 1000x larger bound."""
    from seq2trt.validation.precision import MAX_FACTOR, RMS_FACTOR, UNIT_ROUNDOFF, noise_tolerance

    rng = np.random.default_rng(0)
    ref = rng.normal(size=1000)
    peer = ref + rng.normal(scale=1e-3, size=1000)
    small, large = noise_tolerance(ref, peer, "fp16"), noise_tolerance(1000 * ref, 1000 * peer, "fp16")
    assert large.atol == pytest.approx(1000 * small.atol) and large.max_rms == pytest.approx(1000 * small.max_rms)
    assert small.max_rms == pytest.approx(RMS_FACTOR * np.sqrt(np.mean((peer - ref) ** 2)))
    assert small.atol == pytest.approx(MAX_FACTOR * np.abs(peer - ref).max())
    exact = noise_tolerance(ref, ref, "bf16")  # a peer that happens to be exact: one rounding of the output
    assert exact.max_rms == pytest.approx(RMS_FACTOR * UNIT_ROUNDOFF["bf16"] * np.sqrt(np.mean(ref ** 2)))
    over = ref + 1.01 * exact.max_rms  # an error over the RMS bound fails though every element is within atol
    stats = compare_output("x", over, ref, exact)
    assert stats.max_abs <= exact.atol and not stats


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


def _large_logits(seed: int = 0, scale: float = 4000.0):
    """Logits of a large-activation model computed in float64 (the truth) and in float32 (its rounding alone): a
    product of d = 512 terms whose result reaches the thousands, small entries among them."""
    rng = np.random.default_rng(seed)
    hidden, weight = rng.normal(0, scale, (64, 512)), rng.normal(0, 0.05, (512, 1000))
    return (hidden.astype(np.float32) @ weight.astype(np.float32)).astype(np.float64), hidden @ weight


def test_validate_and_the_import_judge_float32_rounding_alike():
    """An fp32 export of a large-activation model passed the import's proof (1e-4 of the logits' magnitude) and
    failed validate (1e-4 absolute + 1e-4 relative elementwise, which a small logit beside large ones cannot meet
    through float32 rounding alone). Both now bound the error by 1e-4 of the reference's magnitude."""
    from seq2trt.hf_import.proof import LOGIT_TOLERANCE
    from seq2trt.core.numerics import scaled_error
    from seq2trt.validation.end_to_end import TARGETS, EndToEndResult, SequenceAgreement

    got, ref = _large_logits()
    err, scaled = scaled_error(got, ref)
    assert err > 1e-4 and scaled <= LOGIT_TOLERANCE  # the import's judge passes it; the old absolute bound did not
    assert compare_output("logits", got, ref, tolerance_for("fp32", "logits"))
    bound = LOGIT_TOLERANCE * np.abs(ref).max()
    assert not compare_output("logits", ref + 2 * bound, ref, tolerance_for("fp32", "logits"))  # past it: refused
    same = SequenceAgreement(8, 1.0, 1.0, None)
    result = EndToEndResult("fp32", 8, same, same, 4, err, err, TARGETS["fp32"], float(np.abs(ref).max()))
    assert not result.failures()
    assert EndToEndResult("fp32", 8, same, same, 4, err, err, TARGETS["fp32"], 1.0).failures()
