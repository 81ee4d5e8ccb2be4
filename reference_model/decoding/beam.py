"""Beam search: GNMT's (models trained here) and Hugging Face's (transformers' `_beam_search`, step for step, for
imported models)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from seq2trt.reference_model.decoding.options import GNMT_ALPHA
from seq2trt.reference_model.decoding.settings import DecodeSettings, Hypothesis, StepModel
from seq2trt.reference_model.decoding.topk import _log_softmax32, _top_wide, length_penalty, log_softmax
from seq2trt.core.errors import ConfigError


@dataclass
class _Finished:
    capacity: int
    alpha: float
    # (score, tokens, per-token log-probabilities or None), best first
    hyps: list[tuple[float, list[int], tuple[float, ...] | None]] = field(default_factory=list)

    def add(self, tokens: list[int], logprob: float, ended: bool, token_logprobs: list[float] | None = None) -> None:
        """Keep a hypothesis; `ended` when it closed with eos (which then counts in its length)."""
        self.hyps.append((logprob / length_penalty(len(tokens) + ended, self.alpha), tokens,
                          None if token_logprobs is None else tuple(token_logprobs)))
        self.hyps.sort(key=lambda h: -h[0])
        del self.hyps[self.capacity:]

    def is_done(self, best_live_logprob: float, length: int) -> bool:
        """Full, and no live beam can still beat the worst kept hypothesis (the usual heuristic)."""
        return len(self.hyps) >= self.capacity and \
            self.hyps[-1][0] >= best_live_logprob / length_penalty(length, self.alpha)


def _rows_of(sources: np.ndarray, K: int) -> np.ndarray:
    """The beam rows (b*K + k) of the live sources at indices `sources`, in order."""
    return (sources[:, None] * K + np.arange(K)).reshape(-1)


# The pieces both beam searches share: their prefill, the expansion after the first step, the reorder of the past
# each step, and dropping the sources that are done. All K beams of a source start identical, so the first step
# runs one row a source and its log-probabilities are repeated K times; what follows sees B x K rows.
def _prefill(model: StepModel, input_ids: np.ndarray, attention_mask: np.ndarray, settings: DecodeSettings):
    """(encoder state, mask, empty past, first input ids): one row a source, fed the start tokens in one step."""
    B = input_ids.shape[0]
    return (model.encode(input_ids, attention_mask), attention_mask, model.empty_past(B),
            np.tile(np.asarray(settings.start, np.int64), (B, 1)))


def _expand(model: StepModel, encoder_state, mask: np.ndarray, K: int):
    """The encoder state and mask of one row a source as K rows a source (row b*K + k), after the first step."""
    expand = np.repeat(np.arange(len(mask)), K)
    return model.select(encoder_state, expand), mask[expand]


def _reorder(model: StepModel, past, origin: np.ndarray, step: int, K: int):
    """The past of the rows each new beam came from (`origin`: beam rows); at step 0 one row a source ran."""
    return model.select(past, origin // K if step == 0 else origin)


def _drop(model: StepModel, stay: np.ndarray, K: int, encoder_state, mask: np.ndarray):
    """(the beam rows of the sources `stay`, their encoder state, their mask): the sources that are done leave."""
    rows = _rows_of(stay, K)
    return rows, model.select(encoder_state, rows), mask[rows]


def beam_search(model: StepModel, input_ids: np.ndarray, attention_mask: np.ndarray, settings: DecodeSettings,
                beam_size: int = 4, alpha: float = GNMT_ALPHA) -> list[list[int]]:
    """Beam search with GNMT length penalty. Returns the best hypothesis of each source, without bos/eos.
    A source that is done leaves the batch: its K rows are dropped from the model's state with the step's reorder."""
    n_best = _check_beams(settings, beam_size)
    B, K = input_ids.shape[0], beam_size
    encoder_state, mask, past, next_ids = _prefill(model, input_ids, attention_mask, settings)
    sources = np.arange(B)  # source index of each live source
    scores = np.full((B, K), -np.inf)
    scores[:, 0] = 0.0  # all beams start identical: expand only the first
    beams: list[list[int]] = [[] for _ in range(B * K)]  # tokens of each live beam, row b*K + k
    # Each live beam's per-token log-probabilities (output_token_logprobs), beside `beams`.
    beam_lp: list[list[float]] | None = [[] for _ in range(B * K)] if settings.output_token_logprobs else None
    finished = [_Finished(K, alpha) for _ in range(B)]
    for step in range(settings.max_new_tokens):
        b_live = len(sources)
        logits, past = model.step(next_ids, mask, encoder_state, past)
        history = np.array(beams, np.int64).reshape(len(beams), step) if settings.reads_tokens and step else None
        logp = settings.constrain(log_softmax(logits), step, tokens=history)
        if step == 0 and K > 1:
            logp = np.repeat(logp, K, axis=0)
            encoder_state, mask = _expand(model, encoder_state, mask, K)
        V = logp.shape[-1]
        cand = (scores[:, :, None] + logp.reshape(b_live, K, V)).reshape(b_live, K * V)
        new_scores, origin, new_tokens, done = _gnmt_step(cand, logp, [finished[s] for s in sources], beams, beam_lp,
                                                          settings, K, step)
        gather = origin.reshape(-1)
        if beam_lp is not None:
            chosen = logp[gather, new_tokens.reshape(-1)]
            beam_lp = [beam_lp[i] + [float(c)] for i, c in zip(gather, chosen)]
        beams = [beams[i] + [int(t)] for i, t in zip(gather, new_tokens.reshape(-1))]
        scores = new_scores
        if done.all():
            break
        if done.any():
            stay = np.flatnonzero(~done)
            rows, encoder_state, mask = _drop(model, stay, K, encoder_state, mask)
            sources, scores, new_tokens, gather = sources[stay], scores[stay], new_tokens[stay], gather[rows]
            beams = [beams[r] for r in rows]
            beam_lp = None if beam_lp is None else [beam_lp[r] for r in rows]
        past = _reorder(model, past, gather, step, K)
        next_ids = new_tokens.reshape(-1, 1)
    else:  # the length limit: live beams join their source's hypotheses
        _close([finished[s] for s in sources], scores, beams, beam_lp, K)
    if settings.plain:
        return [kept.hyps[0][1] if kept.hyps else [] for kept in finished]
    return [[Hypothesis(tokens, float(score), lp) for score, tokens, lp in kept.hyps[:n_best]] for kept in finished]


def _gnmt_step(cand: np.ndarray, logp: np.ndarray, kept: list[_Finished], beams: list[list[int]],
               beam_lp: list[list[float]] | None, settings: DecodeSettings, K: int, step: int):
    """One step's choice for each live source b (`cand` (b, K*V): the beams' scores plus each continuation's
    log-probability): eos among the K best candidates joins `kept[b]`, the best K others go on.
    Returns (their scores (b, K), the rows they came from (b, K), their tokens (b, K), whether each source is done)."""
    b_live, V = len(kept), logp.shape[-1]
    top = np.argsort(-cand, axis=1, kind="stable")[:, : 2 * K]  # (b, 2K): enough to refill K live beams
    new_scores = np.full((b_live, K), -np.inf)
    origin = np.repeat(np.arange(b_live) * K, K).reshape(b_live, K)
    new_tokens = np.full((b_live, K), settings.pad_id, dtype=np.int64)
    done = np.zeros(b_live, dtype=bool)
    for b in range(b_live):
        slot = 0
        for rank, flat in enumerate(top[b]):
            beam, token = divmod(int(flat), V)
            score = cand[b, flat]
            if not np.isfinite(score):
                break
            if token == settings.eos_id:
                if rank < K:
                    kept[b].add(beams[b * K + beam], score, ended=True, token_logprobs=None if beam_lp is None else
                                beam_lp[b * K + beam] + [float(logp[b * K + beam, token])])
                continue
            new_scores[b, slot], origin[b, slot], new_tokens[b, slot] = score, b * K + beam, token
            slot += 1
            if slot == K:
                break
        done[b] = kept[b].is_done(new_scores[b].max(), step + 1)
    return new_scores, origin, new_tokens, done


def _close(kept: list[_Finished], scores: np.ndarray, beams: list[list[int]], beam_lp: list[list[float]] | None,
           K: int) -> None:
    """At the length limit, each live source's finite beams join its hypotheses (not ended with eos)."""
    for b, source_kept in enumerate(kept):
        for k in range(K):
            if np.isfinite(scores[b, k]):
                source_kept.add(beams[b * K + k], scores[b, k], ended=False,
                                token_logprobs=None if beam_lp is None else beam_lp[b * K + k])


