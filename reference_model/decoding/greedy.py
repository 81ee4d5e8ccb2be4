"""Greedy search and sampling (Hugging Face's processors and its sampler, or the inverse-CDF fast sampler)."""

from __future__ import annotations

from typing import Callable

import numpy as np

from seq2trt.reference_model.decoding.settings import DecodeSettings, Hypothesis, StepModel
from seq2trt.reference_model.decoding.topk import _chosen, _log_softmax32, _top_n
from seq2trt.core.errors import ConfigError


StepHook = Callable[[int, np.ndarray, np.ndarray], None]  # (step, rows (b,), logits (b, V))


ChoiceHook = Callable[[int, np.ndarray, np.ndarray, np.ndarray], None]  # (step, rows, processed scores, tokens)


def greedy_decode(model: StepModel, input_ids: np.ndarray, attention_mask: np.ndarray, settings: DecodeSettings,
                  on_step: StepHook | None = None, generator=None, on_choice: ChoiceHook | None = None) -> list:
    """Greedy search, or sampling (`settings.do_sample`; `num_return_sequences` samples a source, drawn from
    `generator`, else from `settings.generator()`). Returns each source's tokens without bos/eos, or its
    Hypothesis list when `settings.plain` is not. Finished rows leave the batch. `on_choice` sees each step's
    scores after the model's rules (before the sampling warpers: Hugging Face's processed scores are those, then
    warped) and the tokens chosen from them."""
    input_ids, attention_mask = _expand_samples(settings, input_ids, attention_mask)
    B = input_ids.shape[0]
    encoder_state = model.encode(input_ids, attention_mask)
    past = model.empty_past(B)
    rows = np.arange(B)  # source index of each live row
    mask = attention_mask
    next_ids = np.tile(np.asarray(settings.start, np.int64), (B, 1))
    # Per step: an argmax and one eos test, nothing per row. Every numpy call here runs right after a backend's
    # step has flushed the CPU caches, where even small ones cost microseconds: on the demo model at batch 1,
    # `eos in tokens` (a numpy comparison) took 7.5 us a step against 0.7 us for the same test on `tolist()`, and
    # the earlier bookkeeping (a scatter into an output array, a count) 0.5 ms of a 14 ms decode.
    history: list[tuple[np.ndarray, np.ndarray]] = []  # (rows, tokens) of each step
    eos = settings.eos_id
    generated = np.zeros((B, 0), np.int64) if settings.reads_tokens else None  # live rows' tokens, for the rules
    sample = _Sampler(settings, B, generator) if settings.do_sample else None
    totals = None if settings.plain else np.zeros(B)
    per_token: list[np.ndarray] | None = [] if settings.output_token_logprobs else None  # each step's chosen logp
    constrained = settings.constrained
    for step in range(settings.max_new_tokens):
        logits, past = model.step(next_ids, mask, encoder_state, past)
        if on_step is not None:
            on_step(step, rows, logits)
        scores = settings.constrain(logits, step, tokens=generated) if constrained else logits
        tokens, chosen = _choose(scores, rows, sample, totals is not None)
        if on_choice is not None:
            on_choice(step, rows, scores, tokens)
        if totals is not None:
            totals[rows] += chosen
            if per_token is not None:
                per_token.append(chosen)
        history.append((rows, tokens))
        if generated is not None:
            generated = np.concatenate([generated, tokens[:, None]], 1)
        if eos in tokens.tolist():  # rows that produced eos leave the batch
            keep = np.flatnonzero(tokens != eos)
            if not len(keep):
                break
            rows, mask, tokens = rows[keep], mask[keep], tokens[keep]
            generated = None if generated is None else generated[keep]
            encoder_state, past = model.select(encoder_state, keep), model.select(past, keep)
        next_ids = tokens[:, None]
    return _results(settings, B, history, totals, per_token)


def _choose(scores: np.ndarray, rows: np.ndarray, sample: _Sampler | None, want_logp: bool):
    """(tokens (b,), each one's log-probability or None without `want_logp`): drawn, or the argmax."""
    if sample is not None:
        return sample(scores, rows, want_logp)
    tokens = scores.argmax(-1)  # (b,) int64
    return tokens, (_log_softmax32(scores).numpy()[np.arange(len(rows)), tokens] if want_logp else None)


