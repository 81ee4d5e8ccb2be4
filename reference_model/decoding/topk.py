"""The arithmetic every search shares: the k best entries of a row (exact, ties in index order; and without sorting
a wide row), log-softmax, the chosen tokens' log-probabilities and the length penalty."""

from __future__ import annotations

import numpy as np


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
