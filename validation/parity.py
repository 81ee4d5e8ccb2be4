"""Graph-level parity: every output of a graph under test against the float64 eager model, over the spec's sweep.

Inputs are realistic, not noise: the cross K/V come from the reference encoder on a random (padded) source and
the past from a reference prefill of past_len random tokens; they are rounded to the graph's dtype and the
reference replays the rounded values in float64. Statistics per output: max abs, max rel (|d| / (|ref| + 1e-6)),
mean abs, 99th percentile of |d|, cosine similarity, NaN/Inf counts. Tolerances are data (`TOLERANCES`): an
output passes when |d| <= atol + rtol * |ref| everywhere, cosine >= min_cosine, its RMS error is within bound and
nothing is NaN/Inf. A `Judge` decides how a case is compared: fp32 graphs at the fp32 tolerances; reduced-precision
graphs by bounds made for the case from the arithmetic (validation/precision.py).
"""

from __future__ import annotations

import contextlib
import fnmatch
from dataclasses import asdict, dataclass, field
from typing import Mapping, Protocol

import numpy as np

from seq2trt.exporters import spec
from seq2trt.reference_model.sources import random_target_ids, source_kind
from seq2trt.core.errors import ArtifactError
from seq2trt.core.numerics import FP32_LOGIT_TOLERANCE, magnitude

from seq2trt.runtime.runners import Runner


@dataclass(frozen=True)
class Tolerance:
    """An output passes when |d| <= atol * scale + rtol * |ref| everywhere, its cosine >= min_cosine and its
    root-mean-square error <= max_rms; `basis` says where a bound made for the case came from. `scaled`: scale is
    the reference's magnitude max(1, max |ref|), as the import's proof measures its error (reference_model/
    numerics.py: float32 rounding is relative to the magnitude of the sums); else 1."""

    atol: float
    rtol: float
    min_cosine: float
    max_rms: float = float("inf")
    basis: str = ""
    scaled: bool = False

    def bound(self, reference: np.ndarray) -> float:
        """The absolute part of the bound for this reference output."""
        return self.atol * (magnitude(reference) if self.scaled else 1.0)


# fp32 meets 1e-4 of the reference's magnitude on logits (the import's bound: core/numerics.py), far above
# float32 arithmetic's own error on these models (about 1e-6). Reduced
# precision is judged case by case (validation/precision.py): by these same bounds for what float32 arithmetic
# must reproduce exactly (an fp16/bf16 graph's fp32 twin, an int8 graph against the reference that quantizes as it
# does), and by a bound made from the eager model's own error in that precision.
TOLERANCES: dict[str, dict[str, Tolerance]] = {
    "fp32": {"*": Tolerance(atol=FP32_LOGIT_TOLERANCE, rtol=1e-4, min_cosine=0.99999, scaled=True)},
}
REPORTED = Tolerance(atol=float("inf"), rtol=0.0, min_cosine=-1.0, basis="reported, not judged")


def tolerance_for(dtype: str, output: str) -> Tolerance:
    table = TOLERANCES[dtype]
    return next((t for pattern, t in table.items() if pattern != "*" and fnmatch.fnmatch(output, pattern)), table["*"])


