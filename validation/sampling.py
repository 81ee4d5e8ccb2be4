"""Sampling agreement: a backend's sampling (temperature, top-k, top-p) judged against the eager model's.

Exact (float32 graphs). The shared loop samples as Hugging Face does (`decoding._Sampler`): at every step the token
is argmax_v p_v / q_v, q ~ Exp(1) drawn for the whole original batch from one generator. Both models are decoded with
the same seed, so they see the same q, and their tokens must be equal. A graph whose logits are off by e can flip a
choice only where the eager model's decision was within what e can move: for two tokens r (the eager choice) and c
both kept by the warpers, log p_r - log p_c = (z_r - z_c) / T (the log-sum-exp cancels), so the eager margin
log(p_r / q_r) - log(p_c / q_c) moves by at most 2e / T, plus the float32 rounding of p and p / q on each side (8 unit
roundoffs). A divergence is a near-tie when, at its first divergent step, the candidate's token is the eager model's
runner-up there and that margin is within 2e / T + 8u, or when the candidate's logits kept another set of tokens than
the eager ones under top-k / top-p (a tie at the warpers' boundary); in both cases e, measured at that row and step
(the candidate stepped beside the eager model along the eager path), must be within what the precision's arithmetic
allows (`ties.near_tie_cap`): a larger error excuses nothing. Any other divergence fails.

Distributional (reduced precision, or any sampler with its own random stream: CTranslate2): the chi-square test of
first tokens in validation/sampling_distribution.py.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from seq2trt.reference_model.decoding import DecodeSettings, StepModel, greedy_decode
from seq2trt.core.errors import ConfigError
from seq2trt.validation.end_to_end import TARGETS
from seq2trt.validation.sampling_distribution import ALPHA, DRAWS, ChiSquare, distributional_sampling, padder
from seq2trt.validation.ties import Pad, near_tie_cap

SOURCES = 4  # sources of the distributional test (DRAWS draws each)
UNIT_ROUNDOFF32 = 2.0 ** -24


def sampling_settings(settings: DecodeSettings, seed: int = 0, **warpers: Any) -> DecodeSettings:
    """`settings` sampling one sequence a source with `seed`; `warpers` (temperature, top_k, top_p) override the
    model's own (its generation defaults, else Hugging Face's: temperature 1, top-k 50, top-p 1)."""
    return replace(settings, do_sample=True, seed=seed, num_return_sequences=1, output_scores=False, **warpers)


# -- exact: token for token under the same seed -------------------------------------------------------------------

@dataclass
class ExactSampling:
    """Sampled tokens of a candidate against the eager model's under the same seed."""

    sequences: int
    identical: int
    near_ties: int
    max_logit_abs_err: float  # along the eager sampled path
    mismatches: list[dict] = field(default_factory=list)  # first 20: sample, step, tokens, margin, error, tie

    @property
    def rate(self) -> float:
        return self.identical / self.sequences if self.sequences else 1.0

    def __bool__(self) -> bool:
        return self.identical + self.near_ties == self.sequences

    def failures(self) -> list[str]:
        if self:
            return []
        wrong = [m for m in self.mismatches if not m["tie"]][:5]
        return [f"sampling (exact, same seed): {self.sequences - self.identical - self.near_ties} of {self.sequences} "
                "sampled sequences differ from the eager model's beyond a near-tie (" +
                "; ".join(f"sample {m['sample']} step {m['step']}: eager {m['eager']}, candidate {m['candidate']}"
                          for m in wrong) + ")"]

    def to_dict(self) -> dict:
        return {**asdict(self), "rate": self.rate, "passed": bool(self)}


