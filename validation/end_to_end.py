"""End-to-end parity: greedy and beam decoding on a backend against the eager model, through the same loops.

Tokens: each backend decodes freely; `token_agreement` is the share of positions (eos included, up to the
longer of the two outputs) where the tokens are equal, `sequence_match` the share of identical outputs,
`first_divergent_step` the earliest step at which any output differs. Logits: `PairedStepModel` runs both
backends at every step but lets the reference choose the tokens, so `max_logit_abs_err` is measured along the
eager greedy path, at every step, even where free decoding would have diverged. The same is measured along the
eager beam search (`beam_max_logit_abs_err`) and reported without a target: beam rows include hypotheses of
very low probability (a bos or an unlikely word mid-sentence) where even eager fp32 drifts from float64 by
more than 1e-4 on the trained demo model.

Near-ties (greedy): a graph whose logits are off by at most e can flip a token wherever the eager model's top-1 /
top-2 margin is at most 2e (each logit may move by e, in opposite directions). A greedy divergence whose eager margin
at its first divergent step is within twice the greedy path's measured `max_logit_abs_err` is counted and reported
as a near-tie, with its margin, and left out of the agreement the targets judge; any other divergence still fails.

Near-ties (beam): a beam divergence is judged by the eager scores of what the two searches compared, against the
logit error measured along those hypotheses; `beam_ties` says how. Counted and reported like greedy's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np

from seq2trt.reference_model.decoding import DecodeSettings, StepHook, StepModel, beam_search, greedy_decode
from seq2trt.reference_model.vocab import pad_batch
from seq2trt.core.numerics import FP32_LOGIT_TOLERANCE, magnitude

from seq2trt.validation.ties import BEAM_ALPHA, beam_near_ties, beam_tracer, greedy_tie, near_tie_cap


@dataclass(frozen=True)
class EndToEndTargets:
    token_agreement: float
    sequence_match: float
    max_logit_abs_err: float | None  # None: reported, not judged


# Per dtype, as data. fp32 must reproduce the eager model's tokens, its logits within the graph-level fp32 bound.
# Reduced precision may flip a trained model's rare near-tie; its logit error is judged case by case at graph level
# (validation/precision.py), so here it is reported, and every divergence it cannot explain counts against the
# token targets.
TARGETS: dict[str, EndToEndTargets] = {
    "fp32": EndToEndTargets(token_agreement=1.0, sequence_match=1.0, max_logit_abs_err=FP32_LOGIT_TOLERANCE),
    "fp16": EndToEndTargets(token_agreement=0.99, sequence_match=0.97, max_logit_abs_err=None),
    "bf16": EndToEndTargets(token_agreement=0.97, sequence_match=0.90, max_logit_abs_err=None),
    "int8": EndToEndTargets(token_agreement=0.97, sequence_match=0.90, max_logit_abs_err=None),
}


class PairedStepModel:
    """Steps a candidate beside a reference, returns the reference's logits, records the largest |difference|."""

    def __init__(self, reference: StepModel, candidate: StepModel):
        self.reference, self.candidate = reference, candidate
        self.max_abs_err = 0.0
        self.magnitude = 1.0  # max(1, max |reference logit|): what the error is judged against (numerics.py)
        self.steps = 0

    def encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> tuple[Any, Any]:
        return self.reference.encode(input_ids, attention_mask), self.candidate.encode(input_ids, attention_mask)

    def empty_past(self, batch: int) -> tuple[Any, Any]:
        return self.reference.empty_past(batch), self.candidate.empty_past(batch)

    def step(self, input_ids, encoder_attention_mask, encoder_state, past) -> tuple[np.ndarray, tuple[Any, Any]]:
        ref_logits, ref_past = self.reference.step(input_ids, encoder_attention_mask, encoder_state[0], past[0])
        got_logits, got_past = self.candidate.step(input_ids, encoder_attention_mask, encoder_state[1], past[1])
        err = np.abs(got_logits.astype(np.float64) - ref_logits.astype(np.float64))
        self.max_abs_err = max(self.max_abs_err, float(np.nan_to_num(err, nan=np.inf).max(initial=0.0)))
        self.magnitude = max(self.magnitude, magnitude(ref_logits))
        self.steps += 1
        return ref_logits, (ref_past, got_past)

    def select(self, state, index: np.ndarray):
        return self.reference.select(state[0], index), self.candidate.select(state[1], index)