@dataclass(frozen=True)
class OutputStats:
    name: str
    shape: tuple[int, ...]
    max_abs: float
    max_rel: float
    mean_abs: float
    p99_abs: float
    cosine: float
    rms: float
    nan: int
    inf: int
    violations: int  # elements outside atol + rtol * |ref|
    tolerance: Tolerance

    @property
    def passed(self) -> bool:
        if self.tolerance == REPORTED:
            return True
        return (self.violations == 0 and self.nan == 0 and self.inf == 0 and self.cosine >= self.tolerance.min_cosine
                and self.rms <= self.tolerance.max_rms)

    def __bool__(self) -> bool:
        return self.passed

    def to_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def compare_output(name: str, candidate: np.ndarray, reference: np.ndarray, tolerance: Tolerance) -> OutputStats:
    if candidate.shape != reference.shape:
        raise ArtifactError(f"{name}: the graph's output shape {candidate.shape} differs from the reference's "
                            f"{reference.shape}: it does not follow the graph contract; re-export (and re-fuse)")
    c, r = candidate.astype(np.float64).ravel(), reference.astype(np.float64).ravel()
    nan, inf = int(np.isnan(c).sum()), int(np.isinf(c).sum())
    d = np.abs(c - r)
    if d.size == 0:
        return OutputStats(name, candidate.shape, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, nan, inf, 0, tolerance)
    finite = np.isfinite(d)
    absolute = tolerance.bound(r)
    violations = int((~finite).sum() + (d[finite] > absolute + tolerance.rtol * np.abs(r[finite])).sum())
    norms = np.linalg.norm(c[finite]) * np.linalg.norm(r[finite])
    cosine = float(np.dot(c[finite], r[finite]) / norms) if norms > 0 else float(np.array_equal(c, r))
    # Nothing finite to measure (NaN or inf everywhere): the counts and violations above carry the failure.
    d_f, r_f = (d[finite], r[finite]) if finite.any() else (np.zeros(1), np.ones(1))
    return OutputStats(name, tuple(candidate.shape), float(d_f.max()), float((d_f / (np.abs(r_f) + 1e-6)).max()),
                       float(d_f.mean()), float(np.percentile(d_f, 99)), cosine, float(np.sqrt(np.mean(d_f ** 2))),
                       nan, inf, violations, tolerance)


@dataclass
class CaseResult:
    graph: str
    case: str
    outputs: list[OutputStats]

    def __bool__(self) -> bool:
        return all(self.outputs)


@dataclass
class GraphParity:
    """Every case of every graph; truthy when all pass."""

    dtype: str
    cases: list[CaseResult] = field(default_factory=list)

    def __bool__(self) -> bool:
        return all(self.cases)

    def failures(self) -> list[str]:
        return [f"{c.graph} {c.case} {o.name}: max_abs {o.max_abs:.3g} (atol {o.tolerance.atol:.3g}"
                + (" x the reference's magnitude" if o.tolerance.scaled else "") + ", rtol "
                f"{o.tolerance.rtol:g}, {o.violations} elements over), "
                + (f"rms {o.rms:.3g} (max {o.tolerance.max_rms:.3g}), " if o.tolerance.max_rms < float("inf") else "")
                + (f"cosine {o.cosine:.6f} (min {o.tolerance.min_cosine}), " if o.tolerance.min_cosine > -1 else "")
                + f"nan {o.nan}, inf {o.inf}" + (f" [{o.tolerance.basis}]" if o.tolerance.basis else "")
                for c in self.cases for o in c.outputs if not o]

    def summary(self) -> dict[str, dict[str, dict]]:
        """graph -> output -> worst statistics over the cases (and how many cases failed)."""
        table: dict[str, dict[str, dict]] = {}
        for case in self.cases:
            for o in case.outputs:
                row = table.setdefault(case.graph, {}).setdefault(o.name, {
                    "max_abs": 0.0, "max_rel": 0.0, "mean_abs": 0.0, "p99_abs": 0.0, "rms": 0.0, "min_cosine": 1.0,
                    "nan": 0, "inf": 0, "cases": 0, "failed_cases": [], "tolerance": asdict(o.tolerance)})
                for key in ("max_abs", "max_rel", "mean_abs", "p99_abs", "rms"):
                    row[key] = max(row[key], getattr(o, key))
                row["min_cosine"] = min(row["min_cosine"], o.cosine)
                if o.tolerance.rtol == 0 and o.tolerance.atol > 0 and o.tolerance.max_rms < float("inf"):
                    # a bound made for each case: how close the worst case came to it (1 = at the bound)
                    used = max(o.max_abs / o.tolerance.atol, o.rms / o.tolerance.max_rms)
                    row["worst_fraction_of_bound"] = max(row.get("worst_fraction_of_bound", 0.0), used)
                row["nan"] += o.nan
                row["inf"] += o.inf
                row["cases"] += 1
                if not o:
                    row["failed_cases"].append(case.case)
        return table