def _check_beams(settings: DecodeSettings, beam_size: int) -> int:
    """The hypotheses a beam search returns a source, checked against the beams (Hugging Face's rule)."""
    if beam_size < 1:
        raise ConfigError(f"beam_size must be >= 1, got {beam_size}")
    if settings.do_sample:
        raise ConfigError("beam search does not sample; sample with one beam")
    if settings.num_return_sequences > beam_size:
        raise ConfigError(f"num_return_sequences {settings.num_return_sequences} is more than the {beam_size} beams; "
                          "ask for at most as many sequences as beams")
    return settings.num_return_sequences


def hf_beam_search(model: StepModel, input_ids: np.ndarray, attention_mask: np.ndarray, settings: DecodeSettings,
                   beam_size: int = 4, length_penalty: float = 1.0, early_stopping: bool | str = False
                   ) -> list[list[int]]:
    """Hugging Face's beam search (transformers 4.57 `GenerationMixin._beam_search`), step for step, for the
    models imported from it: float32 log-probabilities; each step keeps the 2K best continuations; a hypothesis
    that ends (eos, or the length limit) among the K best is scored `sum_logprobs / length ** length_penalty`,
    length counting the generated tokens with eos; `early_stopping` True stops a source once K hypotheses ended,
    False / "never" stop it when no live beam can still beat the worst kept one (HF's heuristic for each).
    Returns the best hypothesis of each source without eos. How it departs from transformers (in how, not what):
    `_HFBeams`."""
    import torch

    B, K, N = input_ids.shape[0], beam_size, settings.max_new_tokens
    beams = _HFBeams(B, K, settings, _check_beams(settings, beam_size), length_penalty, early_stopping)
    # Hugging Face's B x K rows after the first step (one row a source before it: `_prefill`, `_expand`).
    encoder_state, mask, past, next_ids = _prefill(model, input_ids, attention_mask, settings)
    results: list[list[int]] = [[] for _ in range(B)]
    for step in range(N):
        b_live = len(beams.sources)
        logits, past = model.step(next_ids, mask, encoder_state, past)
        logp = _log_softmax32(logits)
        if step == 0 and K > 1:
            logp = logp.repeat_interleave(K, dim=0)
            encoder_state, mask = _expand(model, encoder_state, mask, K)
        settings.constrain(logp.numpy(), step, inplace=True, tokens=beams.running)  # logp is this step's own array
        step_lp = logp.numpy().copy() if beams.want_lp else None  # before the beam scores are added in place
        V = logp.shape[-1]
        acc = logp.view(b_live, K, V).add_(torch.from_numpy(beams.running_scores)[:, :, None]).view(b_live, K * V)
        top = _top_wide(acc, 2 * K)  # (b, 2K), best first
        top = (acc.numpy()[np.arange(b_live)[:, None], top], *np.divmod(top, V))  # (scores, beams, tokens)
        last = step + 1 >= N
        ends = np.ones_like(top[2], dtype=bool) if last else top[2] == settings.eos_id  # (b, 2K)
        previous, previous_lp, origin = beams.go_on(top, ends, step_lp)
        if last or ends[:, :K].any():
            beams.merge_ended(top, ends[:, :K], previous, previous_lp, step_lp, step)
        blocked = beams.blocked(step)
        if last or blocked.all():
            beams.finish(range(b_live), results)
            break
        if blocked.any():
            beams.finish(np.flatnonzero(blocked), results)
            stay = np.flatnonzero(~blocked)
            rows, encoder_state, mask = _drop(model, stay, K, encoder_state, mask)
            beams.keep(stay, rows)
            origin = origin.reshape(b_live, K)[stay].reshape(-1)
        past = _reorder(model, past, origin, step, K)
        next_ids = np.ascontiguousarray(beams.running[:, -1:])
    return results