@dataclass
class SequenceAgreement:
    """How far a candidate's freely decoded sequences agree with the reference's, token by token."""

    samples: int
    token_agreement: float
    sequence_match: float
    first_divergent_step: int | None
    divergent_samples: list[int] = field(default_factory=list)  # indices, first 20
    divergent_steps: dict[int, int] = field(default_factory=dict, repr=False)  # every divergent sample's first step
    near_ties: int = 0  # divergences within the graphs' measured logit error of an eager tie
    # sample, step, eager margin (beam: also kind and tolerance; the margin is the eager score gap): first 20
    near_tie_examples: list[dict] = field(default_factory=list)
    judged_token_agreement: float | None = None  # without the near-tie samples: what the targets judge
    judged_sequence_match: float | None = None

    def judged(self) -> tuple[float, float]:
        return (self.token_agreement if self.judged_token_agreement is None else self.judged_token_agreement,
                self.sequence_match if self.judged_sequence_match is None else self.judged_sequence_match)

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "divergent_steps"}


def agreement(reference: list[list[int]], candidate: list[list[int]], eos_id: int,
              ignore: frozenset[int] = frozenset()) -> SequenceAgreement:
    """Token and sequence agreement over every sample but those in `ignore`."""
    matched = total = exact = counted = 0
    first: int | None = None
    divergent, steps = [], {}
    for i, (r, c) in enumerate(zip(reference, candidate)):
        if i in ignore:
            continue
        r, c = r + [eos_id], c + [eos_id]
        n = max(len(r), len(c))
        same = [k < len(r) and k < len(c) and r[k] == c[k] for k in range(n)]
        matched, total, counted = matched + sum(same), total + n, counted + 1
        if all(same):
            exact += 1
        else:
            step = same.index(False)
            first = step if first is None else min(first, step)
            divergent.append(i)
            steps[i] = step
    if ignore and not counted:  # every divergence was a near-tie: nothing left that disagrees
        return SequenceAgreement(0, 1.0, 1.0, None)
    return SequenceAgreement(counted, matched / max(total, 1), exact / max(counted, 1), first, divergent[:20], steps)


def with_near_ties(result: SequenceAgreement, reference: list[list[int]], candidate: list[list[int]], eos_id: int,
                   margins: dict[tuple[int, int], float], max_logit_abs_err: float) -> SequenceAgreement:
    """`result` with its near-ties counted (eager margin at the first divergent step <= 2 x the logit error) and
    the agreement recomputed without them for the targets."""
    ties = [{"sample": i, "step": step, "eager_margin": margins[i, step]}
            for i, step in sorted(result.divergent_steps.items())
            if (i, step) in margins and greedy_tie(margins[i, step], max_logit_abs_err)]
    return _judged_without(result, ties, reference, candidate, eos_id)


def _judged_without(result: SequenceAgreement, ties: list[dict], reference: list[list[int]],
                    candidate: list[list[int]], eos_id: int) -> SequenceAgreement:
    """`result` with `ties` (examples, one per sample) counted and the agreement recomputed without them."""
    if not ties:
        return result
    judged = agreement(reference, candidate, eos_id, frozenset(t["sample"] for t in ties))
    result.near_ties, result.near_tie_examples = len(ties), ties[:20]
    result.judged_token_agreement, result.judged_sequence_match = judged.token_agreement, judged.sequence_match
    return result


@dataclass
class EndToEndResult:
    dtype: str
    samples: int
    greedy: SequenceAgreement
    beam: SequenceAgreement
    beam_size: int
    max_logit_abs_err: float  # along the eager greedy path: the target
    beam_max_logit_abs_err: float  # along the eager beam search: reported
    targets: EndToEndTargets
    logit_magnitude: float = 1.0  # max(1, max |eager logit|) along the greedy path: the target scales with it
    # The task's own metric on the greedy outputs (held-out exact match for a task checkpoint), reference and
    # candidate: what the graphs' numerical error costs in the model's accuracy. Reported, not judged.
    task_metric: dict[str, float] | None = None

    @property
    def token_agreement(self) -> float:
        return min(self.greedy.token_agreement, self.beam.token_agreement)

    @property
    def sequence_match(self) -> float:
        return min(self.greedy.sequence_match, self.beam.sequence_match)

    def failures(self) -> list[str]:
        t, out = self.targets, []
        for name, a in (("greedy", self.greedy), ("beam", self.beam)):
            tokens, sequences = a.judged()
            if tokens < t.token_agreement or sequences < t.sequence_match:
                ties = f" (without {a.near_ties} near-tie(s))" if a.near_ties else ""
                out.append(f"end_to_end {name}: token_agreement {tokens:.6f}{ties} (target "
                           f">= {t.token_agreement}), sequence_match {sequences:.6f} (target >= "
                           f"{t.sequence_match}), first divergent step {a.first_divergent_step}, samples "
                           f"{a.divergent_samples}")
        bound = None if t.max_logit_abs_err is None else t.max_logit_abs_err * self.logit_magnitude
        if bound is not None and not self.max_logit_abs_err <= bound:
            out.append(f"end_to_end: max_logit_abs_err {self.max_logit_abs_err:.3g} along the eager greedy path "
                       f"(target <= {t.max_logit_abs_err:g} x the logits' magnitude {self.logit_magnitude:.3g} = "
                       f"{bound:.3g})")
        return out

    def __bool__(self) -> bool:
        return not self.failures()

    def to_dict(self) -> dict:
        return {"samples": self.samples, "token_agreement": self.token_agreement,
                "sequence_match": self.sequence_match, "max_logit_abs_err": self.max_logit_abs_err,
                "beam_max_logit_abs_err": self.beam_max_logit_abs_err, "logit_magnitude": self.logit_magnitude,
                "beam_size": self.beam_size, "greedy": self.greedy.to_dict(), "beam": self.beam.to_dict(),
                "targets": asdict(self.targets), "task_metric": self.task_metric, "passed": bool(self)}


