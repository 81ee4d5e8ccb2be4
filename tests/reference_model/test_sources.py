"""The source kind: random sources hold only ordinary ids, wherever a family puts its specials; checks name the bad
source; padding and the encoder feed are what the graphs read."""

import numpy as np
import pytest

from seq2trt.reference_model.config import preset
from seq2trt.core.errors import InputError
from seq2trt.reference_model.sources import TokenIds, ordinary_ids, random_target_ids, source_kind


@pytest.fixture
def marian_like():
    # Marian: pad is the last id and the decoder starts with it; eos is 0
    return preset("tiny", src_vocab_size=12, tgt_vocab_size=12, pad_id=11, bos_id=11, eos_id=0, suppress_ids=(5,))


def test_random_sources_never_hold_a_special_id(marian_like):
    kind = source_kind(marian_like)
    assert isinstance(kind, TokenIds) and kind.encoder_inputs == ("input_ids", "attention_mask")
    sources = kind.random(np.random.default_rng(0), 400, 9)
    body = np.concatenate([s[:-1] for s in sources])
    assert set(body.tolist()) == set(range(1, 11)) - {5}  # every ordinary id appears; pad 11, eos 0, suppressed 5 never
    assert all(s[-1] == 0 for s in sources)
    assert {len(s) for s in sources} == set(range(2, 11))  # 1 .. 9 ordinary ids, then eos
    assert kind.random(np.random.default_rng(0), 400, 9) == sources  # seeded


def test_random_batch_pads_rows_after_the_first(marian_like):
    kind = source_kind(marian_like)
    ids, mask = kind.random_batch(np.random.default_rng(1), 6, 7, padded=True)
    assert ids.shape == mask.shape == (6, 7) and ids.dtype == mask.dtype == np.int64
    assert mask[0].all() and not mask[1:].all(axis=1).all()
    assert (ids[mask == 0] == 11).all() and set(ids[mask == 1].tolist()) <= set(range(1, 11)) - {5}
    targets = random_target_ids(marian_like, np.random.default_rng(2), (50, 4))
    assert not np.isin(targets, [0, 5, 11]).any()


def test_pad_and_feed(marian_like):
    kind = source_kind(marian_like)
    ids, mask = kind.pad([[3, 4, 0], [7, 0]])
    assert ids.tolist() == [[3, 4, 0], [7, 0, 11]] and mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert set(kind.feed(ids, mask)) == set(kind.encoder_inputs)


@pytest.mark.parametrize("sources, message", [
    ([[3], []], "source 2 is empty; give at least one token"),
    ([[3] * 9], "source 1 is 9 tokens, over max_src_len 8; shorten it"),
    ([[3, 12, -1]], r"source 1 holds ids outside the source vocabulary \[0, 12\): \[12, -1\]"),
])
def test_check_names_the_bad_source(marian_like, sources, message):
    with pytest.raises(InputError, match=message):
        source_kind(marian_like).check(sources, 8, "max_src_len", "source")


def test_a_vocabulary_of_specials_only_still_draws():
    cfg = preset("tiny", src_vocab_size=3, tgt_vocab_size=3)
    assert ordinary_ids(cfg, 3).tolist() == [0, 1, 2]
