"""Near-ties: whether a candidate that parted from the eager model did so where its own error could have moved the
choice. Every rule lives here: greedy (`greedy_tie`, and `compare_greedy` for the baselines' greedy tokens), the
cap on the error a tie may rest on (`near_tie_cap`), and beam search (`beam_near_ties`, below).

Beam near-ties: whether a beam search that parted from the eager one did so on a tie.

A beam's choices compare cumulative log-probabilities, so a reviewer asks whether the scores the
search compared are within what the graphs' error could move. If every logit moves by at most e, a token's
log-probability (logit minus log-sum-exp) moves by at most 2e, and a sum over n tokens by at most 2en; tokens two
hypotheses share (a common prefix) move both sums alike. `e` is measured where it matters: both models are
teacher-forced along the hypotheses being compared (the largest |logit difference| over their positions), not the
beam search's overall error, which unlikely rows inflate; where it exceeds what the precision's arithmetic allows
(`near_tie_cap`), the divergence is no near-tie. A beam divergence is a near-tie,
reported with its eager gap and tolerance, when either
- "boundary": at the first step where the candidate keeps other live beams than the eager search (both having kept
  the same ones before), the best beam it dropped beats the worst one it kept instead, under the eager model, by at
  most 4e x (step + 1 - the prefix they all share): both cumulative scores may move by 2e a token apart from that
  prefix ("2x the logit error" at the top-k boundary, per unshared token and per side); or
- "final": the eager score of the candidate's finished hypothesis is within the search's own scoring (sum of
  log-probabilities, eos included when it ended, over GNMT's length penalty) of the eager hypothesis' score by at
  most 2e x (c |1/lp_w - 1/lp_g| + (n_w - c)/lp_w + (n_g - c)/lp_g) for lengths n, penalties lp and common prefix c:
  the largest amount error e can move the difference of the two scores (a candidate hypothesis the eager model
  scores higher is a search error of the eager run, so also not a failure).
Only the first divergent step is judged, as for greedy: once the searches part, what follows is the other search's
legitimate outcome. A divergence that parts first in the finished hypotheses only (an eos continuation at the K-th
rank) is judged by the final rule alone: conservative, it fails unless the final scores tie.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from seq2trt.reference_model.decoding import GNMT_ALPHA, DecodeSettings, StepModel, length_penalty, log_softmax
from seq2trt.reference_model.vocab import pad_batch

Pad = Callable[[list], tuple]  # sources -> (encoder input, mask): the model's source kind's pad (token ids by default)

BEAM_ALPHA = GNMT_ALPHA  # the beam search end_to_end runs, and the rescoring of its hypotheses


def greedy_tie(margin: float | None, error: float | None) -> bool:
    """A greedy divergence is a near-tie when the eager model's margin between its token and the candidate's is at
    most twice the candidate's logit error there (each of the two logits may move by that error)."""
    return margin is not None and error is not None and margin <= 2 * error


def near_tie_cap(dtype: str, fp32_target: float) -> tuple[float, float]:
    """The largest logit error a near-tie may rest on, (absolute, relative to the largest |logit|): fp32's target
    (`fp32_target`, end to end's max_logit_abs_err); for fp16/bf16 the precision check's factor on one rounding of
    the logits (MAX_FACTOR x unit roundoff); for int8 the same factor on int8's resolution, 1/127 of a range."""
    from seq2trt.validation.precision import MAX_FACTOR, UNIT_ROUNDOFF

    if dtype in UNIT_ROUNDOFF:
        return 0.0, MAX_FACTOR * UNIT_ROUNDOFF[dtype]
    if dtype == "int8":
        return 0.0, MAX_FACTOR / 127
    return fp32_target, 0.0


