"""Random source ids for a model: ordinary ids only, whatever its special ids are (a fairseq-style model's are 0..2,
Marian's pad is its last id), each source ending with eos."""

from __future__ import annotations

import numpy as np


def ordinary_ids(cfg) -> np.ndarray:
    """The source ids that are none of pad, bos and eos, in increasing order."""
    return np.setdiff1d(np.arange(cfg.src_vocab_size), [cfg.pad_id, cfg.bos_id, cfg.eos_id])


def random_sources(cfg, count: int, seed: int = 0, max_len: int = 11) -> list[list[int]]:
    """`count` sources of 1..max_len random ordinary ids (each source's length drawn before its ids), eos last."""
    rng = np.random.default_rng(seed)
    ids = ordinary_ids(cfg)
    return [[int(t) for t in ids[rng.integers(0, ids.size, size=int(rng.integers(1, max_len + 1)))]] + [cfg.eos_id]
            for _ in range(count)]
