"""What a source is, said once: how sources are checked, padded, fed to the encoder graph and made at random.

Every family seq2trt runs today reads token ids (`TokenIds`); a model whose encoder reads something else (audio
features) gets a kind of its own here, and `source_kind(cfg)` picks it. Random ids are drawn only among ordinary
tokens: never the pad, bos, eos or a suppressed id, wherever the family puts them (Marian's pad is its last id).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from seq2trt.reference_model.errors import InputError
from seq2trt.reference_model.vocab import pad_batch


def ordinary_ids(cfg, vocab_size: int) -> np.ndarray:
    """The ids of a vocabulary of `vocab_size` that are no special token of `cfg`."""
    special = [cfg.pad_id, cfg.bos_id, cfg.eos_id, *cfg.suppress_ids]
    if cfg.forced_bos_id is not None:
        special.append(cfg.forced_bos_id)
    allowed = np.setdiff1d(np.arange(vocab_size), special)
    return allowed if len(allowed) else np.arange(vocab_size)  # a toy vocabulary of specials only


class TokenIds:
    """Sources as lists of source-vocabulary ids; the encoder graph reads `input_ids` and `attention_mask`."""

    name = "token ids"
    encoder_inputs = ("input_ids", "attention_mask")

    def __init__(self, cfg):
        self.cfg = cfg

    def check(self, sources: Sequence[Sequence[int]], max_src_len: int, limit_name: str, origin: str,
              numbered: bool = True) -> None:
        """Refuse an empty source, one over the length limit, or ids outside the source vocabulary, naming which
        (`origin` and its number, or `origin` alone)."""
        vocab = self.cfg.src_vocab_size
        for n, ids in enumerate(sources, 1):
            where = f"{origin} {n}" if numbered else origin
            if not len(ids):
                raise InputError(f"{where} is empty; give at least one token")
            if len(ids) > max_src_len:
                raise InputError(f"{where} is {len(ids)} tokens, over {limit_name} {max_src_len}; shorten it")
            bad = [i for i in ids if not 0 <= i < vocab]
            if bad:
                raise InputError(f"{where} holds ids outside the source vocabulary [0, {vocab}): {bad[:5]}")

    def pad(self, sources: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Right-padded (B, L) int64 ids and their 1/0 attention mask."""
        return pad_batch([list(s) for s in sources], self.cfg.pad_id)

    def feed(self, ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
        """The encoder graph's inputs for a padded batch."""
        return {"input_ids": ids, "attention_mask": mask}

    def random(self, rng: np.random.Generator, count: int, max_tokens: int) -> list[list[int]]:
        """`count` sources of 1 .. `max_tokens` ordinary ids (uniform), each followed by eos, as the training data
        and the tokenizers end them."""
        allowed = ordinary_ids(self.cfg, self.cfg.src_vocab_size)
        lengths = rng.integers(1, max(1, max_tokens) + 1, size=count)
        return [[int(t) for t in rng.choice(allowed, size=int(n))] + [self.cfg.eos_id] for n in lengths]

    def random_batch(self, rng: np.random.Generator, batch: int, length: int, padded: bool = False
                     ) -> tuple[np.ndarray, np.ndarray]:
        """A (batch, length) batch of ordinary ids and its mask; `padded`: rows after the first lose 1 .. length-1
        tokens (pad ids under a 0 mask), the first stays full so the batch keeps its length."""
        ids = rng.choice(ordinary_ids(self.cfg, self.cfg.src_vocab_size), size=(batch, length)).astype(np.int64)
        lengths = np.full(batch, length)
        if padded and length > 1:
            lengths[1:] = rng.integers(1, length, size=batch - 1)
        mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.int64)
        ids[mask == 0] = self.cfg.pad_id
        return ids, mask


def random_target_ids(cfg, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Ordinary target-vocabulary ids of `shape`: decoder inputs for graph-level cases."""
    return rng.choice(ordinary_ids(cfg, cfg.tgt_vocab_size), size=shape).astype(np.int64)


def source_kind(cfg) -> TokenIds:
    """The source kind of a model config."""
    return TokenIds(cfg)