@dataclass
class GreedyComparison:
    """Greedy tokens of a candidate against the eager model's, on the same sources."""

    sequences: int
    identical: int
    ties: int  # sequences that diverge within the candidate's measured error of an eager tie (compare_greedy)
    tie_margin: float  # the bound used where no candidate logits were recorded
    max_abs_logit_diff: float | None  # over the steps both decoded identically, when the candidate gave logits
    mismatches: list[str]
    logit_abs_err_by_step: list[float] | None = None  # the largest |difference| at each decoding step

    @property
    def rate(self) -> float:
        return self.identical / self.sequences if self.sequences else 1.0

    def __bool__(self) -> bool:
        return self.identical + self.ties == self.sequences

    def to_dict(self) -> dict:
        return {"sequences": self.sequences, "identical": self.identical, "ties": self.ties, "rate": self.rate,
                "tie_margin": self.tie_margin, "max_abs_logit_diff": self.max_abs_logit_diff,
                "passed": bool(self), "mismatches": self.mismatches[:10],
                "logit_abs_err_by_step": self.logit_abs_err_by_step}


def compare_greedy(reference: tuple[list[list[int]], list[list[np.ndarray]]], candidate: list[list[int]], eos_id: int,
                   candidate_logits: list[np.ndarray] | None = None, tie_margin: float = 1e-4) -> GreedyComparison:
    """Token-for-token agreement. A divergence is a tie when the reference's two candidates are closer than the
    candidate's own logit error can move them: 2x its largest error on that source up to and including the
    divergent step, where `candidate_logits` are given, and only while that error is within what float32
    arithmetic allows (the fp32 bound, atol + rtol |logit|): a candidate off by more is wrong, not tied. Without
    logits: within `tie_margin`."""
    from seq2trt.validation.parity import TOLERANCES

    fp32 = TOLERANCES["fp32"]["*"]
    ref_tokens, ref_logits = reference
    identical = ties = 0
    mismatches, by_step = [], []
    for i, (want, got) in enumerate(zip(ref_tokens, candidate)):
        step = next((t for t, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        source_err, wrong = None, False
        if candidate_logits is not None:
            n = min(step + 1, len(ref_logits[i]), len(candidate_logits[i]))
            for t in range(n):  # up to and including the first divergent step: both saw the same history
                a, b = ref_logits[i][t], candidate_logits[i][t]
                v = min(len(a), len(b))  # CTranslate2's Marian vocabulary drops the last id, the pad
                err = float(np.abs(a[:v] - b[:v]).max())
                by_step.extend([0.0] * (t + 1 - len(by_step)))
                by_step[t] = max(by_step[t], err)
                allowed = fp32.atol + fp32.rtol * float(np.abs(a[:v]).max())
                source_err = max(source_err or 0.0, err)
                wrong = wrong or not err <= allowed
        if want == got:
            identical += 1
            continue
        logits = ref_logits[i][step] if step < len(ref_logits[i]) else None
        ref_next = want[step] if step < len(want) else eos_id  # past its end, a sequence ended with eos
        got_next = got[step] if step < len(got) else eos_id
        margin = None if logits is None else float(logits[ref_next] - logits[got_next])
        tie = (margin is not None and margin <= tie_margin) if source_err is None else \
            (not wrong and greedy_tie(margin, source_err))
        ties += tie
        mismatches.append(f"source {i}: diverges at step {step} (eager {ref_next}, candidate {got_next}, "
                          f"eager margin {margin if margin is None else f'{margin:.2e}'})")
    return GreedyComparison(len(ref_tokens), identical, ties, tie_margin, max(by_step) if by_step else None,
                            mismatches, by_step if candidate_logits is not None else None)




class _Encoded:
    """An encoder state, told apart from a past by `BeamTrace.select`."""

    def __init__(self, state: Any):
        self.state = state


class BeamTrace:
    """Wraps the model a `beam_search` drives and records, per source and step, the set of live beams it kept
    (token prefixes). The search steps every slot, gathers the past of the slots it keeps (`select(past, origin)`)
    and steps their new tokens; a source whose K slots all restart from its first slot on pad is done (the search's
    filler) and is no longer recorded."""

    def __init__(self, model: StepModel, beam_size: int, pad_id: int, offset: int,
                 traces: dict[int, list[frozenset[tuple[int, ...]]]]):
        self.model, self.K, self.pad_id, self.offset, self.traces = model, beam_size, pad_id, offset, traces
        self.prefixes: list[tuple[int, ...]] = []
        self.origin: list[int] | None = None
        self.done: set[int] = set()

    def encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> _Encoded:
        return _Encoded(self.model.encode(input_ids, attention_mask))

    def empty_past(self, batch: int) -> Any:
        self.prefixes, self.origin, self.done = [()] * batch, None, set()
        return self.model.empty_past(batch)

    def step(self, input_ids, encoder_attention_mask, encoder_state: _Encoded, past) -> tuple[np.ndarray, Any]:
        if self.origin is not None:
            tokens, K = input_ids[:, -1].tolist(), self.K
            per_source = len(self.prefixes) * K == len(tokens)  # after the first step: one past row a source
            self.prefixes = [self.prefixes[o] + (t,) for o, t in zip(self.origin, tokens)]
            for b in range(len(tokens) // K):
                block, first = range(b * K, (b + 1) * K), b if per_source else b * K
                if all(self.origin[i] == first and tokens[i] == self.pad_id for i in block):
                    self.done.add(b)
                if b not in self.done:
                    self.traces.setdefault(self.offset + b, []).append(frozenset(self.prefixes[i] for i in block))
            self.origin = None
        return self.model.step(input_ids, encoder_attention_mask, encoder_state.state, past)

    def select(self, state: Any, index: np.ndarray) -> Any:
        if isinstance(state, _Encoded):
            return _Encoded(self.model.select(state.state, index))
        self.origin = index.tolist()
        return self.model.select(state, index)


def beam_tracer(beam_size: int, pad_id: int, traces: dict) -> Callable[[int], Callable[[StepModel], BeamTrace]]:
    """Per batch (its first source's offset), the wrapper that records a beam search's live beams into `traces`."""
    return lambda offset: lambda model: BeamTrace(model, beam_size, pad_id, offset, traces)


def _rescore(reference: StepModel, candidate: StepModel, source, rows: list[list[int]], settings: DecodeSettings,
             batch: int, pad: Pad | None = None) -> tuple[list[float], float, float]:
    """Teacher-forces `rows` (token lists after the start token and the prompt, of one source) through both models,
    `batch` rows a call: each row's eager log-probability as the search sums it (log-softmax under the model's rules,
    which see the row's tokens before each step), the largest |logit difference| between the models over the
    positions the rows score, and the largest eager |logit| there. `pad`: the source kind's batch and mask (token
    ids, or audio features) of a list of sources; default token ids padded with the model's pad id."""
    pad = pad or (lambda batch_: pad_batch(batch_, settings.pad_id))
    sums, err, scale = [], 0.0, 0.0
    for start in range(0, len(rows), batch):
        chunk = rows[start: start + batch]
        ids, mask = pad([source])
        index = np.zeros(len(chunk), dtype=np.int64)
        states = [m.select(m.encode(ids, mask), index) for m in (reference, candidate)]
        pasts = [m.empty_past(len(chunk)) for m in (reference, candidate)]
        mask, total = mask[index], np.zeros(len(chunk))
        next_ids = np.tile(np.asarray(settings.start, dtype=np.int64), (len(chunk), 1))  # one prefill, as searched
        for t in range(max(map(len, chunk))):
            want, pasts[0] = reference.step(next_ids, mask, states[0], pasts[0])
            got, pasts[1] = candidate.step(next_ids, mask, states[1], pasts[1])
            live = np.array([t < len(r) for r in chunk])
            tokens = np.array([r[t] if t < len(r) else settings.pad_id for r in chunk], dtype=np.int64)
            before = np.array([(list(r[:t]) + [settings.pad_id] * t)[:t] for r in chunk], np.int64)
            before = before.reshape(len(chunk), t)  # each row's tokens before step t (a finished row padded)
            logp = settings.constrain(log_softmax(want), t, tokens=before if settings.reads_tokens else None)
            total[live] += logp[live, tokens[live]]
            diff = np.abs(got.astype(np.float64) - want.astype(np.float64))[live]
            err = max(err, float(np.nan_to_num(diff, nan=np.inf).max(initial=0.0)))
            scale = max(scale, float(np.abs(np.nan_to_num(want[live].astype(np.float64))).max(initial=0.0)))
            next_ids = tokens[:, None]
        sums += total.tolist()
    return sums, err, scale


def _shared(rows: list[tuple[int, ...]] | list[list[int]]) -> int:
    """The length of the prefix all `rows` share."""
    return next((k for k, column in enumerate(zip(*rows)) if len(set(column)) > 1), min(map(len, rows)))


def _boundary_tie(wanted: list[frozenset], got: list[frozenset], score) -> dict | None:
    """The first step whose live beams differ (the earlier ones agree), judged: best dropped vs worst kept instead.
    Beams the eager model rules out (-inf: the search's fillers) are no beams."""
    for step, (e, c) in enumerate(zip(wanted, got)):
        if e == c:
            continue
        dropped, kept = sorted(e - c), sorted(c - e)
        scores, err = score([list(p) for p in dropped + kept])
        dropped_s = [x for x in scores[: len(dropped)] if np.isfinite(x)]
        kept_s = [x for x in scores[len(dropped):] if np.isfinite(x)]
        if not dropped_s or not kept_s:
            continue
        gap = max(dropped_s) - min(kept_s)
        tolerance = 4 * err * (step + 1 - _shared(dropped + kept))
        return {"step": step, "kind": "boundary", "eager_margin": gap, "tolerance": tolerance,
                "tie": gap <= tolerance}
    return None


def _final_tie(want: list[int], got: list[int], step: int, settings: DecodeSettings, score) -> dict:
    """The two finished hypotheses rescored by the eager model as the search scores them, judged."""
    rows = [h + [settings.eos_id] * (len(h) < settings.max_new_tokens) for h in (want, got)]  # eos if it ended
    (s_w, s_g), err = score(rows)
    lp_w, lp_g = (length_penalty(len(r), BEAM_ALPHA) for r in rows)
    c = _shared(rows)
    gap = s_w / lp_w - s_g / lp_g
    tolerance = 2 * err * (c * abs(1 / lp_w - 1 / lp_g) + (len(rows[0]) - c) / lp_w + (len(rows[1]) - c) / lp_g)
    return {"step": step, "kind": "final", "eager_margin": gap, "tolerance": tolerance, "tie": gap <= tolerance}


def beam_near_ties(divergent_steps: dict[int, int], reference: StepModel, candidate: StepModel,
                   sources: list, want: list[list[int]], got: list[list[int]], traces: tuple[dict, dict],
                   settings: DecodeSettings, beam_size: int, cap: tuple[float, float],
                   pad: Pad | None = None) -> list[dict]:
    """The near-ties among the divergent samples (`divergent_steps`: sample -> first divergent token) of a beam
    search, by the "boundary" and "final" rules above: {sample, step, kind, eager_margin, tolerance} each.
    `traces`: the live beams of the eager and the candidate search (`beam_tracer`). Where the logit error measured
    along the hypotheses compared exceeds `cap` (absolute, relative to the largest eager |logit| there: what the
    precision's arithmetic allows), the divergence is no near-tie: an error the precision cannot make excuses
    nothing."""
    ties = []
    for i, step in sorted(divergent_steps.items()):
        def score(rows: list[list[int]]) -> tuple[list[float], float]:
            sums, err, scale = _rescore(reference, candidate, sources[i], rows, settings, beam_size, pad)
            return sums, err if err <= cap[0] + cap[1] * scale else np.nan  # nan: every `gap <= tolerance` is False
        judged = _boundary_tie(traces[0].get(i, []), traces[1].get(i, []), score)
        if judged is None or not judged["tie"]:
            judged = _final_tie(want[i], got[i], step, settings, score)
        if judged["tie"]:
            ties.append({"sample": i, **{k: v for k, v in judged.items() if k != "tie"}})
    return ties
