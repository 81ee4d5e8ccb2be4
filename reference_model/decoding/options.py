"""The decoding options a caller sets, declared once (`DECODE_OPTIONS`): for each, the DecodeSettings field (or the
search argument) it sets, its Python keyword, its CLI flag, its served request input, its type, its rule, its help,
and whether ONNX Runtime's whole-search graph (ort-generate's BeamSearch) applies it. The CLI's click options
(cli/options.decode_options), the Translator's keyword checks, serve's request inputs (serving/model_config.py) and the
whole-search graph's refusals (runtime/decode_jobs.unsupported_in_graph) are all made from it, and a message names
an option as the caller spelled it (`spelling`). Old spellings stay as deprecated aliases that warn with the new name.

One spelling per concept: the beam count is `beam_size` everywhere (transformers' `num_beams` reads as "a number of
beams", `--beam` as a switch; `beam_size` is the decoding literature's and CTranslate2's name, and already the
searches' argument); the length penalty is `length_penalty` (transformers', CTranslate2's and bench's name; `alpha` is
the symbol of GNMT's formula, and still names the field inside). transformers' own `num_beams` stays where it is
transformers' API (`seq2trt.hf`, generation.json). A served request spells an option as the CLI and Python do
(`sample`, `token_logprobs`; `do_sample`, `output_token_logprobs` and `num_beams` are its deprecated inputs), but for
`output_scores`: `scores` is the served models' output tensor.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from seq2trt.core.errors import InputError


def _integer(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _finite(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_)) \
        and math.isfinite(value)


def _bool(value) -> bool:
    return isinstance(value, (bool, np.bool_))


# The float32 scores are divided by the temperature: below the smallest normal float32 it is not even a float32
# (1e-45 rounds to the subnormal 1.4e-45), and every score divided by it overflows to inf, which transformers'
# sampling refuses (torch.multinomial raises on inf / NaN probabilities). Larger ones are checked on the scores.
MIN_TEMPERATURE = float(np.finfo(np.float32).tiny)
SEED_LIMIT = 2 ** 64  # torch.Generator.manual_seed takes an unsigned 64-bit seed

Rule = tuple[Callable[[Any], bool], str]  # (accepts(value), the rule in words)
_BOOL: Rule = (_bool, "true or false")


@dataclass(frozen=True)
class DecodeOption:
    field: str  # the DecodeSettings field it sets, or the search's own argument (beam_size, alpha)
    kwarg: str  # Translator.translate / generate / transcribe's keyword
    flag: str  # the CLI flag (a bool with `negatable`: --x/--no-x)
    served: str | None  # the served request input (None: a request cannot set it)
    kind: type  # bool, int or float
    rule: Rule | None  # checked by DecodeSettings (None: by the search that takes it, decode_jobs.choose_search)
    help: str
    in_graph: bool  # ONNX Runtime's BeamSearch graph (ort-generate) applies it: refused there otherwise
    verbs: tuple[str, ...] = ("translate",)  # the CLI verbs that take its flag
    negatable: bool = False  # bool: --x/--no-x, default None (the model's); else an on-only switch
    sampling: bool = False  # how sampling draws: refused on a decode that does not sample
    default: Any = None  # the CLI's and the API's default (None: the model's own)
    served_type: str | None = None  # Triton's data type when the kind's (TYPE_BOOL/INT32/FP32) does not fit
    old_flags: tuple[str, ...] = ()  # deprecated spellings, still accepted with a warning naming the new one
    old_kwargs: tuple[str, ...] = ()
    old_served: tuple[str, ...] = ()

    @property
    def triton_type(self) -> str:
        return self.served_type or {bool: "TYPE_BOOL", int: "TYPE_INT32", float: "TYPE_FP32"}[self.kind]


GNMT_ALPHA = 0.6  # the default length penalty of beam search for models trained here (GNMT's alpha)
_INT0 = (lambda v: _integer(v) and v >= 0, "an integer >= 0")
_SEARCH = ("translate", "transcribe")
DECODE_OPTIONS: tuple[DecodeOption, ...] = (
    DecodeOption("beam_size", "beam_size", "--beam-size", "beam_size", int, None,
                 "Beam size; 1 is greedy. Default: the imported model's num_beams, else 1.", True, _SEARCH,
                 old_flags=("--beam",), old_kwargs=("beam",), old_served=("num_beams",)),
    DecodeOption("max_new_tokens", "max_new_tokens", "--max-new-tokens", "max_new_tokens", int,
                 (lambda v: _integer(v) and v >= 1, "an integer >= 1"),
                 "Tokens to generate at most (a window's, transcribing), eos included.", True, _SEARCH),
    DecodeOption("alpha", "length_penalty", "--length-penalty", None, float, None,
                 "GNMT length penalty (alpha) of beam search for models trained here (imported ones use their own); "
                 "with --backend ort-generate, Hugging Face's length_penalty (score / length ** penalty).", True,
                 default=GNMT_ALPHA, old_flags=("--alpha",), old_kwargs=("alpha",)),
    DecodeOption("do_sample", "sample", "--sample", "sample", bool, _BOOL,
                 "Sample (one beam) instead of searching. Default: the imported model's do_sample, else search.",
                 False, negatable=True, old_served=("do_sample",)),
    DecodeOption("temperature", "temperature", "--temperature", "temperature", float,
                 (lambda v: _finite(v) and v > 0, "a number > 0 such as 0.7"),
                 "Sampling temperature (default: the model's, else 1.0).", False, sampling=True),
    DecodeOption("top_k", "top_k", "--top-k", "top_k", int,
                 (lambda v: _integer(v) and v >= 0, "an integer >= 0 (0: the whole vocabulary)"),
                 "Sample among the k likeliest tokens; 0: all (default: the model's, else 50).", False, sampling=True),
    DecodeOption("top_p", "top_p", "--top-p", "top_p", float,
                 (lambda v: _finite(v) and 0 < v <= 1, "a number in (0, 1] such as 0.9"),
                 "Sample within top-p probability mass (default: the model's, else 1.0).", False, sampling=True),
    DecodeOption("seed", "seed", "--seed", "seed", int,
                 (lambda v: v is None or (_integer(v) and 0 <= v < SEED_LIMIT), "an integer in [0, 2**64)"),
                 "Seed of the sampling (transformers' torch.manual_seed). Default: random.", True, _SEARCH,
                 sampling=True, served_type="TYPE_INT64"),
    DecodeOption("min_new_tokens", "min_new_tokens", "--min-new-tokens", "min_new_tokens", int, _INT0,
                 "No eos before this many generated tokens.", True),
    DecodeOption("no_repeat_ngram_size", "no_repeat_ngram_size", "--no-repeat-ngram-size", "no_repeat_ngram_size",
                 int, (lambda v: _integer(v) and v >= 0, "an integer >= 0 (0: off)"),
                 "No n-gram of this size twice in a hypothesis; 0: off.", True),
    DecodeOption("repetition_penalty", "repetition_penalty", "--repetition-penalty", "repetition_penalty", float,
                 (lambda v: _finite(v) and v > 0, "a number > 0 such as 1.2 (1: off)"),
                 "CTRL's penalty on tokens already in the hypothesis; 1: off.", True),
    DecodeOption("num_return_sequences", "n_best", "--n-best", "n_best", int,
                 (lambda v: _integer(v) and v >= 1, "an integer >= 1"),
                 "Hypotheses a source: at most --beam-size, or this many samples (default: the model's "
                 "num_return_sequences, else 1).", True),
    # Served as output_scores, not `scores`: that is the name of the served models' output tensor of the scores
    # (FP32 [-1]), which clients read; an input of the same name would make one name two tensors of the model.
    DecodeOption("output_scores", "scores", "--scores", "output_scores", bool, _BOOL,
                 "Print each hypothesis's score (beam: Hugging Face's sequences_scores, GNMT's for models trained "
                 "here; greedy and sampling: the sum of its tokens' log-probabilities).", True),
    DecodeOption("output_token_logprobs", "token_logprobs", "--token-logprobs", "token_logprobs", bool, _BOOL,
                 "Also write each hypothesis's per-token log-probabilities to --output-ids (transformers' "
                 "compute_transition_scores; the closing eos has one).", False, old_served=("output_token_logprobs",)),
    DecodeOption("fast_sampling", "fast_sampling", "--fast-sampling", "fast_sampling", bool, _BOOL,
                 "With --sample: draw by the inverse CDF, one number a row and step (the same distribution; not "
                 "transformers' samples for a seed; much cheaper over a large vocabulary).", False, sampling=True),
    DecodeOption("min_length", "min_length", "--min-length", None, int, _INT0,
                 "transformers' min_length: no eos before it (the start token counts).", True),
)
OPTIONS = {o.field: o for o in DECODE_OPTIONS}
# The rules DecodeSettings checks its caller-set fields with (the options' own, in one place).
OPTION_RULES: dict[str, Rule] = {o.field: o.rule for o in DECODE_OPTIONS if o.rule is not None}
SAMPLING_ONLY = tuple(o.field for o in DECODE_OPTIONS if o.sampling)
# The DecodeSettings fields a caller sets through the search options (not beam_size / alpha: search arguments).
SETTING_FIELDS = tuple(o.field for o in DECODE_OPTIONS if o.field not in ("beam_size", "alpha", "max_new_tokens"))
# Generation settings an imported model may carry that no caller sets, which the whole-search graph cannot apply.
GRAPH_REFUSED_GENERATION = ("bad_words_ids",)


def spelling(surface: str) -> dict[str, str]:
    """{field: how `surface` spells it}: "flag" (the CLI), "kwarg" (the Python API) or "served" (a request input;
    options a request cannot set keep their flag)."""
    if surface == "served":
        return {o.field: o.served or o.flag for o in DECODE_OPTIONS}
    return {o.field: getattr(o, surface) for o in DECODE_OPTIONS}


def backend_name(flags: dict[str, str]) -> str:
    """How the caller whose options `flags` spells (a `spelling`) names the backend in advice: the CLI's
    `--backend ` or the Python API's `backend=`."""
    return "--backend " if flags["beam_size"].startswith("--") else "backend="


def renamed_kwargs(given: dict[str, Any], stacklevel: int = 3) -> dict[str, Any]:
    """`given` keywords with the deprecated spellings (`old_kwargs`) renamed to the current ones, each warned as a
    FutureWarning naming its new name; one option given by both spellings is refused."""
    old = {name: o.kwarg for o in DECODE_OPTIONS for name in o.old_kwargs}
    out = {k: v for k, v in given.items() if k not in old}
    for name, new in old.items():
        if name in given:
            warnings.warn(f"{name}= is deprecated; use {new}=", FutureWarning, stacklevel=stacklevel)
            if out.get(new) is not None:
                raise InputError(f"{name}= is the deprecated spelling of {new}=; give {new}= alone")
            out[new] = given[name]
    return out


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
