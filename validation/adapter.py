"""A pair of runners (encoder graph, decoder graph) as a `StepModel`, so `reference_model.decoding`'s greedy
and beam loops — the same code that drives the eager model — drive any backend, KV cache fed back.

Encoder state: the cross-attention K/V, keyed by their decoder input names. Past: the decoder self-attention
K/V keyed by their decoder input names, each (B, H, P, Dh) in the graph's dtype.
"""

from __future__ import annotations

import numpy as np

from seq2trt.exporters import spec

from .runners import Runner

State = dict[str, np.ndarray]


class RunnerStepModel:
    def __init__(self, encoder: Runner, decoder: Runner):
        if encoder.kind is not spec.GraphKind.ENCODER or decoder.kind is not spec.GraphKind.DECODER:
            raise ValueError(f"need an encoder and a decoder runner, got {encoder.kind} and {decoder.kind}")
        self.encoder, self.decoder = encoder, decoder

    @property
    def cfg(self):
        return self.decoder.cfg

    def encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> State:
        out = self.encoder.infer({"input_ids": input_ids.astype(np.int64),
                                  "attention_mask": attention_mask.astype(np.int64)})
        return {spec.encoder_to_decoder_name(k): v for k, v in out.items() if k.startswith("present.")}

    def empty_past(self, batch: int) -> State:
        cfg = self.cfg
        dtype = self.decoder.input_metadata()[spec.kv_name(0, "decoder", "key", "past")][0]
        empty = np.zeros((batch, cfg.num_heads, 0, cfg.head_dim), dtype=dtype)  # (B, H, 0, Dh)
        return {spec.kv_name(i, "decoder", p, "past"): empty
                for i in range(cfg.num_decoder_layers) for p in ("key", "value")}

    def step(self, input_ids: np.ndarray, encoder_attention_mask: np.ndarray, encoder_state: State,
             past: State) -> tuple[np.ndarray, State]:
        feed = {"input_ids": input_ids.astype(np.int64), "encoder_attention_mask": encoder_attention_mask.astype(np.int64),
                **encoder_state, **past}
        out = self.decoder.infer(feed)
        present = {spec.present_to_past_name(k): v for k, v in out.items() if k.startswith("present.")}
        return out["logits"][:, -1].astype(np.float64), present  # (B, V)

    def select(self, state: State, index: np.ndarray) -> State:
        return {k: np.ascontiguousarray(v[index]) for k, v in state.items()}
