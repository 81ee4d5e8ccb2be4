"""Built-in demo tasks: deterministic, translation-like seq2seq data generated in code (no downloads).

`numbers`: digits -> English words, e.g. "40213" -> "forty thousand two hundred thirteen". Sources are
characters, targets are words from a 32-word vocabulary. Numbers up to 999,999,999; the held-out split is
fixed by a hash of the number, so no held-out example is ever trained on, whatever the seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Sequence

from seq2trt.core.errors import InputError
from seq2trt.reference_model.vocab import Vocab

ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
        "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
SCALES = [(1_000_000, "million"), (1_000, "thousand")]


def _below_thousand(n: int) -> list[str]:
    words = []
    if n >= 100:
        words += [ONES[n // 100], "hundred"]
        n %= 100
    if n >= 20:
        words.append(TENS[n // 10])
        n %= 10
        if n:
            words.append(ONES[n])
    elif n or not words:
        words.append(ONES[n])
    return words


def number_to_words(n: int) -> str:
    if n == 0:
        return "zero"
    words = []
    for scale, name in SCALES:
        if n >= scale:
            words += _below_thousand(n // scale) + [name]
            n %= scale
    if n:
        words += _below_thousand(n)
    return " ".join(words)


@dataclass(frozen=True)
class Task:
    name: str
    source_vocab: Vocab
    target_vocab: Vocab
    sample: Callable[[random.Random], tuple[str, str]]  # a training pair
    heldout: Callable[[int], list[tuple[str, str]]]  # the fixed held-out pairs, first n

    def exact_match(self, outputs: Sequence[Sequence[int]], pairs: Sequence[tuple[str, str]]) -> float:
        """The task's metric: the fraction of `outputs` (target ids, eos excluded, one per pair of `pairs` in order)
        whose text is exactly the pair's target."""
        if len(outputs) != len(pairs) or not pairs:
            raise ValueError(f"exact match needs one output per pair, got {len(outputs)} outputs for {len(pairs)} pairs")
        return sum(self.target_vocab.decode(o) == target for o, (_, target) in zip(outputs, pairs)) / len(pairs)


def _is_heldout(n: int) -> bool:
    return (n * 2654435761) % 1009 < 20  # ~2% of numbers, spread over every magnitude


def _draw_number(rng: random.Random) -> int:
    digits = rng.randint(1, 9)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)


def _numbers_sample(rng: random.Random) -> tuple[str, str]:
    while True:
        n = _draw_number(rng)
        if not _is_heldout(n):
            return str(n), number_to_words(n)


def _numbers_heldout(count: int) -> list[tuple[str, str]]:
    rng, seen, pairs = random.Random(20171206), set(), []
    while len(pairs) < count:
        n = _draw_number(rng)
        if _is_heldout(n) and n not in seen:
            seen.add(n)
            pairs.append((str(n), number_to_words(n)))
    return pairs


_WORDS = sorted(set(ONES + TENS[2:] + ["hundred"] + [name for _, name in SCALES]))

TASKS: dict[str, Task] = {
    "numbers": Task("numbers", Vocab.build(list("0123456789"), "char"), Vocab.build(_WORDS, "word"),
                    _numbers_sample, _numbers_heldout),
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise InputError(f"unknown task {name!r}; available tasks: {', '.join(TASKS)}")
    return TASKS[name]
