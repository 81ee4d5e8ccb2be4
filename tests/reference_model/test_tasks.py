import random

import pytest

from seq2trt.reference_model import InputError
from seq2trt.reference_model.tasks import get_task, number_to_words


@pytest.mark.parametrize("n, words", [
    (0, "zero"), (7, "seven"), (13, "thirteen"), (40, "forty"), (99, "ninety nine"), (100, "one hundred"),
    (101, "one hundred one"), (1000, "one thousand"), (40213, "forty thousand two hundred thirteen"),
    (1_000_001, "one million one"), (999_999_999, "nine hundred ninety nine million nine hundred ninety nine "
                                                  "thousand nine hundred ninety nine"),
])
def test_number_to_words(n, words):
    assert number_to_words(n) == words


def test_heldout_is_fixed_and_never_trained_on():
    task = get_task("numbers")
    heldout = task.heldout(1000)
    assert heldout == task.heldout(1000) and len({s for s, _ in heldout}) == 1000
    rng = random.Random(0)
    trained = {task.sample(rng)[0] for _ in range(20000)}
    assert not trained & {s for s, _ in heldout}


def test_vocabularies_encode_and_refuse_unknown_symbols():
    task = get_task("numbers")
    assert task.target_vocab.decode(task.target_vocab.encode("forty two")) == "forty two"
    with pytest.raises(InputError, match=r"outside the vocabulary: \['x'\]"):
        task.source_vocab.encode("12x")
    with pytest.raises(InputError, match="unknown task"):
        get_task("poetry")


def test_exact_match_scores_whole_texts_in_order():
    task = get_task("numbers")
    pairs = [("42", "forty two"), ("7", "seven"), ("100", "one hundred")]
    ids = lambda text: task.target_vocab.encode(text)
    assert task.exact_match([ids("forty two"), ids("seven"), ids("one hundred")], pairs) == 1.0
    assert task.exact_match([ids("forty two"), ids("seven one"), ids("seven")], pairs) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="one output per pair"):
        task.exact_match([ids("forty two")], pairs)