Decoder = Callable[..., list[list[int]]]  # (model, ids, mask, hook or trace) -> each source's tokens


def _decode_all(model: StepModel, sources: list, decode: Decoder, batch_size: int,
                pad: Callable[[list], tuple[np.ndarray, np.ndarray]],
                on_step: Callable[[int], Any] | None = None) -> list[list[int]]:
    """Decode in batches (`pad`: the source kind's batch and mask); `on_step(offset)` makes the step hook (greedy)
    or the model wrapper (beam: `beam_ties.BeamTrace`) of the batch starting at source `offset`."""
    outputs: list[list[int]] = []
    for i in range(0, len(sources), batch_size):
        ids, mask = pad(sources[i: i + batch_size])
        outputs += decode(model, ids, mask, on_step(i) if on_step else None)
    return outputs


def _margin_recorder(settings: DecodeSettings, margins: dict[tuple[int, int], float]) -> Callable[[int], StepHook]:
    """Step hooks that record the eager top-1 / top-2 margin of every (source, step) of a greedy decode."""
    def for_batch(offset: int) -> StepHook:
        def record(step: int, rows: np.ndarray, logits: np.ndarray) -> None:
            scores = settings.constrain(logits, step) if settings.constrained else logits
            top2 = np.sort(scores.astype(np.float64), axis=-1)[:, -2:]
            for row, margin in zip(rows.tolist(), (top2[:, 1] - top2[:, 0]).tolist()):
                margins[offset + row, step] = margin
        return record
    return for_batch


def end_to_end(candidate: StepModel, reference: StepModel, sources: list, settings: DecodeSettings,
               dtype: str, beam_size: int = 4, batch_size: int = 100,
               progress: Callable[[str], None] | None = None,
               task_metric: tuple[str, Callable[[list[list[int]]], float]] | None = None,
               source_kind=None) -> EndToEndResult:
    """Greedy and beam decoding of `sources` (id lists, eos included; or what `source_kind` says a source is) on
    both models, compared. `dtype` names the TARGETS row; `task_metric` (name, score of the greedy outputs in source
    order) is reported for both. Beam near-ties re-score a source through the same `pad` (validation/ties.py)."""
    pad = source_kind.pad if source_kind is not None else (lambda batch: pad_batch(batch, settings.pad_id))
    greedy: Decoder = lambda m, ids, mask, hook: greedy_decode(m, ids, mask, settings, on_step=hook)
    beam: Decoder = lambda m, ids, mask, trace: beam_search(m if trace is None else trace(m), ids, mask, settings,
                                                            beam_size=beam_size, alpha=BEAM_ALPHA)
    agreements, max_err, scale, metric = {}, {}, {}, None
    for name, decode, size in (("greedy", greedy, batch_size), ("beam", beam, max(1, batch_size // beam_size))):
        if progress:
            progress(f"{name} decoding of {len(sources)} sources")
        paired, margins, traces = PairedStepModel(reference, candidate), {}, ({}, {})
        hooks = (_margin_recorder(settings, margins), None) if name == "greedy" else \
            tuple(beam_tracer(beam_size, settings.pad_id, t) for t in traces)
        want = _decode_all(paired, sources, decode, size, pad, hooks[0])  # the reference's tokens
        got = _decode_all(candidate, sources, decode, size, pad, hooks[1])
        agreements[name] = agreement(want, got, settings.eos_id)
        max_err[name], scale[name] = paired.max_abs_err, paired.magnitude
        if name == "greedy":
            agreements[name] = with_near_ties(agreements[name], want, got, settings.eos_id, margins, max_err[name])
        else:
            ties = beam_near_ties(agreements[name].divergent_steps, reference, candidate, sources, want, got,
                                  traces, settings, beam_size, near_tie_cap(dtype, TARGETS["fp32"].max_logit_abs_err),
                                  pad)
            agreements[name] = _judged_without(agreements[name], ties, want, got, settings.eos_id)
        if name == "greedy" and task_metric is not None:
            label, score = task_metric
            metric = {"name": label, "reference": score(want), "candidate": score(got)}
    return EndToEndResult(dtype, len(sources), agreements["greedy"], agreements["beam"], beam_size,
                          max_err["greedy"], max_err["beam"], TARGETS[dtype], scale["greedy"], metric)
