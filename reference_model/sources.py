"""What a source is, said once: how sources are checked, padded, fed to the encoder graph and made at random.

Every family seq2trt runs today reads token ids (`TokenIds`); a model whose encoder reads something else (audio
features) gets a kind of its own here, and `source_kind(cfg)` picks it. Random ids are drawn only among ordinary
tokens: never the pad, bos, eos or a suppressed id, wherever the family puts them (Marian's pad is its last id).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from seq2trt.core.errors import InputError
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


class AudioFeatures:
    """Sources as log-mel features (n_mels, 2 x max_src_len) float32, each 30 s of audio (Whisper's
    `input_features`; `exporters.whisper_features` computes them from samples). The encoder graph reads
    `input_features` alone; the decoder's `encoder_attention_mask` over the max_src_len encoder positions is all
    ones (Whisper masks nothing), so the decoder graph and every search stay as they are for token ids."""

    name = "audio features"
    encoder_inputs = ("input_features",)

    def __init__(self, cfg):
        self.cfg = cfg

    @property
    def shape(self) -> tuple[int, int]:
        return self.cfg.n_mels, self.cfg.source_frames

    def check(self, sources: Sequence[np.ndarray], max_src_len: int, limit_name: str, origin: str,
              numbered: bool = True) -> None:
        """Refuse features of another shape, or holding NaN or infinity, naming which."""
        for n, features in enumerate(sources, 1):
            where = f"{origin} {n}" if numbered else origin
            shape = np.shape(features)
            if shape != self.shape:
                raise InputError(f"{where} holds features of shape {shape}; this model reads {self.shape} "
                                 f"(n_mels, frames: 30 s of 16 kHz audio); compute them with its feature extractor")
            if not np.isfinite(np.asarray(features, dtype=np.float32)).all():
                raise InputError(f"{where} holds NaN or infinite features; check the audio it was computed from")

    def pad(self, sources: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """The (B, n_mels, frames) float32 batch (every source is already 30 s) and the all-ones (B, max_src_len)
        int64 mask of the encoder positions."""
        batch = np.stack([np.asarray(f, dtype=np.float32) for f in sources])
        return batch, np.ones((len(batch), self.cfg.max_src_len), dtype=np.int64)

    def feed(self, features: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
        """The encoder graph's inputs for a batch (the mask is the decoder's, not the encoder's)."""
        return {"input_features": features}

    def random(self, rng: np.random.Generator, count: int, max_tokens: int = 0) -> list[np.ndarray]:
        """`count` random feature arrays in the range Whisper's extractor produces ((log10 mel + 4) / 4 after its
        8-decade clamp: about -1 .. 1.5), smooth along time as speech features are (a random walk, clipped)."""
        steps = rng.normal(0.0, 0.15, size=(count, *self.shape))
        walk = np.cumsum(steps, axis=2) + rng.uniform(-0.5, 1.0, size=(count, self.shape[0], 1))
        return list(np.clip(walk, -1.0, 1.5).astype(np.float32))

    def random_batch(self, rng: np.random.Generator, batch: int, length: int = 0, padded: bool = False
                     ) -> tuple[np.ndarray, np.ndarray]:
        """A (batch, n_mels, frames) batch of random features and its all-ones mask; `length` and `padded` do not
        apply (every audio source is 30 s, none is padded)."""
        return self.pad(self.random(rng, batch))


def source_kind(cfg) -> TokenIds | AudioFeatures:
    """The source kind of a model config: audio features when it has mel bins (`n_mels`), else token ids."""
    return AudioFeatures(cfg) if getattr(cfg, "n_mels", 0) else TokenIds(cfg)
