"""A pair of runners (encoder graph, decoder graph) as a `StepModel`, so `reference_model.decoding`'s greedy
and beam loops — the same code that drives the eager model — drive any backend, KV cache fed back.

Encoder state: the cross-attention K/V, keyed by their decoder input names. Past: the decoder self-attention
K/V keyed by their decoder input names, each (B, H, P, Dh) in the graph's dtype.
"""

from __future__ import annotations

import numpy as np

from seq2trt.exporters import spec
from seq2trt.core.errors import InputError
from seq2trt.reference_model.sources import source_kind

from seq2trt.runtime.runners import Runner

State = dict[str, np.ndarray]


_INT64 = np.dtype(np.int64)


def _int64(array: np.ndarray) -> np.ndarray:
    """The array as int64, without a numpy call when it already is one (the decoding loops pass int64)."""
    return array if array.dtype is _INT64 else np.asarray(array, dtype=np.int64)


class RunnerStepModel:
    def __init__(self, encoder: Runner, decoder: Runner):
        if encoder.kind is not spec.GraphKind.ENCODER or decoder.kind is not spec.GraphKind.DECODER:
            raise ValueError(f"need an encoder and a decoder runner, got {encoder.kind} and {decoder.kind}")
        self.encoder, self.decoder = encoder, decoder
        # output name -> decoder input name per side, computed once the config is known (an eager runner loads its
        # model when activated): a step is ~0.3 ms at batch 1 and every microsecond of Python around it shows.
        self._present_to_past: dict[str, dict[str, str]] = {}

    @property
    def cfg(self):
        return self.decoder.cfg

    def _names(self, side: str) -> dict[str, str]:
        names = self._present_to_past.get(side)
        if names is None:
            names = self._present_to_past[side] = spec.present_to_past(self.cfg, side)
        return names

    def encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> State:
        """The source kind's encoder feed (`sources.TokenIds.feed` / `AudioFeatures.feed`: token ids and their mask, or audio features alone) in
        the dtypes the encoder graph reads."""
        feed = source_kind(self.cfg).feed(input_ids, attention_mask)
        metadata = self.encoder.input_metadata()
        out = self.encoder.infer({name: np.asarray(value, dtype=metadata[name][0]) for name, value in feed.items()})
        return {past: out[present] for present, past in self._names("encoder").items()}

    def empty_past(self, batch: int) -> State:
        cfg = self.cfg
        names = list(self._names("decoder").values())
        dtype = self.decoder.input_metadata()[names[0]][0]
        empty = np.zeros((batch, cfg.num_heads, 0, cfg.head_dim), dtype=dtype)  # (B, H, 0, Dh)
        return dict.fromkeys(names, empty)

    def step(self, input_ids: np.ndarray, encoder_attention_mask: np.ndarray, encoder_state: State,
             past: State) -> tuple[np.ndarray, State]:
        feed = {"input_ids": _int64(input_ids), "encoder_attention_mask": _int64(encoder_attention_mask),
                **encoder_state, **past}
        # The first step's feed is checked against the spec in full; later steps only grow the past (built here
        # from the runner's own outputs), so they check just the one limit that growth can break — the full
        # check is ~10% of a one-token ORT step.
        past_len = next(iter(past.values())).shape[2]
        if past_len and past_len + input_ids.shape[1] > self.decoder.limits.max_tgt_len:
            raise InputError(f"the decoder would hold {past_len + input_ids.shape[1]} tokens (the start token, the "
                             f"prompt and the tokens generated so far), over the export's max_tgt_len "
                             f"{self.decoder.limits.max_tgt_len}; generate fewer tokens (max_new_tokens) or re-export "
                             "with a larger --max-tgt-len")
        out = self.decoder.infer(feed, check=False) if past_len else self.decoder.infer(feed)
        names = self._names("decoder")
        logits = out["logits"][:, -1]  # (B, V); float32 as it is, narrower types widened for the loops' arithmetic
        return (logits if logits.dtype == np.float32 else logits.astype(np.float64),
                {past: out[present] for present, past in names.items()})

    def select(self, state: State, index: np.ndarray) -> State:
        return {k: np.ascontiguousarray(v[index]) for k, v in state.items()}
