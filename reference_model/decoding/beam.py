"""Beam search: GNMT's (models trained here) and Hugging Face's (transformers' `_beam_search`, step for step, for
imported models)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from seq2trt.reference_model.decoding.settings import GNMT_ALPHA, DecodeSettings, Hypothesis, StepModel
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
    Returns the best hypothesis of each source without eos.

    Two departures in how, not what: a source whose hypotheses can no longer change (Hugging Face's own test: K
    ended with early_stopping True, or no live beam can beat the worst kept one) leaves the batch at once, its K
    rows dropped from the model's state with the step's beam reorder (transformers keeps them running until every
    source is done: on the demo's held-out sources at batch 8 about half the row-steps); and the K kept hypotheses
    of a source change only in the steps where one of its K best candidates ends, so they are merged there alone,
    source by source (the step's bookkeeping is otherwise a few array operations: on the demo model it was most of
    a batch-1 step's time)."""
    import torch

    B, K, N = input_ids.shape[0], beam_size, settings.max_new_tokens
    n_best = _check_beams(settings, beam_size)
    # Hugging Face's B x K rows after the first step (one row a source before it: `_prefill`, `_expand`).
    encoder_state, mask, past, next_ids = _prefill(model, input_ids, attention_mask, settings)
    sources = np.arange(B)  # source index of each live source
    results: list[list[int]] = [[] for _ in range(B)]
    running = np.zeros((B * K, 0), dtype=np.int64)  # generated tokens of each live beam, row b*K + k
    running_scores = np.zeros((B, K), dtype=np.float32)
    running_scores[:, 1:] = -1e9  # all beams start identical: expand only the first
    # The K kept hypotheses of each live source, best first: Hugging Face's finished beams, unfilled slots at -1e9.
    finished_scores = np.full((B, K), -1e9, dtype=np.float32)
    is_finished = np.zeros((B, K), dtype=bool)
    finished: list[list[list[int]]] = [[[] for _ in range(K)] for _ in range(B)]
    # output_token_logprobs: each live beam's per-token log-probabilities beside `running`, each kept one's beside
    # `finished` (the step's processed log-probabilities at the chosen token: compute_transition_scores).
    want_lp = settings.output_token_logprobs
    running_lp = np.zeros((B * K, 0), dtype=np.float32)
    finished_lp: list[list[list[float]]] = [[[] for _ in range(K)] for _ in range(B)]
    improvable = np.ones(B, dtype=bool)  # HF's is_early_stop_heuristic_unsatisfied
    masked = np.float32(-1e9)
    eos = settings.eos_id

    def result(b: int) -> list:
        cut = [tokens[: tokens.index(eos)] if eos in tokens else tokens for tokens in finished[b][:n_best]]
        if settings.plain:
            return cut[0]
        lps = [tuple(lp[: len(t) + (eos in full)]) if want_lp else None
               for t, full, lp in zip(cut, finished[b], finished_lp[b])]
        return [Hypothesis(t, float(s), lp) for t, s, lp in zip(cut, finished_scores[b], lps)]

    for step in range(N):
        b_live = len(sources)
        live = np.arange(b_live)[:, None]
        logits, past = model.step(next_ids, mask, encoder_state, past)
        logp = _log_softmax32(logits)
        if step == 0 and K > 1:
            logp = logp.repeat_interleave(K, dim=0)
            encoder_state, mask = _expand(model, encoder_state, mask, K)
        settings.constrain(logp.numpy(), step, inplace=True, tokens=running)  # logp is this step's own array
        step_lp = logp.numpy().copy() if want_lp else None  # before the beam scores are added in place
        V = logp.shape[-1]
        acc = logp.view(b_live, K, V).add_(torch.from_numpy(running_scores)[:, :, None]).view(b_live, K * V)  # in place
        top = _top_wide(acc, 2 * K)  # (b, 2K), best first
        top_scores = acc.numpy()[live, top]
        top_beam, top_token = np.divmod(top, V)
        last = step + 1 >= N
        ends = np.ones_like(top, dtype=bool) if last else top_token == eos  # (b, 2K)
        # The K best continuations that did not end go on.
        live_scores = top_scores + ends * masked
        keep = np.argsort(-live_scores, axis=1, kind="stable")[:, :K]
        running_scores = live_scores[live, keep]
        origin = (top_beam[live, keep] + live * K).reshape(-1)
        previous, running = running, np.concatenate([running[origin], top_token[live, keep].reshape(-1, 1)], 1)
        if want_lp:
            previous_lp = running_lp
            running_lp = np.concatenate([running_lp[origin], step_lp[origin, top_token[live, keep].reshape(-1)][:, None]],
                                        1)
        # Ended ones among the K best join the kept hypotheses (a live source is never blocked: see below). Where
        # none of a source's K best ended, every candidate scores below -1e9 and Hugging Face's merge keeps its list.
        ends_k = ends[:, :K]
        if last or ends_k.any():
            ended = top_scores / np.float32((step + 1) ** length_penalty)
            ended[:, :K] += masked * ~ends_k
            ended[:, K:] += masked
            for b in np.flatnonzero(ends_k.any(1)):
                merged = np.concatenate([finished_scores[b], ended[b]])
                best = np.argsort(-merged, kind="stable")[:K]
                tokens = finished[b] + [None] * (2 * K)
                done = np.concatenate([is_finished[b], np.zeros(2 * K, dtype=bool)])
                done[K:][:K] = ends_k[b]
                lps = finished_lp[b] + [None] * (2 * K)
                for j in best[best >= K] - K:
                    row = b * K + top_beam[b, j]
                    tokens[K + j] = previous[row].tolist() + [int(top_token[b, j])]
                    if want_lp:
                        lps[K + j] = previous_lp[row].tolist() + [float(step_lp[row, top_token[b, j]])]
                finished[b] = [tokens[i] if tokens[i] is not None else [] for i in best]
                finished_lp[b] = [lps[i] if lps[i] is not None else [] for i in best]
                finished_scores[b], is_finished[b] = merged[best], done[best]
        # Can a live beam still beat the worst kept hypothesis? (HF's heuristic, per source.)
        best_length = N if early_stopping == "never" and length_penalty > 0 else step + 1
        best_running = running_scores[:, 0] / np.float32(best_length ** length_penalty)
        worst = np.where(is_finished, finished_scores.min(1, keepdims=True), masked)
        improvable &= (best_running[:, None] > worst).any(1)
        # A source Hugging Face would block from now on (no new hypotheses: its result is final) leaves the batch.
        blocked = ~improvable | (is_finished.all(1) & (early_stopping is True))
        if last or blocked.all():
            for b in range(b_live):
                results[sources[b]] = result(b)
            break
        if blocked.any():
            for b in np.flatnonzero(blocked):
                results[sources[b]] = result(b)
            stay = np.flatnonzero(~blocked)
            rows, encoder_state, mask = _drop(model, stay, K, encoder_state, mask)
            sources, running, running_scores = sources[stay], running[rows], running_scores[stay]
            finished, finished_scores = [finished[b] for b in stay], finished_scores[stay]
            running_lp, finished_lp = running_lp[rows], [finished_lp[b] for b in stay]
            is_finished, improvable = is_finished[stay], improvable[stay]
            origin = origin.reshape(b_live, K)[stay].reshape(-1)
        past = _reorder(model, past, origin, step, K)
        next_ids = np.ascontiguousarray(running[:, -1:])
    return results