class _Beside:
    """Steps a candidate beside the reference along the reference's path: returns the reference's logits and keeps
    the candidate's of the last step (read by the step hook)."""

    def __init__(self, reference: StepModel, candidate: StepModel):
        self.reference, self.candidate = reference, candidate
        self.last_ids: np.ndarray | None = None
        self.candidate_logits: np.ndarray | None = None

    def encode(self, input_ids, attention_mask):
        return self.reference.encode(input_ids, attention_mask), self.candidate.encode(input_ids, attention_mask)

    def empty_past(self, batch: int):
        return self.reference.empty_past(batch), self.candidate.empty_past(batch)

    def step(self, input_ids, encoder_attention_mask, encoder_state, past):
        want, ref_past = self.reference.step(input_ids, encoder_attention_mask, encoder_state[0], past[0])
        got, cand_past = self.candidate.step(input_ids, encoder_attention_mask, encoder_state[1], past[1])
        self.last_ids, self.candidate_logits = input_ids, got
        return want, (ref_past, cand_past)

    def select(self, state, index):
        return self.reference.select(state[0], index), self.candidate.select(state[1], index)


class _Decisions:
    """A step hook on the eager sampled path: per (row, step) the eager runner-up by p / q, the margin to it, the
    candidate's logit error there and whether its warpers kept the same tokens. It draws q from its own generator,
    seeded as the search's, one (B, V) draw a step as the search draws them."""

    def __init__(self, beside: _Beside, settings: DecodeSettings, batch: int, seed: int):
        import torch

        self.beside, self.settings, self.batch = beside, settings, batch
        self.generator = torch.Generator().manual_seed(seed)
        self.generated: list[list[int]] = [[] for _ in range(batch)]
        self.previous_rows: np.ndarray | None = None
        # (row, step) -> (runner-up, margin, candidate |logit error|, same support, largest eager |logit|)
        self.found: dict[tuple[int, int], tuple[int, float, float, bool, float]] = {}

    def __call__(self, step: int, rows: np.ndarray, logits: np.ndarray) -> None:
        import torch

        s = self.settings
        if step > 0:  # the tokens the live rows chose last step: this step's input
            for row, token in zip(rows.tolist(), self.beside.last_ids[:, -1].tolist()):
                self.generated[row].append(token)
        got = self.beside.candidate_logits
        history = np.asarray([self.generated[r] for r in rows.tolist()], np.int64).reshape(len(rows), step) \
            if s.uses_history else None
        warped = [s.warp(torch.from_numpy(np.asarray(s.constrain(x, step, tokens=history), np.float32)))
                  for x in (logits, got)]
        q = torch.empty((self.batch, warped[0].shape[-1]), dtype=torch.float32).exponential_(1, generator=self.generator)
        score = torch.log_softmax(warped[0].double(), -1) - torch.log(q[torch.from_numpy(rows)].double())
        top2 = torch.topk(score, 2, dim=-1)
        err = np.abs(got.astype(np.float64) - logits.astype(np.float64)).max(-1)
        scale = np.abs(logits.astype(np.float64)).max(-1)
        same_support = (torch.isfinite(warped[0]) == torch.isfinite(warped[1])).all(-1).numpy()
        for i, row in enumerate(rows.tolist()):
            margin = float(top2.values[i, 0] - top2.values[i, 1])
            self.found[row, step] = (int(top2.indices[i, 1]), margin if math.isfinite(margin) else math.inf,
                                     float(err[i]), bool(same_support[i]), float(scale[i]))