def _expand_samples(settings: DecodeSettings, input_ids: np.ndarray, attention_mask: np.ndarray):
    """(input_ids, attention_mask) with each source repeated num_return_sequences times when sampling (Hugging
    Face's expansion); more than one sequence without sampling is refused."""
    n = settings.num_return_sequences
    if not settings.do_sample and n > 1:
        raise ConfigError(f"greedy search returns one sequence a source, not num_return_sequences "
                          f"{n}; use beam search with as many beams, or sampling")
    if settings.do_sample and n > 1:
        input_ids, attention_mask = np.repeat(input_ids, n, 0), np.repeat(attention_mask, n, 0)
    return input_ids, attention_mask


def _results(settings: DecodeSettings, B: int, history: list[tuple[np.ndarray, np.ndarray]],
             totals: np.ndarray | None, per_token: list[np.ndarray] | None) -> list:
    """Each row's tokens without eos from the steps' (rows, tokens), or, with `totals`, each source's Hypothesis
    list (its summed and, with `per_token`, per-token log-probabilities)."""
    eos = settings.eos_id
    out = np.full((B, len(history)), eos, dtype=np.int64)
    for step, (step_rows, step_tokens) in enumerate(history):
        out[step_rows, step] = step_tokens
    found = [row[: row.index(eos)] if eos in row else row for row in out.tolist()]
    if totals is None:
        return found
    n = settings.num_return_sequences if settings.do_sample else 1
    logprobs: list = [None] * B
    if per_token is not None:
        table = np.zeros((B, len(history)))
        for step, ((step_rows, _), chosen) in enumerate(zip(history, per_token)):
            table[step_rows, step] = chosen
        # A row shorter than the decode ended with eos (its step is kept); a row as long never did.
        logprobs = [tuple(table[b, :min(len(tokens) + 1, len(history))].tolist()) for b, tokens in enumerate(found)]
    hyps = [Hypothesis(tokens, float(score), lp) for tokens, score, lp in zip(found, totals, logprobs)]
    return [hyps[i: i + n] for i in range(0, B, n)]


class _Sampler:
    """Hugging Face's sampling step, reproducible under the same seed: torch's multinomial with one sample is
    argmax(p / q), q ~ Exp(1) drawn for every entry of the batch it was given, finished rows included. So q is drawn
    for the original batch every step, and the live rows pick theirs.

    `fast_sampling`: the inverse CDF instead, one uniform u a row of the original batch each step (the live rows
    pick theirs), the token the first whose cumulative probability (float64) exceeds u. The same distribution; the
    draws are B, not B x V, exponentials (at B=32 over a 58,101-token vocabulary those took most of a step)."""

    def __init__(self, settings: DecodeSettings, batch: int, generator=None):
        self.settings, self.batch = settings, batch
        self.generator = generator if generator is not None else settings.generator()

    def __call__(self, scores: np.ndarray, rows: np.ndarray, want_logp: bool):
        """(tokens (b,), each one's log-probability under the warpers (b,), or None without `want_logp`)."""
        import torch

        x = torch.from_numpy(np.asarray(scores, dtype=np.float32))
        if self.settings.fast_sampling:
            return self._inverse_cdf(x, rows, want_logp)
        warped = self.settings.warp(x)
        probs = warped.softmax(dim=-1)
        q = torch.empty((self.batch, probs.shape[-1]), dtype=probs.dtype).exponential_(1, generator=self.generator)
        if len(rows) < self.batch:
            q = q[torch.from_numpy(rows)]
        tokens = (probs / q).argmax(-1).numpy()
        return tokens, (_chosen(torch.log_softmax(warped, dim=-1), tokens) if want_logp else None)

    def _inverse_cdf(self, x, rows: np.ndarray, want_logp: bool):
        """The fast draw. With top-k < V and no tie at the k-th score, the warpers run on the k best scores alone
        (top-p over them is the same cut, the masked tokens having probability 0), so nothing else touches V."""
        import torch

        u = torch.rand(self.batch, generator=self.generator, dtype=torch.float64)
        u = u[torch.from_numpy(rows)] if len(rows) < self.batch else u
        k, index = self.settings.top_k, None
        if 0 < k < x.shape[-1]:
            values, index = _top_n(x, k + 1)  # sorted, best first; one more to see a tie at the k-th
            if (values[:, k] == values[:, k - 1]).any():  # a tie at the boundary: the warper keeps it too
                index = None
            else:
                x, index = values[:, :k], index[:, :k]
        warped = self.settings.warp(x)
        cdf = warped.softmax(dim=-1).double().cumsum(-1)
        picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp_(max=cdf.shape[-1] - 1)
        tokens = (picked if index is None else index.gather(1, picked[:, None])[:, 0]).numpy()
        return tokens, (_chosen(torch.log_softmax(warped, dim=-1), picked.numpy()) if want_logp else None)
