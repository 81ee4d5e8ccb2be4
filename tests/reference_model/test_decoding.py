"""Decoding loops: cached vs recomputed (float64), padding independence, beam search vs brute force."""

import itertools

import numpy as np
import pytest
import torch

from seq2trt.reference_model.decoding import (DecodeSettings, _top, _top_n, _top_wide, beam_search, greedy_decode,
                                              length_penalty, log_softmax)
from seq2trt.reference_model.eager import EagerStepModel, RecomputeStepModel
from seq2trt.reference_model.vocab import pad_batch

from helpers.sources import random_sources

SETTINGS = DecodeSettings(bos_id=1, eos_id=2, pad_id=0, max_new_tokens=12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_cached_equals_recompute(make_model, seed):
    model = make_model(seed)
    ids, mask = pad_batch(random_sources(model.cfg, 6, seed=seed, max_len=9))
    cached = greedy_decode(EagerStepModel(model), ids, mask, SETTINGS)
    recomputed = greedy_decode(RecomputeStepModel(model), ids, mask, SETTINGS)
    assert cached == recomputed
    assert len({tuple(c) for c in cached}) > 1, "degenerate model: every source decodes the same"


@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize("beam", [2, 4])
def test_beam_cached_equals_recompute(make_model, seed, beam):
    model = make_model(seed)
    ids, mask = pad_batch(random_sources(model.cfg, 6, seed=seed, max_len=9))
    assert beam_search(EagerStepModel(model), ids, mask, SETTINGS, beam) == \
        beam_search(RecomputeStepModel(model), ids, mask, SETTINGS, beam)


def test_greedy_step_logits_equal_recompute(make_model):
    model = make_model(5)
    ids, mask = pad_batch(random_sources(model.cfg, 6, seed=5, max_len=9))
    seen = {}
    greedy_decode(EagerStepModel(model), ids, mask, SETTINGS, lambda s, rows, lg: seen.setdefault(s, (rows, lg)))
    ref = {}
    greedy_decode(RecomputeStepModel(model), ids, mask, SETTINGS, lambda s, rows, lg: ref.setdefault(s, (rows, lg)))
    assert seen.keys() == ref.keys()
    for step in seen:
        np.testing.assert_array_equal(seen[step][0], ref[step][0])
        np.testing.assert_allclose(seen[step][1], ref[step][1], rtol=0, atol=1e-10)


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_padded_batch_decodes_like_each_source_alone(make_model, search):
    model = make_model(4)
    srcs = random_sources(model.cfg, 5, seed=4, max_len=9)
    step_model = EagerStepModel(model)
    run = (lambda i, m: greedy_decode(step_model, i, m, SETTINGS)) if search == "greedy" else \
        (lambda i, m: beam_search(step_model, i, m, SETTINGS, 3))
    batched = run(*pad_batch(srcs))
    alone = [run(*pad_batch([s]))[0] for s in srcs]
    assert batched == alone


def test_beam_search_drops_finished_sources_and_decodes_like_each_source_alone(make_model):
    """A source that is done leaves the batch (its K rows dropped with the reorder): the step model sees fewer rows
    as sources end, and each source's result is the one it gets decoded alone."""
    model = make_model(7)
    srcs = random_sources(model.cfg, 8, seed=6, max_len=9)  # these end after 1, 3, 7 and 12 tokens
    rows: list[int] = []

    class Counted(EagerStepModel):
        def step(self, input_ids, *args):
            rows.append(len(input_ids))
            return super().step(input_ids, *args)

    batched = beam_search(Counted(model), *pad_batch(srcs), SETTINGS, 3)
    alone = [beam_search(EagerStepModel(model), *pad_batch([s]), SETTINGS, 3)[0] for s in srcs]
    assert batched == alone
    assert len({len(b) for b in batched}) > 2, "sources must end at different steps to test this"
    assert rows[0] == 8, "the first step runs one row a source"
    assert rows[1:] == sorted(rows[1:], reverse=True) and rows[1] <= 24 and rows[-1] < 24
    assert all(r % 3 == 0 for r in rows[1:])


def test_beam_of_one_is_greedy(make_model):
    model = make_model(6)
    ids, mask = pad_batch(random_sources(model.cfg, 6, seed=6, max_len=9))
    step_model = EagerStepModel(model)
    assert beam_search(step_model, ids, mask, SETTINGS, 1, alpha=0.0) == greedy_decode(step_model, ids, mask, SETTINGS)


def test_wide_beam_finds_the_best_sequence_by_brute_force(make_model):
    """With a beam as wide as the search space, beam search returns the exhaustive optimum: every sequence
    that ends with eos within max_new_tokens, or that reaches max_new_tokens unfinished."""
    model = make_model(7, tgt_vocab_size=5)
    M, alpha = 3, 0.6
    settings = DecodeSettings(1, 2, 0, max_new_tokens=M)
    ids, mask = pad_batch([[4, 5, 6, 2]])

    def score(tokens):
        ended = len(tokens) < M
        targets = tokens + [2] if ended else tokens
        with torch.no_grad():
            dec = torch.tensor([[1] + targets[:-1]])
            logp = log_softmax(model(torch.as_tensor(ids), torch.as_tensor(mask), dec)[0].numpy())
        return sum(logp[i, t] for i, t in enumerate(targets)) / length_penalty(len(targets), alpha)

    candidates = [list(c) for n in range(0, M + 1) for c in itertools.product([0, 1, 3, 4], repeat=n)]
    best = max(candidates, key=score)
    found = beam_search(EagerStepModel(model), ids, mask, settings, beam_size=64, alpha=alpha)[0]
    assert found == best


def _wide_scores(kind: str, rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    x = rng.standard_normal((rows, n)).astype(np.float32) * 3
    if kind == "ties":  # many equal values, at the k-th place too
        x = np.round(x) / 2
    elif kind == "constant":
        x[:] = 0.25
    elif kind == "forced":  # a forced token: one finite entry a beam, the rest -inf
        x[:] = -np.inf
        x[:, rng.integers(0, n, 3)] = rng.standard_normal(3)
    elif kind == "beams":  # the first step of a beam search: beams after the first at -1e9
        x[:, n // 4:] -= 1e9
    elif kind == "tail":  # the best entries in the last, partial chunk
        x[:, -5:] += 100.0
    return x


@pytest.mark.parametrize("kind", ["normal", "ties", "constant", "forced", "beams", "tail"])
@pytest.mark.parametrize("k", [2, 8, 10, 40])
def test_wide_top_k_equals_a_full_stable_sort(kind, k):
    """The beam search's top-2K over B x (K x V) scores (chunk maxima bound the k-th value, only the chunks that reach
    it are sorted) gives exactly the full sort's k best: value first, then the lower index, ties at the boundary
    and -inf entries included."""
    rng = np.random.default_rng(k)
    for n in (1024, 1100, 4 * 1000 + 3, 3 * 4099, 40 * 1000 + 7):
        x = _wide_scores(kind, rng, 5, n)
        expected = np.argsort(-x, axis=1, kind="stable")[:, :k]
        assert (_top_wide(torch.from_numpy(x), k) == expected).all(), (kind, n)
        assert (_top(x, k) == expected).all(), (kind, n)


@pytest.mark.parametrize("kind", ["normal", "ties", "constant", "forced", "beams", "tail"])
@pytest.mark.parametrize("n", [1, 11, 51])
def test_fast_sampling_top_n_equals_torch_topk(kind, n):
    """Fast sampling's top-(k + 1) (candidates: the chunks with the largest maxima) gives torch.topk's values, best
    first, at distinct indices holding them: at B=1 and B=32, narrow and wide rows, ties and -inf entries."""
    rng = np.random.default_rng(n)
    for b, width in ((1, 100), (1, 58101), (32, 4099), (32, 58101), (3, 32 * 2 * 51 + 33)):
        x = torch.from_numpy(_wide_scores(kind, rng, b, width))
        values, index = _top_n(x, n)
        expected = torch.topk(x, n).values
        assert torch.equal(values, expected), (kind, b, width)
        assert torch.equal(x.gather(1, index), values), (kind, b, width)
        assert all(len(set(row)) == n for row in index.tolist()), (kind, b, width)


def test_wide_top_k_leaves_a_row_with_nan_to_the_exact_path():
    x = _wide_scores("normal", np.random.default_rng(0), 3, 4000)
    x[1, [7, 2500]] = np.nan
    assert (_top_wide(torch.from_numpy(x), 8) == _top(x, 8)).all()


def test_the_models_own_length_limit_is_the_default_and_a_given_one_wins():
    from seq2trt.reference_model import preset

    assert DecodeSettings.for_model(preset("tiny")).max_new_tokens == 31  # every position the decoder has
    limited = preset("tiny", max_new_tokens=9)
    assert DecodeSettings.for_model(limited).max_new_tokens == 9
    assert DecodeSettings.for_model(limited, 20).max_new_tokens == 20
