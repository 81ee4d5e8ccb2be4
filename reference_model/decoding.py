"""Greedy and beam-search decoding, written once for every backend.

A backend is a `StepModel`: it encodes a padded source batch once (its state holds the cross-attention
K/V), runs one decoder call on new tokens with the past K/V, and gathers its states along the batch axis
(beam reordering, dropping finished rows). The loops below only see numpy logits and token ids, so the same
code drives the eager model, ONNX Runtime and TensorRT, and their outputs are comparable token for token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Protocol

import numpy as np

from seq2trt.reference_model.errors import ConfigError, InputError


class StepModel(Protocol):
    def encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> Any:
        """(B, S) int64 ids and mask -> an opaque encoder state (the cross-attention K/V)."""

    def empty_past(self, batch: int) -> Any:
        """The past K/V of length 0 for `batch` rows."""

    def step(self, input_ids: np.ndarray, encoder_attention_mask: np.ndarray, encoder_state: Any,
             past: Any) -> tuple[np.ndarray, Any]:
        """(B, T) new ids -> (logits of the last new position (B, V), present K/V)."""

    def select(self, state: Any, index: np.ndarray) -> Any:
        """Rows `index` of an encoder state or a past, along the batch axis."""


# Options of a generation config that DecodeSettings takes as they are (generation.json and `for_model`).
GNMT_ALPHA = 0.6  # the default length penalty of beam search for models trained here (GNMT's alpha)
GENERATION_OPTIONS = ("min_length", "min_new_tokens", "no_repeat_ngram_size", "repetition_penalty", "bad_words_ids",
                      "do_sample", "temperature", "top_k", "top_p", "num_return_sequences")


class Hypothesis(NamedTuple):
    tokens: list[int]  # without bos/eos
    score: float  # beam: Hugging Face's sequences_scores (GNMT's for models trained here); else the sum of log-probs
    # With `output_token_logprobs`: the log-probability of each generated token where the search chose it, the
    # closing eos included when one was generated (so one more than `tokens` then): transformers'
    # compute_transition_scores (greedy and sampling: normalize_logits=True over the processed scores; beam: with
    # beam_indices). Greedy and sampling scores are their sum; a beam score is it length-penalised.
    token_logprobs: tuple[float, ...] | None = None


@dataclass(frozen=True)
class DecodeSettings:
    bos_id: int
    eos_id: int
    pad_id: int
    max_new_tokens: int  # eos included
    # The model's own decoding rules (Seq2SeqConfig: Hugging Face's forced bos/eos and suppressed tokens).
    forced_bos_id: int | None = None
    forced_eos: bool = False
    suppress_ids: tuple[int, ...] = ()
    # Hugging Face's logits processors that read what came before (its input_ids: the start token, then the
    # generated ones) and its length floors; min_length counts the start token, min_new_tokens does not.
    min_length: int = 0
    min_new_tokens: int = 0
    no_repeat_ngram_size: int = 0
    repetition_penalty: float = 1.0
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # sequences of two tokens or more; single ones are suppress_ids
    # Sampling (Hugging Face's warpers: temperature, top-k, top-p; its defaults) and what a search returns.
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    seed: int | None = None  # None: a fresh seed from the system
    # Draw by the inverse CDF (one uniform a row and step) instead of transformers' stream (B x V exponentials a
    # step): the same distribution, other samples for a seed, a fraction of the cost at a large vocabulary.
    fast_sampling: bool = False
    num_return_sequences: int = 1
    output_scores: bool = False
    output_token_logprobs: bool = False
    # A decoder prompt after the start token, fed as one prefill and not returned (Whisper's language, task and
    # <|notimestamps|>), and the ids the first generated token may not be (Whisper's begin_suppress_tokens).
    prompt: tuple[int, ...] = ()
    begin_suppress_ids: tuple[int, ...] = ()
    # A decoder prefix before the start token, fed in the same prefill and not returned (Whisper's previous text
    # under condition_on_prev_tokens: <|startofprev|> and the last tokens decoded). Every rule that counts
    # positions counts it as Hugging Face counts its decoder_input_ids (min_length, the history rules' input_ids).
    prefix: tuple[int, ...] = ()
    # Whisper's timestamp rule (`_timestamp_rule`): the timestamp tokens are the ids from `timestamp_begin` to the
    # vocabulary's end (<|notimestamps|> is the id before it); None: no timestamps. The first timestamp may be at
    # most `max_initial_timestamp_index` steps in (None: any).
    timestamp_begin: int | None = None
    max_initial_timestamp_index: int | None = None

    @classmethod
    def for_model(cls, cfg, max_new_tokens: int | None = None, generation: dict | None = None) -> "DecodeSettings":
        """The settings a `Seq2SeqConfig` implies, with an imported model's generation options (generation.json,
        GENERATION_OPTIONS; absent or null keys keep their defaults); `max_new_tokens` defaults to the model's own
        limit (an imported model's max_new_tokens / max_length), else to every position the decoder has."""
        if max_new_tokens is None:
            max_new_tokens = cfg.max_new_tokens if cfg.max_new_tokens is not None else cfg.max_tgt_len - 1
        options = {k: generation[k] for k in GENERATION_OPTIONS if (generation or {}).get(k) is not None}
        if "bad_words_ids" in options:
            options["bad_words_ids"] = tuple(tuple(w) for w in options["bad_words_ids"])
        return cls(cfg.bos_id, cfg.eos_id, cfg.pad_id, max_new_tokens, cfg.forced_bos_id, cfg.forced_eos,
                   tuple(cfg.suppress_ids), begin_suppress_ids=tuple(getattr(cfg, "begin_suppress_ids", ())), **options)

    @property
    def start(self) -> list[int]:
        """The decoder's first input: the prefix, the start token, then the prompt (one prefill)."""
        return [*self.prefix, self.bos_id, *self.prompt]

    @property
    def uses_history(self) -> bool:
        return self.repetition_penalty != 1.0 or self.no_repeat_ngram_size > 0 or bool(self.bad_words_ids)

    @property
    def reads_tokens(self) -> bool:
        """Whether `constrain` needs each row's generated tokens (the history rules, the timestamp rule)."""
        return self.uses_history or self.timestamp_begin is not None

    @property
    def constrained(self) -> bool:
        return (self.forced_bos_id is not None or self.forced_eos or bool(self.suppress_ids) or self.uses_history
                or self.min_length > len(self.start) or self.min_new_tokens > 0 or bool(self.begin_suppress_ids)
                or self.timestamp_begin is not None)

    @property
    def plain(self) -> bool:
        """Whether a search returns one token list a source (else lists of Hypothesis)."""
        return self.num_return_sequences == 1 and not self.output_scores and not self.output_token_logprobs

    def constrain(self, scores: np.ndarray, step: int, inplace: bool = False,
                  tokens: np.ndarray | None = None) -> np.ndarray:
        """Scores (b, V) of generated position `step` with the model's rules applied, as Hugging Face's logits
        processors apply them and in their order: repetition penalty, no-repeat n-grams, bad words, min_length,
        min_new_tokens, the ids suppressed at the first token, forced bos (only it left at step 0), forced eos (at
        the last step the limit allows), suppressed ids, then Whisper's timestamp rule (transformers' generate
        puts its processor last). `tokens` (b, step): each row's generated tokens, needed by the first three and the
        timestamp rule (None at step 0). `inplace` writes into `scores` instead of a copy. min_length counts the
        prefix, the start token and the prompt, as Hugging Face counts its input_ids."""
        if not self.constrained:
            return scores
        if not inplace:
            scores = scores.copy()
        if self.uses_history:
            self._history_rules(scores, np.zeros((len(scores), 0), np.int64) if tokens is None else tokens)
        if step + len(self.start) < self.min_length or step < self.min_new_tokens:
            scores[:, self.eos_id] = -np.inf
        if step == 0 and self.begin_suppress_ids:
            scores[:, list(self.begin_suppress_ids)] = -np.inf
        forced = self.forced_bos_id if step == 0 else None
        if self.forced_eos and step == self.max_new_tokens - 1:
            forced = self.eos_id
        if forced is not None:
            scores[:] = -np.inf
            scores[:, forced] = 0.0
        if self.suppress_ids:
            scores[:, list(self.suppress_ids)] = -np.inf
        if self.timestamp_begin is not None:
            if tokens is None and step:
                raise ConfigError("the timestamp rule reads each row's generated tokens; pass them as `tokens`")
            self._timestamp_rule(scores, step, np.zeros((len(scores), 0), np.int64) if tokens is None else tokens)
        return scores

    def _timestamp_rule(self, scores: np.ndarray, step: int, tokens: np.ndarray) -> None:
        """transformers' WhisperTimeStampLogitsProcessor in place: never <|notimestamps|>; timestamps come in pairs
        (after a pair text or eos, after a timestamp that follows text another timestamp or eos) except the one at
        the end; the first token is a timestamp, at most `max_initial_timestamp_index` in; timestamps never go back
        (nor repeat one that closed a pair); and where the timestamps' summed probability beats every text token's,
        only timestamps are left. The probabilities are its float32 log-softmax, row by row as it computes them."""
        import torch

        begin, eos = self.timestamp_begin, self.eos_id
        scores[:, begin - 1] = -np.inf
        for row, seq in enumerate(np.asarray(tokens).tolist()):
            last = len(seq) >= 1 and seq[-1] >= begin
            penultimate = len(seq) < 2 or seq[-2] >= begin
            if last:
                if penultimate:
                    scores[row, begin:] = -np.inf
                else:
                    scores[row, :eos] = -np.inf
            stamps = [t for t in seq if t >= begin]
            if stamps:  # a timestamp that opens a pair may repeat the one before; any other must exceed it
                floor = stamps[-1] if last and not penultimate else stamps[-1] + 1
                scores[row, begin:floor] = -np.inf
        if step == 0:
            scores[:, :begin] = -np.inf
            if self.max_initial_timestamp_index is not None:
                scores[:, begin + self.max_initial_timestamp_index + 1:] = -np.inf
        logp = torch.log_softmax(torch.from_numpy(np.asarray(scores, dtype=np.float32)), dim=-1)
        for row in range(len(scores)):
            if logp[row, begin:].logsumexp(dim=-1) > logp[row, :begin].max():
                scores[row, :begin] = -np.inf

    def _history_rules(self, scores: np.ndarray, tokens: np.ndarray) -> None:
        """Repetition penalty, no-repeat n-grams and bad words in place, over Hugging Face's input_ids."""
        import torch

        start = np.tile(np.asarray(self.start, np.int64), (len(scores), 1))
        seen = np.concatenate([start, np.asarray(tokens, np.int64)], 1)
        if self.repetition_penalty != 1.0:  # in torch: Hugging Face's own float32 arithmetic
            x, ids = torch.from_numpy(scores), torch.from_numpy(seen)
            picked = torch.gather(x, 1, ids)
            x.scatter_(1, ids, torch.where(picked < 0, picked * self.repetition_penalty,
                                           picked / self.repetition_penalty))
        n = self.no_repeat_ngram_size
        if n and seen.shape[1] + 1 >= n:
            for row, hist in enumerate(seen.tolist()):
                prefix = tuple(hist[len(hist) - n + 1:]) if n > 1 else ()
                banned = [g[-1] for g in zip(*(hist[i:] for i in range(n))) if g[:-1] == prefix]
                if banned:
                    scores[row, banned] = -np.inf
        for word in self.bad_words_ids:  # a word's last token, after its other tokens (generated ones only)
            if seen.shape[1] >= len(word):
                hit = (seen[:, seen.shape[1] - len(word) + 1:] == np.asarray(word[:-1])).all(1)
                scores[hit, word[-1]] = -np.inf

    def warp(self, scores):
        """Hugging Face's sampling warpers on float32 torch scores (b, V): temperature, top-k (ties with the k-th
        kept), top-p (ascending sort; drop where the cumulative probability <= 1 - top_p; keep one at least)."""
        import torch

        if self.temperature != 1.0:
            warped = scores / self.temperature
            if bool(torch.isinf(warped).logical_and_(torch.isfinite(scores)).any()):
                raise InputError(f"temperature {self.temperature!r} divides this model's scores past float32's range "
                                 "(transformers' sampling raises on them too); give a larger temperature")
            scores = warped
        if self.top_k:
            kth = torch.topk(scores, min(self.top_k, scores.shape[-1]))[0][..., -1, None]
            scores = scores.masked_fill(scores < kth, -float("inf"))
        if self.top_p < 1.0:
            ordered, order = torch.sort(scores, descending=False)
            drop = ordered.softmax(dim=-1).cumsum(dim=-1) <= (1 - self.top_p)
            drop[..., -1:] = False
            scores = scores.masked_fill(drop.scatter(1, order, drop), -float("inf"))
        return scores

    def __post_init__(self) -> None:
        for name in OPTION_RULES:
            problem = option_problem(name, getattr(self, name))
            if problem is not None:
                raise ConfigError(f"{name} must be {problem}, got {getattr(self, name)!r}")
        checks = (("bad_words_ids", all(len(w) >= 1 for w in self.bad_words_ids), "lists of one id or more"),
                  ("timestamp_begin", self.timestamp_begin is None or self.timestamp_begin >= 1,
                   ">= 1 (the id after <|notimestamps|>) or None"),
                  ("max_initial_timestamp_index",
                   self.max_initial_timestamp_index is None or self.max_initial_timestamp_index >= 0, ">= 0 or None"))
        for name, ok, rule in checks:
            if not ok:
                raise ConfigError(f"{name} must be {rule}, got {getattr(self, name)!r}")

    def generator(self):
        """The torch generator a sampling search draws from: seeded with `seed`, else from the system."""
        return seeded_generator(self.seed)


def _integer(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _finite(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_)) \
        and math.isfinite(value)


# The float32 scores are divided by the temperature: below the smallest normal float32 it is not even a float32
# (1e-45 rounds to the subnormal 1.4e-45), and every score divided by it overflows to inf, which transformers'
# sampling refuses (torch.multinomial raises on inf / NaN probabilities). Larger ones are checked on the scores.
MIN_TEMPERATURE = float(np.finfo(np.float32).tiny)
SEED_LIMIT = 2 ** 64  # torch.Generator.manual_seed takes an unsigned 64-bit seed
# The search options a caller sets (DecodeSettings fields): name -> (accepts(value), the rule in words). The one
# home of their rules: DecodeSettings checks its fields with them, and decode_jobs / speech name a failure by the
# flag or keyword that set it.
OPTION_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "max_new_tokens": (lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    "min_length": (lambda v: _integer(v) and v >= 0, "an integer >= 0"),
    "min_new_tokens": (lambda v: _integer(v) and v >= 0, "an integer >= 0"),
    "no_repeat_ngram_size": (lambda v: _integer(v) and v >= 0, "an integer >= 0 (0: off)"),
    "repetition_penalty": (lambda v: _finite(v) and v > 0, "a number > 0 such as 1.2 (1: off)"),
    "do_sample": (lambda v: isinstance(v, (bool, np.bool_)), "true or false"),
    "temperature": (lambda v: _finite(v) and v > 0, "a number > 0 such as 0.7"),
    "top_k": (lambda v: _integer(v) and v >= 0, "an integer >= 0 (0: the whole vocabulary)"),
    "top_p": (lambda v: _finite(v) and 0 < v <= 1, "a number in (0, 1] such as 0.9"),
    "seed": (lambda v: v is None or (_integer(v) and 0 <= v < SEED_LIMIT), "an integer in [0, 2**64)"),
    "fast_sampling": (lambda v: isinstance(v, (bool, np.bool_)), "true or false"),
    "num_return_sequences": (lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    "output_scores": (lambda v: isinstance(v, (bool, np.bool_)), "true or false"),
    "output_token_logprobs": (lambda v: isinstance(v, (bool, np.bool_)), "true or false"),
}


def option_problem(name: str, value: Any) -> str | None:
    """The rule `value` breaks as search option `name` (OPTION_RULES), in words; None when it is accepted."""
    accepts, rule = OPTION_RULES[name]
    if not accepts(value):
        return rule
    if name == "temperature" and value < MIN_TEMPERATURE:
        return f"at least {MIN_TEMPERATURE:.3g} (the smallest normal float32; every score divided by less overflows)"
    return None


def length_penalty_problem(alpha: Any, max_length: int) -> str | None:
    """The rule a length penalty `alpha` breaks for outputs of up to `max_length` tokens; None when accepted. Both
    penalties in use, GNMT's ((5 + n) / 6) ** alpha and Hugging Face's n ** alpha, divide float32 scores (sums of
    log-probabilities, far below 1e19 in magnitude) for every n in [1, max_length]: the penalty and its reciprocal
    must stay within sqrt(float32 max) ~ 1.8e19 so the quotient is finite and non-zero; their largest base is
    max_length, so |alpha| may be at most log(float32 max) / (2 log(max_length))."""
    if not _finite(alpha):
        return "a number such as 0.6"
    bound = math.log(float(np.finfo(np.float32).max)) / (2 * math.log(max(max_length, 2)))
    if abs(alpha) > bound:
        return (f"within +-{bound:.3g}: beyond it a hypothesis of {max_length} tokens has a length penalty "
                f"{max_length} ** alpha that overflows or vanishes in float32")
    return None


def seeded_generator(seed: int | None):
    """A torch generator seeded with `seed`, else from the system."""
    import torch

    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


StepHook = Callable[[int, np.ndarray, np.ndarray], None]  # (step, rows (b,), logits (b, V))


ChoiceHook = Callable[[int, np.ndarray, np.ndarray, np.ndarray], None]  # (step, rows, processed scores, tokens)


def greedy_decode(model: StepModel, input_ids: np.ndarray, attention_mask: np.ndarray, settings: DecodeSettings,
                  on_step: StepHook | None = None, generator=None, on_choice: ChoiceHook | None = None) -> list:
    """Greedy search, or sampling (`settings.do_sample`; `num_return_sequences` samples a source, drawn from
    `generator`, else from `settings.generator()`). Returns each source's tokens without bos/eos, or its
    Hypothesis list when `settings.plain` is not. Finished rows leave the batch. `on_choice` sees each step's
    scores after the model's rules (before the sampling warpers: Hugging Face's processed scores are those, then
    warped) and the tokens chosen from them."""
    if not settings.do_sample and settings.num_return_sequences > 1:
        raise ConfigError(f"greedy search returns one sequence a source, not num_return_sequences "
                          f"{settings.num_return_sequences}; use beam search with as many beams, or sampling")
    if settings.do_sample and settings.num_return_sequences > 1:  # Hugging Face's expansion: each source N times
        n = settings.num_return_sequences
        input_ids, attention_mask = np.repeat(input_ids, n, 0), np.repeat(attention_mask, n, 0)
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
        if sample is not None:
            tokens, chosen = sample(scores, rows, totals is not None)
        else:
            tokens = scores.argmax(-1)  # (b,) int64
            chosen = None if totals is None else _log_softmax32(scores).numpy()[np.arange(len(rows)), tokens]
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


def _top_n(x, n: int, chunk: int = 32):
    """torch.topk(x, n) of a float32 torch tensor (b, V), (values, indices) best first, in a fraction of its time at a
    wide vocabulary: torch's topk costs 4.5 ns an entry over 58,101 and far more a row on a batch, its own time at
    B=32 most of what sampling adds to a step. The row's n largest lie in the n chunks (of `chunk` entries; the row's
    last partial chunk always taken) whose maxima are largest: with t the n-th largest chunk maximum, n entries are
    at least t, so an entry of a chunk whose maximum is below t is below n others. Those n chunks and the tail are
    then the only candidates: 1,653 entries a row at n = 51 (32 x 1,815 maxima, one pass of amax, which torch
    vectorises from 32 entries a chunk). The values equal torch.topk's; among equal values the indices may come in
    another order (topk's own order there is unspecified); an entry tied with the n-th may be another such one."""
    import torch

    b, width = x.shape
    full = width // chunk
    if full <= 2 * n:  # narrow: nothing to save
        return torch.topk(x, n)
    blocks = x[:, : full * chunk].unfold(1, chunk, chunk)  # (b, full, chunk), a view
    best = torch.topk(blocks.amax(-1), n, sorted=False).indices  # (b, n)
    candidates = blocks[torch.arange(b)[:, None], best].reshape(b, -1)
    columns = (best[:, :, None] * chunk + torch.arange(chunk)).reshape(b, -1)
    if full * chunk < width:
        candidates = torch.cat([candidates, x[:, full * chunk:]], 1)
        columns = torch.cat([columns, torch.arange(full * chunk, width).expand(b, -1)], 1)
    values, at = torch.topk(candidates, n)
    return values, columns.gather(1, at)


def _chosen(logp, tokens: np.ndarray) -> np.ndarray:
    """logp (b, V) torch -> the (b,) entries at `tokens`."""
    return logp.numpy()[np.arange(len(tokens)), tokens]


def length_penalty(length: int, alpha: float) -> float:
    """GNMT's length penalty ((5 + |Y|) / 6) ** alpha (Wu et al., 2016); alpha = 0 is the raw log-probability."""
    return ((5.0 + length) / 6.0) ** alpha


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


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


def beam_search(model: StepModel, input_ids: np.ndarray, attention_mask: np.ndarray, settings: DecodeSettings,
                beam_size: int = 4, alpha: float = GNMT_ALPHA) -> list[list[int]]:
    """Beam search with GNMT length penalty. Returns the best hypothesis of each source, without bos/eos.
    A source that is done leaves the batch: its K rows are dropped from the model's state with the step's reorder."""
    n_best = _check_beams(settings, beam_size)
    B, K = input_ids.shape[0], beam_size
    expand = np.repeat(np.arange(B), K)  # (B*K,) source row of every beam
    # All K beams of a source start identical: the first step runs one row a source and its log-probabilities are
    # repeated K times, so what follows sees B x K rows (the state is expanded after that step).
    encoder_state, mask = model.encode(input_ids, attention_mask), attention_mask
    past = model.empty_past(B)
    sources = np.arange(B)  # source index of each live source
    scores = np.full((B, K), -np.inf)
    scores[:, 0] = 0.0  # all beams start identical: expand only the first
    beams: list[list[int]] = [[] for _ in range(B * K)]  # tokens of each live beam, row b*K + k
    # Each live beam's per-token log-probabilities (output_token_logprobs), beside `beams`.
    beam_lp: list[list[float]] | None = [[] for _ in range(B * K)] if settings.output_token_logprobs else None
    finished = [_Finished(K, alpha) for _ in range(B)]
    next_ids = np.tile(np.asarray(settings.start, np.int64), (B, 1))
    for step in range(settings.max_new_tokens):
        b_live = len(sources)
        logits, past = model.step(next_ids, mask, encoder_state, past)
        history = np.array(beams, np.int64).reshape(len(beams), step) if settings.reads_tokens and step else None
        logp = settings.constrain(log_softmax(logits), step, tokens=history)
        if step == 0 and K > 1:
            logp = np.repeat(logp, K, axis=0)
            encoder_state, mask = model.select(encoder_state, expand), mask[expand]
        V = logp.shape[-1]
        cand = (scores[:, :, None] + logp.reshape(b_live, K, V)).reshape(b_live, K * V)
        top = np.argsort(-cand, axis=1, kind="stable")[:, : 2 * K]  # (b, 2K): enough to refill K live beams
        new_scores = np.full((b_live, K), -np.inf)
        origin = np.repeat(np.arange(b_live) * K, K).reshape(b_live, K)
        new_tokens = np.full((b_live, K), settings.pad_id, dtype=np.int64)
        done = np.zeros(b_live, dtype=bool)
        for b in range(b_live):
            kept = finished[sources[b]]
            slot = 0
            for rank, flat in enumerate(top[b]):
                beam, token = divmod(int(flat), V)
                score = cand[b, flat]
                if not np.isfinite(score):
                    break
                if token == settings.eos_id:
                    if rank < K:
                        kept.add(beams[b * K + beam], score, ended=True, token_logprobs=None if beam_lp is None else
                                 beam_lp[b * K + beam] + [float(logp[b * K + beam, token])])
                    continue
                new_scores[b, slot], origin[b, slot], new_tokens[b, slot] = score, b * K + beam, token
                slot += 1
                if slot == K:
                    break
            done[b] = kept.is_done(new_scores[b].max(), step + 1)
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
            rows = _rows_of(stay, K)
            sources, scores, new_tokens, gather = sources[stay], scores[stay], new_tokens[stay], gather[rows]
            beams, mask, encoder_state = [beams[r] for r in rows], mask[rows], model.select(encoder_state, rows)
            beam_lp = None if beam_lp is None else [beam_lp[r] for r in rows]
        past = model.select(past, gather // K if step == 0 else gather)
        next_ids = new_tokens.reshape(-1, 1)
    else:
        for b, source in enumerate(sources):  # the length limit: live beams join their source's hypotheses
            for k in range(K):
                if np.isfinite(scores[b, k]):
                    finished[source].add(beams[b * K + k], scores[b, k], ended=False,
                                         token_logprobs=None if beam_lp is None else beam_lp[b * K + k])
    if settings.plain:
        return [kept.hyps[0][1] if kept.hyps else [] for kept in finished]
    return [[Hypothesis(tokens, float(score), lp) for score, tokens, lp in kept.hyps[:n_best]] for kept in finished]


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


def _top(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest entries of each row, best first (ties: lower index first)."""
    if k >= scores.shape[1]:
        return np.argsort(-scores, axis=1, kind="stable")
    part = np.sort(np.argpartition(-scores, k - 1, axis=1)[:, :k], axis=1)  # sorted: the stable sort keeps index order
    top = np.take_along_axis(part, np.argsort(-np.take_along_axis(scores, part, 1), axis=1, kind="stable"), 1)
    kth = np.take_along_axis(scores, top[:, -1:], 1)
    for row in np.flatnonzero((scores >= kth).sum(1) > k):  # a tie at the boundary: argpartition chose among it
        top[row] = np.argsort(-scores[row], kind="stable")[:k]
    return top


def _top_wide(scores, k: int, chunk: int = 64) -> np.ndarray:
    """`_top` of a wide float32 torch tensor (B, K x V) without sorting or selecting over all of it. The k-th largest
    of a row's chunk maxima (chunks of `chunk` entries, the row's last partial chunk one more) is at most the row's
    k-th largest value, since k chunks hold an entry at least that large; so the row's k best lie in the chunks whose
    maximum reaches it, a few of them. Their entries at or above it (every tie at the boundary included), sorted by
    value and then index, give exactly `_top`'s k (a row with fewer than k finite entries, a forced token's, takes
    its -inf entries in index order after them; a row with NaN is left to `_top`). On 32 x 4 x 58,101 scores, one
    thread: 2.7 ms, against 16 ms for one torch.topk of k + 1 and 37 ms for `_top`."""
    import torch

    b, n = scores.shape
    if n < max(16, 4 * k) * chunk:  # narrow: `_top` is as fast, and there must be k chunks at least
        return _top(scores.numpy(), k)
    full = n - n % chunk
    chunks = torch.as_strided(scores, (b, full // chunk, chunk), (n, chunk, 1))
    maxima = chunks.amax(-1)
    if full < n:
        maxima = torch.cat([maxima, scores[:, full:].amax(1, keepdim=True)], 1)
    floor = torch.topk(maxima, k, dim=1).values[:, -1].clamp(min=torch.finfo(scores.dtype).min).numpy()
    x, maxima = scores.numpy(), maxima.numpy()
    nan = np.isnan(maxima).any(1)
    row, at = np.nonzero(maxima >= floor[:, None])
    inner = at < full // chunk
    rows = np.repeat(row[inner], chunk)
    cols = (at[inner, None] * chunk + np.arange(chunk)).reshape(-1)
    if full < n:  # the partial chunk of the rows whose maximum it holds
        rows = np.concatenate([rows, np.repeat(row[~inner], n - full)])
        cols = np.concatenate([cols, np.tile(np.arange(full, n), int((~inner).sum()))])
    values = x[rows, cols]
    hit = values >= floor[rows]
    rows, cols, values = rows[hit], cols[hit], values[hit]
    order = np.lexsort((cols, -values, rows))  # by row, then value (best first), then index
    rows, cols = rows[order], cols[order]
    counts = np.bincount(rows, minlength=b)
    top = np.empty((b, k), dtype=np.int64)
    for r, start in enumerate(np.cumsum(counts) - counts):
        found = cols[start:start + min(counts[r], k)]
        if len(found) < k:  # fewer than k finite entries (a forced token): -inf ones follow in index order
            found = np.concatenate([found, np.flatnonzero(x[r] == -np.inf)[: k - len(found)]])
        top[r] = found if len(found) == k and not nan[r] else _top(x[r : r + 1], k)[0]
    return top


def _log_softmax32(logits: np.ndarray):
    """Float32 log-probabilities as a torch tensor (Hugging Face's `log_softmax(logits.float())`); sharing memory
    with numpy, so the loop's numpy code reads and writes the same array."""
    import torch

    return torch.log_softmax(torch.from_numpy(np.asarray(logits, dtype=np.float32)), dim=-1)


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
    expand = np.repeat(np.arange(B), K)  # (B*K,) source row of every beam
    # All K beams of a source start identical: the first step runs one row a source and its log-probabilities are
    # repeated K times, so what follows sees Hugging Face's B x K rows (the state is expanded after that step).
    encoder_state, mask = model.encode(input_ids, attention_mask), attention_mask
    past = model.empty_past(B)
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
    next_ids = np.tile(np.asarray(settings.start, np.int64), (B, 1))

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
            encoder_state, mask = model.select(encoder_state, expand), mask[expand]
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
            rows = _rows_of(stay, K)
            sources, running, running_scores = sources[stay], running[rows], running_scores[stay]
            finished, finished_scores = [finished[b] for b in stay], finished_scores[stay]
            running_lp, finished_lp = running_lp[rows], [finished_lp[b] for b in stay]
            is_finished, improvable, mask = is_finished[stay], improvable[stay], mask[rows]
            encoder_state, origin = model.select(encoder_state, rows), origin.reshape(b_live, K)[stay].reshape(-1)
        past = model.select(past, origin // K if step == 0 else origin)
        next_ids = np.ascontiguousarray(running[:, -1:])
    return results
