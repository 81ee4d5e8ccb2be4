"""The distributional half of the sampling agreement (validation/sampling.py has the exact one and the verdict).

Used on reduced precision and on any sampler with its own random stream (CTranslate2): the first sampled token
of a few sources, drawn thousands of times, against a model's probabilities with the same rules and warpers applied.
A float32 candidate is tested against the eager model's probabilities. A reduced-precision one samples, by design,
from probabilities its logit error moved (int8 by far more than fp16), and thousands of draws detect shifts that
small: there the null is the candidate's own probabilities (its logits at that step, warped and softmaxed in float64
as for the eager ones), which tests its sampling (the loop, the warpers, the random stream) on its graphs; how far
those probabilities are from the eager ones is the logit error that graph-level and end-to-end parity judge, and the
total variation distance between the two is reported beside. The test is Pearson's chi-square test, categories whose
expected count is below 5 pooled into one (an impossible token, p = 0, lands in that pool; a pool still under 5
joins the smallest category), the statistic summed over sources with sum(categories - 1) degrees of freedom. It
fails when the p-value is below the significance level `alpha` (1e-6 by default): the bound is the test's
arithmetic, not a figure fitted to a model. A model whose first token is forced (forced bos) is judged on the token
after it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import numpy as np

from seq2trt.core.errors import ConfigError
from seq2trt.reference_model.decoding import DecodeSettings, StepModel, greedy_decode
from seq2trt.reference_model.vocab import pad_batch
from seq2trt.validation.ties import Pad

# The chi-square test's significance level: the chance that a correct sampler fails is alpha, for any model (a demo
# model trained on another CPU is another draw of it), so it is small; a temperature 5% off still fails a trained
# demo model at p ~ 1e-27 with DRAWS draws of each of 4 sources (validation/sampling.SOURCES).
ALPHA = 1e-6
MIN_EXPECTED = 5.0  # categories expected fewer times are pooled (the usual rule for Pearson's test)
DRAWS = 4000  # first tokens drawn per source by the distributional test


def padder(pad: Pad | None, settings: DecodeSettings) -> Pad:
    """`pad`, or padding to `settings.pad_id` when none is given."""
    return pad if pad is not None else (lambda batch: pad_batch(batch, settings.pad_id))


# -- distributional: a chi-square test of first tokens ---------------------------------------------------------------

@dataclass
class ChiSquare:
    """Pearson's chi-square test of sampled first tokens against the eager model's probabilities."""

    sources: int
    draws: int  # per source
    statistic: float
    dof: int
    p_value: float
    alpha: float
    categories: int  # after pooling, over every source
    impossible: int  # draws of tokens the null gives probability 0 (under its rules and warpers)
    null: str = "eager"  # whose probabilities the draws are tested against: "eager", or the "candidate"'s own
    total_variation: float | None = None  # worst source's TV distance, candidate vs eager probabilities (reported)

    def __bool__(self) -> bool:
        return self.p_value >= self.alpha

    def failures(self) -> list[str]:
        if self:
            return []
        return [f"sampling (chi-square of first tokens): p-value {self.p_value:.3g} below the significance level "
                f"{self.alpha:g} (statistic {self.statistic:.1f} on {self.dof} degrees of freedom, {self.draws} draws "
                f"of each of {self.sources} sources, {self.impossible} draws of tokens of probability 0)"]

    def to_dict(self) -> dict:
        return {**asdict(self), "passed": bool(self)}


def chi2_sf(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X ~ chi-square(dof): the regularized upper incomplete gamma Q(dof / 2, statistic / 2)
    (torch.special.gammaincc; scipy is not a dependency)."""
    import torch

    if dof < 1:
        return 1.0
    if not math.isfinite(statistic):
        return 0.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def chi_square(counts: np.ndarray, probs: np.ndarray, alpha: float = ALPHA) -> ChiSquare:
    """The test of `counts` (S, V: each source's draws per token) against `probs` (S, V: the eager probabilities)."""
    counts, probs = np.asarray(counts, np.float64), np.asarray(probs, np.float64)
    if counts.shape != probs.shape or counts.ndim != 2:
        raise ValueError(f"counts and probabilities must both be (sources, vocabulary), got {counts.shape} and "
                         f"{probs.shape}")
    statistic, dof, categories, impossible = 0.0, 0, 0, 0
    for observed, p in zip(counts, probs):
        n = observed.sum()
        expected = n * p / p.sum()
        impossible += int(observed[p <= 0].sum())
        big = expected >= MIN_EXPECTED
        o, e = list(observed[big]), list(expected[big])
        pooled_o, pooled_e = observed[~big].sum(), expected[~big].sum()
        if pooled_e >= MIN_EXPECTED or not e:
            o, e = o + [pooled_o], e + [pooled_e]
        else:  # a pool still under 5 joins the smallest category
            smallest = int(np.argmin(e))
            o[smallest] += pooled_o
            e[smallest] += pooled_e
        o, e = np.asarray(o), np.asarray(e)
        with np.errstate(divide="ignore", invalid="ignore"):
            terms = np.where(e > 0, (o - e) ** 2 / e, np.where(o > 0, np.inf, 0.0))
        statistic += float(terms.sum())
        dof += len(o) - 1
        categories += len(o)
    return ChiSquare(len(counts), int(counts.sum(1).max(initial=0)), statistic, dof, chi2_sf(statistic, dof), alpha,
                     categories, impossible)