_MASKED = np.float32(-1e9)  # Hugging Face's score of a masked candidate or an unfilled slot


class _HFBeams:
    """Hugging Face's beam state of the live sources (row b*K + k of beam k of live source b) and its rules.

    Two departures from transformers in how, not what: a source whose hypotheses can no longer change (Hugging
    Face's own test: K ended with early_stopping True, or no live beam can beat the worst kept one) leaves the
    batch at once, its K rows dropped from the model's state with the step's beam reorder (transformers keeps them
    running until every source is done: on the demo's held-out sources at batch 8 about half the row-steps); and
    the K kept hypotheses of a source change only in the steps where one of its K best candidates ends, so they are
    merged there alone, source by source (the step's bookkeeping is otherwise a few array operations: on the demo
    model it was most of a batch-1 step's time)."""

    def __init__(self, B: int, K: int, settings: DecodeSettings, n_best: int, length_penalty: float,
                 early_stopping: bool | str):
        self.K, self.settings, self.n_best = K, settings, n_best
        self.length_penalty, self.early_stopping = length_penalty, early_stopping
        self.sources = np.arange(B)  # source index of each live source
        self.running = np.zeros((B * K, 0), dtype=np.int64)  # generated tokens of each live beam
        self.running_scores = np.zeros((B, K), dtype=np.float32)
        self.running_scores[:, 1:] = _MASKED  # all beams start identical: expand only the first
        # The K kept hypotheses of each live source, best first: Hugging Face's finished beams, unfilled slots masked.
        self.finished_scores = np.full((B, K), _MASKED, dtype=np.float32)
        self.is_finished = np.zeros((B, K), dtype=bool)
        self.finished: list[list[list[int]]] = [[[] for _ in range(K)] for _ in range(B)]
        # output_token_logprobs: each live beam's per-token log-probabilities beside `running`, each kept one's
        # beside `finished` (the step's processed log-probabilities at the chosen token: compute_transition_scores).
        self.want_lp = settings.output_token_logprobs
        self.running_lp = np.zeros((B * K, 0), dtype=np.float32)
        self.finished_lp: list[list[list[float]]] = [[[] for _ in range(K)] for _ in range(B)]
        self.improvable = np.ones(B, dtype=bool)  # HF's is_early_stop_heuristic_unsatisfied

    def go_on(self, top, ends: np.ndarray, step_lp: np.ndarray | None):
        """The K best of the step's 2K best continuations `top` (scores, beams, tokens) that did not end go on.
        Returns (the beams' tokens before, their log-probabilities before, the rows the new beams came from)."""
        top_scores, top_beam, top_token = top
        K, live = self.K, np.arange(len(self.sources))[:, None]
        live_scores = top_scores + ends * _MASKED
        keep = np.argsort(-live_scores, axis=1, kind="stable")[:, :K]
        self.running_scores = live_scores[live, keep]
        origin = (top_beam[live, keep] + live * K).reshape(-1)
        chosen = top_token[live, keep].reshape(-1)
        previous, previous_lp = self.running, self.running_lp
        self.running = np.concatenate([previous[origin], chosen[:, None]], 1)
        if step_lp is not None:
            self.running_lp = np.concatenate([previous_lp[origin], step_lp[origin, chosen][:, None]], 1)
        return previous, previous_lp, origin

    def merge_ended(self, top, ends_k: np.ndarray, previous: np.ndarray, previous_lp: np.ndarray,
                    step_lp: np.ndarray | None, step: int) -> None:
        """Ended ones among the K best join the kept hypotheses (a live source is never blocked: `blocked`). Where
        none of a source's K best ended, every candidate scores below -1e9 and Hugging Face's merge keeps its list."""
        (top_scores, top_beam, top_token), K = top, self.K
        ended = top_scores / np.float32((step + 1) ** self.length_penalty)
        ended[:, :K] += _MASKED * ~ends_k
        ended[:, K:] += _MASKED
        for b in np.flatnonzero(ends_k.any(1)):
            merged = np.concatenate([self.finished_scores[b], ended[b]])
            best = np.argsort(-merged, kind="stable")[:K]
            tokens = self.finished[b] + [None] * (2 * K)
            done = np.concatenate([self.is_finished[b], np.zeros(2 * K, dtype=bool)])
            done[K:][:K] = ends_k[b]
            lps = self.finished_lp[b] + [None] * (2 * K)
            for j in best[best >= K] - K:
                row = b * K + top_beam[b, j]
                tokens[K + j] = previous[row].tolist() + [int(top_token[b, j])]
                if step_lp is not None:
                    lps[K + j] = previous_lp[row].tolist() + [float(step_lp[row, top_token[b, j]])]
            self.finished[b] = [tokens[i] if tokens[i] is not None else [] for i in best]
            self.finished_lp[b] = [lps[i] if lps[i] is not None else [] for i in best]
            self.finished_scores[b], self.is_finished[b] = merged[best], done[best]

    def blocked(self, step: int) -> np.ndarray:
        """Which live sources Hugging Face would block from now on (no new hypotheses: their result is final):
        K ended with early_stopping True, or no live beam can still beat the worst kept one (its heuristic)."""
        best_length = self.settings.max_new_tokens if self.early_stopping == "never" and self.length_penalty > 0 \
            else step + 1
        best_running = self.running_scores[:, 0] / np.float32(best_length ** self.length_penalty)
        worst = np.where(self.is_finished, self.finished_scores.min(1, keepdims=True), _MASKED)
        self.improvable &= (best_running[:, None] > worst).any(1)
        return ~self.improvable | (self.is_finished.all(1) & (self.early_stopping is True))

    def keep(self, stay: np.ndarray, rows: np.ndarray) -> None:
        """Only the live sources `stay` (their beam rows `rows`) go on."""
        self.sources, self.running, self.running_scores = self.sources[stay], self.running[rows], \
            self.running_scores[stay]
        self.finished, self.finished_scores = [self.finished[b] for b in stay], self.finished_scores[stay]
        self.running_lp, self.finished_lp = self.running_lp[rows], [self.finished_lp[b] for b in stay]
        self.is_finished, self.improvable = self.is_finished[stay], self.improvable[stay]

    def finish(self, live: Iterable[int], results: list) -> None:
        """The results of the live sources `live` (indices among the live), into `results` by source index."""
        for b in live:
            results[self.sources[b]] = self.result(b)

    def result(self, b: int) -> list:
        """Live source b's best hypothesis without eos, or its n_best Hypothesis list when `settings.plain` is not."""
        eos = self.settings.eos_id
        cut = [tokens[: tokens.index(eos)] if eos in tokens else tokens for tokens in self.finished[b][:self.n_best]]
        if self.settings.plain:
            return cut[0]
        lps = [tuple(lp[: len(t) + (eos in full)]) if self.want_lp else None
               for t, full, lp in zip(cut, self.finished[b], self.finished_lp[b])]
        return [Hypothesis(t, float(s), lp) for t, s, lp in zip(cut, self.finished_scores[b], lps)]
