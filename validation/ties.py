"""Beam near-ties (issue 17): whether a beam search that parted from the eager one did so on a tie.

A beam's choices compare cumulative log-probabilities, so a reviewer asks whether the scores the
search compared are within what the graphs' error could move. If every logit moves by at most e, a token's
log-probability (logit minus log-sum-exp) moves by at most 2e, and a sum over n tokens by at most 2en; tokens two
hypotheses share (a common prefix) move both sums alike. `e` is measured where it matters: both models are
teacher-forced along the hypotheses being compared (the largest |logit difference| over their positions), not the
beam search's overall error, which unlikely rows inflate (int8: 3.9 against 0.23 on the greedy path); where it
exceeds what the precision's arithmetic allows (`end_to_end._near_tie_cap`), the divergence is no near-tie. A beam divergence is a near-tie,
reported with its eager gap and tolerance, when either
- "boundary": at the first step where the candidate keeps other live beams than the eager search (both having kept
  the same ones before), the best beam it dropped beats the worst one it kept instead, under the eager model, by at
  most 4e x (step + 1 - the prefix they all share): both cumulative scores may move by 2e a token apart from that
  prefix (the issue's "2x the logit error" at the top-k boundary, per unshared token and per side); or
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

from typing import Any, Callable

import numpy as np

from seq2trt.reference_model.decoding import DecodeSettings, StepModel, length_penalty, log_softmax
from seq2trt.reference_model.vocab import pad_batch

BEAM_ALPHA = 0.6  # GNMT's length penalty: the beam search end_to_end runs, and the rescoring of its hypotheses


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


def _rescore(reference: StepModel, candidate: StepModel, source: list[int], rows: list[list[int]],
             settings: DecodeSettings, batch: int) -> tuple[list[float], float, float]:
    """Teacher-forces `rows` (token lists after bos, of one source) through both models, `batch` rows a call: each
    row's eager log-probability as the search sums it (log-softmax under the model's rules), the largest
    |logit difference| between the models over the positions the rows score, and the largest eager |logit| there."""
    sums, err, scale = [], 0.0, 0.0
    for start in range(0, len(rows), batch):
        chunk = rows[start: start + batch]
        ids, mask = pad_batch([source], settings.pad_id)
        index = np.zeros(len(chunk), dtype=np.int64)
        states = [m.select(m.encode(ids, mask), index) for m in (reference, candidate)]
        pasts = [m.empty_past(len(chunk)) for m in (reference, candidate)]
        mask, total = mask[index], np.zeros(len(chunk))
        next_ids = np.full((len(chunk), 1), settings.bos_id, dtype=np.int64)
        for t in range(max(map(len, chunk))):
            want, pasts[0] = reference.step(next_ids, mask, states[0], pasts[0])
            got, pasts[1] = candidate.step(next_ids, mask, states[1], pasts[1])
            live = np.array([t < len(r) for r in chunk])
            tokens = np.array([r[t] if t < len(r) else settings.pad_id for r in chunk], dtype=np.int64)
            logp = settings.constrain(log_softmax(want), t)
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
                   sources: list[list[int]], want: list[list[int]], got: list[list[int]], traces: tuple[dict, dict],
                   settings: DecodeSettings, beam_size: int, cap: tuple[float, float]) -> list[dict]:
    """The near-ties among the divergent samples (`divergent_steps`: sample -> first divergent token) of a beam
    search, by the "boundary" and "final" rules above: {sample, step, kind, eager_margin, tolerance} each.
    `traces`: the live beams of the eager and the candidate search (`beam_tracer`). Where the logit error measured
    along the hypotheses compared exceeds `cap` (absolute, relative to the largest eager |logit| there: what the
    precision's arithmetic allows), the divergence is no near-tie: an error the precision cannot make excuses
    nothing."""
    ties = []
    for i, step in sorted(divergent_steps.items()):
        def score(rows: list[list[int]]) -> tuple[list[float], float]:
            sums, err, scale = _rescore(reference, candidate, sources[i], rows, settings, beam_size)
            return sums, err if err <= cap[0] + cap[1] * scale else np.nan  # nan: every `gap <= tolerance` is False
        judged = _boundary_tie(traces[0].get(i, []), traces[1].get(i, []), score)
        if judged is None or not judged["tie"]:
            judged = _final_tie(want[i], got[i], step, settings, score)
        if judged["tie"]:
            ties.append({"sample": i, **{k: v for k, v in judged.items() if k != "tie"}})
    return ties