def first_free_step(settings: DecodeSettings) -> DecodeSettings:
    """One-step settings whose token is the first one the model's rules do not force: a forced bos joins the prompt,
    and no forced eos at the one-token limit."""
    one = replace(settings, max_new_tokens=1, forced_eos=False, num_return_sequences=1, output_scores=False)
    if settings.forced_bos_id is not None:
        one = replace(one, prompt=settings.prompt + (settings.forced_bos_id,), forced_bos_id=None, begin_suppress_ids=())
    return one


def first_token_probs(reference: StepModel, sources: list[list[int]], settings: DecodeSettings,
                      pad: Pad | None = None) -> np.ndarray:
    """(S, V) float64: the eager model's probabilities of the first free token of each source, its rules and the
    sampling warpers applied as the search applies them (float32 warpers, then a float64 softmax)."""
    import torch

    one = first_free_step(settings)
    rows = []
    for source in sources:
        ids, mask = padder(pad, one)([source])
        state = reference.encode(ids, mask)
        logits, _ = reference.step(np.asarray([one.start], np.int64), mask, state, reference.empty_past(1))
        warped = one.warp(torch.from_numpy(np.asarray(one.constrain(logits, 0), np.float32)))
        rows.append(torch.softmax(warped.double(), -1)[0].numpy())
    return np.stack(rows)


class _OneSource:
    """A step model over `batch` copies of one source whose graphs run once: the source's encoder state and first
    step on one row, those logits given to every row. A graph's output for a source does not depend on its copies
    (graph-level parity judges the logits, at every batch size); what the draws test is the loop, the warpers and
    the random stream, which run on all the rows. So thousands of draws cost one encode and one step a source,
    not one per `batch_size` draws."""

    def __init__(self, model: StepModel):
        self.model, self.state, self.logits = model, None, None

    def encode(self, input_ids, attention_mask):
        if self.state is None:
            self.state = self.model.encode(input_ids[:1], attention_mask[:1])
        return len(input_ids)

    def empty_past(self, batch: int):
        return batch

    def step(self, input_ids, encoder_attention_mask, rows: int, past):
        if self.logits is None:
            self.logits, _ = self.model.step(input_ids[:1], encoder_attention_mask[:1], self.state,
                                             self.model.empty_past(1))
        return np.repeat(np.asarray(self.logits), rows, 0), past

    def select(self, state, index):
        return len(index)


def first_token_counts(model: StepModel, sources: list[list[int]], settings: DecodeSettings, vocab_size: int,
                       draws: int = DRAWS, batch_size: int = 256, seed: int = 0, pad: Pad | None = None) -> np.ndarray:
    """(S, V): `draws` first free tokens of each source sampled by the shared loop with `settings`' warpers, on
    `model`'s first-step logits of the source (computed once, `_OneSource`), `batch_size` rows a call, one
    generator seeded with `seed`."""
    import torch

    one = first_free_step(replace(settings, do_sample=True, seed=seed))
    generator = torch.Generator().manual_seed(seed)
    counts = np.zeros((len(sources), vocab_size), np.int64)
    for s, source in enumerate(sources):
        repeated = _OneSource(model)
        for start in range(0, draws, batch_size):
            ids, mask = padder(pad, one)([source] * min(batch_size, draws - start))
            tokens = greedy_decode(repeated, ids, mask, one, generator=generator)
            np.add.at(counts[s], [t[0] if t else one.eos_id for t in tokens], 1)  # an empty output: eos sampled
    return counts


def distributional_sampling(candidate: StepModel, reference: StepModel, sources: list[list[int]],
                            settings: DecodeSettings, draws: int = DRAWS, seed: int = 0, alpha: float = ALPHA,
                            pad: Pad | None = None, null: str = "eager") -> ChiSquare:
    """The chi-square test of the candidate's sampled first tokens of `sources` against the eager probabilities, or
    (`null` "candidate") against the candidate's own, its distance from the eager ones reported beside."""
    if null not in ("eager", "candidate"):
        raise ConfigError(f"unknown null {null!r} of the chi-square test; choose eager or candidate")
    probs = first_token_probs(reference, sources, settings, pad)
    own = first_token_probs(candidate, sources, settings, pad)
    counts = first_token_counts(candidate, sources, settings, probs.shape[1], draws, seed=seed, pad=pad)
    result = chi_square(counts, own if null == "candidate" else probs, alpha)
    result.null = null
    result.total_variation = float(0.5 * np.abs(own - probs).sum(1).max(initial=0.0))
    return result
