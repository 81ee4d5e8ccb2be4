"""Random sources for tests, seeded by a number: ordinary ids only, as the source kind defines them
(reference_model/sources.py: never pad, bos, eos or a suppressed or forced id, wherever a family puts them; Marian's
pad is its last id), each source ending with eos."""

from __future__ import annotations

import numpy as np

from seq2trt.reference_model.sources import ordinary_ids


def random_sources(cfg, count: int, seed: int = 0, max_len: int = 11) -> list[list[int]]:
    """`count` sources of 1..max_len random ordinary ids of `cfg`'s source vocabulary (each source's length drawn
    before its ids), eos last."""
    rng = np.random.default_rng(seed)
    ids = ordinary_ids(cfg, cfg.src_vocab_size)
    return [[int(t) for t in ids[rng.integers(0, ids.size, size=int(rng.integers(1, max_len + 1)))]] + [cfg.eos_id]
            for _ in range(count)]
