"""The bench's two summaries of timed repetitions: percentiles in ms, and paired speed ratios."""

from __future__ import annotations

import numpy as np


def stats_ms(seconds: list[float]) -> dict[str, float]:
    """p50 / p90 / p99 of `seconds`, in ms ({} for none)."""
    ms = np.asarray(seconds, dtype=np.float64) * 1e3
    return {f"p{q}": round(float(np.percentile(ms, q)), 4) for q in (50, 90, 99)} if len(ms) else {}


def paired_ratio(reference_seconds: list[float] | None, seconds: list[float]) -> float | None:
    """Speed of a backend relative to a reference (> 1: faster): the median over repetitions of the ratio of the
    two times measured in the same repetition, so a load spike that slows one round slows both sides of its pair."""
    if reference_seconds is None or not len(reference_seconds):  # a list, or an array of per-repetition sums
        return None
    return round(float(np.median(np.asarray(reference_seconds) / np.asarray(seconds))), 4)