def _round(feed: Mapping[str, np.ndarray], dtype: np.dtype) -> dict[str, np.ndarray]:
    return {k: v if v.dtype == np.int64 else v.astype(dtype) for k, v in feed.items()}


def case_feeds(reference_encoder: Runner, reference_decoder: Runner, case: spec.ShapeCase, dtype: str,
               rng: np.random.Generator) -> tuple[dict, dict]:
    """The encoder and decoder feeds of one case, in the graph's dtype (module docstring)."""
    cfg = reference_decoder.cfg
    sources = source_kind(cfg)
    ids, mask = sources.random_batch(rng, case.batch, case.src_len, case.padded)
    np_dtype = spec.numpy_dtype(dtype)
    encoder_feed = _round(sources.feed(ids, mask), np_dtype)  # audio features in the graph's dtype, ids as they are
    enc = reference_encoder.infer(encoder_feed)
    cross = spec.kv_feed(cfg, "encoder", enc)
    empty = np.zeros((case.batch, cfg.num_heads, 0, cfg.head_dim))
    past = dict.fromkeys(spec.kv_names(cfg, "decoder", "past"), empty)
    if case.past_len:
        prefix = random_target_ids(cfg, rng, (case.batch, case.past_len))
        prefix[:, 0] = cfg.bos_id
        out = reference_decoder.infer({"input_ids": prefix, "encoder_attention_mask": mask, **cross, **past})
        past = spec.kv_feed(cfg, "decoder", out)
    new = random_target_ids(cfg, rng, (case.batch, case.tgt_len))
    decoder_feed = {"input_ids": new, "encoder_attention_mask": mask, **cross, **past}
    return encoder_feed, _round(decoder_feed, np_dtype)


def compare_graph(candidate: Runner, reference: Runner, feed: Mapping[str, np.ndarray], case: str) -> CaseResult:
    """Every output of `candidate` against `reference` at the fp32 tolerances."""
    got, want = candidate.infer(feed), reference.infer(feed)
    outputs = [compare_output(name, got[name], want[name], tolerance_for("fp32", name)) for name in want]
    return CaseResult(candidate.kind.value, case, outputs)


class Judge(Protocol):
    """How one graph set's cases are compared (validation/precision.py has the reduced-precision ones); entered as
    a context manager around the sweep, for the runners it keeps."""

    def compare(self, index: int, candidate: Runner, reference: Runner, feed: Mapping[str, np.ndarray],
                case: str) -> CaseResult: ...


class Fp32Judge(contextlib.nullcontext):
    def compare(self, index, candidate, reference, feed, case) -> CaseResult:
        return compare_graph(candidate, reference, feed, case)


def graph_parity(candidates: tuple[Runner, Runner], references: tuple[Runner, Runner],
                 cases: list[spec.ShapeCase], seed: int = 0, judge: Judge | None = None) -> GraphParity:
    """Encoder and decoder graphs over `cases`; runners must be active. references: float64 eager runners.
    `judge`: how a case is compared (default: every output at the fp32 tolerances; see validation/precision.py
    for fp16, bf16 and int8 graphs)."""
    rng = np.random.default_rng(seed)
    result = GraphParity(candidates[1].dtype)
    judge = judge or Fp32Judge()
    seen_sources = set()
    with judge:
        for case in cases:
            encoder_feed, decoder_feed = case_feeds(references[0], references[1], case, result.dtype, rng)
            source_key = (case.batch, case.src_len, case.padded)
            if source_key not in seen_sources:
                seen_sources.add(source_key)
                label = f"B{case.batch}-S{case.src_len}{'-pad' if case.padded else ''}"
                result.cases.append(judge.compare(0, candidates[0], references[0], encoder_feed, label))
            result.cases.append(judge.compare(1, candidates[1], references[1], decoder_feed, case.label))
    return result