def exact_sampling(candidate: StepModel, reference: StepModel, sources: list[list[int]], settings: DecodeSettings,
                   dtype: str = "fp32", batch_size: int = 32, seed: int = 0, pad: Pad | None = None) -> ExactSampling:
    """Sample `sources` (id lists, eos included) on both models with the same seed (`seed` + the batch's index) and
    compare token for token, near-ties (module docstring) counted apart."""
    if not settings.do_sample:
        raise ConfigError("exact_sampling compares sampled tokens; pass sampling settings (sampling_settings)")
    if settings.num_return_sequences != 1:
        raise ConfigError("exact_sampling compares one sample a source; use num_return_sequences 1")
    cap = near_tie_cap(dtype, TARGETS["fp32"].max_logit_abs_err)
    identical = ties = 0
    max_err, mismatches = 0.0, []
    for start in range(0, len(sources), batch_size):
        ids, mask = padder(pad, settings)(sources[start: start + batch_size])
        batch_seed = seed + start // batch_size
        beside = _Beside(reference, candidate)
        decisions = _Decisions(beside, settings, len(ids), batch_seed)
        want = greedy_decode(beside, ids, mask, replace(settings, seed=batch_seed), on_step=decisions)
        got = greedy_decode(candidate, ids, mask, replace(settings, seed=batch_seed))
        max_err = max([max_err] + [found[2] for found in decisions.found.values()])
        for row, (w, g) in enumerate(zip(want, got)):
            if w == g:
                identical += 1
                continue
            w_end, g_end = w + [settings.eos_id], g + [settings.eos_id]
            step = next(t for t in range(min(len(w_end), len(g_end))) if w_end[t] != g_end[t])
            runner_up, margin, err, same_support, scale = decisions.found[row, step]
            allowed = cap[0] + cap[1] * scale  # what the precision's arithmetic allows there
            tolerance = 2 * err / settings.temperature + 8 * UNIT_ROUNDOFF32
            tie = err <= allowed and (not same_support or (g_end[step] == runner_up and margin <= tolerance))
            ties += tie
            mismatches.append({"sample": start + row, "step": step, "eager": w_end[step], "candidate": g_end[step],
                               "eager_margin": margin, "tolerance": tolerance, "logit_abs_err": err,
                               "same_support": same_support, "tie": tie})
    return ExactSampling(len(sources), identical, ties, max_err, mismatches[:20])


# -- both, as validate reports them -------------------------------------------------------------------------------

@dataclass
class SamplingAgreement:
    """Sampling of a candidate against the eager model: exact on float32 graphs, distributional otherwise."""

    dtype: str
    mode: str  # "exact" or "distribution"
    temperature: float
    top_k: int
    top_p: float
    seed: int
    exact: ExactSampling | None = None
    distribution: ChiSquare | None = None

    def failures(self) -> list[str]:
        return [f for part in (self.exact, self.distribution) if part is not None for f in part.failures()]

    def __bool__(self) -> bool:
        return not self.failures()

    def to_dict(self) -> dict:
        return {"dtype": self.dtype, "mode": self.mode, "temperature": self.temperature, "top_k": self.top_k,
                "top_p": self.top_p, "seed": self.seed,
                "exact": None if self.exact is None else self.exact.to_dict(),
                "distribution": None if self.distribution is None else self.distribution.to_dict(),
                "passed": bool(self)}


def sampling_summary(doc: dict | None) -> str:
    """One clause for a command's summary line from a SamplingAgreement's to_dict ("" without one)."""
    if not doc:
        return ""
    if doc.get("exact"):
        e = doc["exact"]
        return f"sampling {e['identical']}/{e['sequences']} identical under one seed ({e['near_ties']} near-ties)"
    d = doc["distribution"]
    return f"sampling chi-square p-value {d['p_value']:.3g} ({d['draws']} draws x {d['sources']} sources)"


def sampling_agreement(candidate: StepModel, reference: StepModel, sources: list[list[int]],
                       settings: DecodeSettings, dtype: str, batch_size: int = 32, seed: int = 0,
                       mode: str | None = None, draws: int = DRAWS, alpha: float = ALPHA,
                       pad: Pad | None = None) -> SamplingAgreement:
    """Judge the candidate's sampling (`settings` made to sample with `seed`: the model's own warpers, else Hugging
    Face's defaults) on `sources`: `mode` "exact" (token for token, near-ties apart) on every source, or
    "distribution" (the chi-square test on the first SOURCES sources, `draws` each); None: exact for fp32,
    distribution otherwise."""
    mode = mode or ("exact" if dtype == "fp32" else "distribution")
    if mode not in ("exact", "distribution"):
        raise ConfigError(f"unknown sampling agreement mode {mode!r}; choose exact or distribution")
    sampled = sampling_settings(settings, seed)
    result = SamplingAgreement(dtype, mode, sampled.temperature, sampled.top_k, sampled.top_p, seed)
    if mode == "exact":
        result.exact = exact_sampling(candidate, reference, sources, sampled, dtype, batch_size, seed, pad)
    else:
        result.distribution = distributional_sampling(candidate, reference, sources[:SOURCES], sampled, draws, seed,
                                                      alpha, pad, null="eager" if dtype == "fp32" else "candidate")
    return result
