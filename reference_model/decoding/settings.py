"""What a search is asked: the step model it drives (`StepModel`), its settings (`DecodeSettings`, the one validator
of decoding options, by the rules options.DECODE_OPTIONS declares), and the hypotheses it returns."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np

from seq2trt.reference_model.decoding.options import OPTION_RULES, option_problem
from seq2trt.core.errors import ConfigError, InputError


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

    def with_options(self, given: dict[str, Any], names: dict[str, str]) -> "DecodeSettings":
        """These settings with a caller's options `given` (DecodeSettings fields) set, each checked by its rule
        first and a failure named as the caller spelled it (`names`: options.spelling(...): a flag, a keyword or a
        request input), as an InputError."""
        for key, value in given.items():
            problem = option_problem(key, value)
            if problem is not None:
                raise InputError(f"{names[key]} must be {problem}, got {value!r}")
        return dataclasses.replace(self, **given)

    def generator(self):
        """The torch generator a sampling search draws from: seeded with `seed`, else from the system."""
        return seeded_generator(self.seed)


def seeded_generator(seed: int | None):
    """A torch generator seeded with `seed`, else from the system."""
    import torch

    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen
