"""The eager model behind the `StepModel` interface: with its KV cache, and without one (the reference).

`EagerStepModel` is the backend the other backends are compared with. `RecomputeStepModel` keeps no cache
at all — every step re-runs the full teacher-forced forward over all tokens so far — which makes it an
independent check of the cached path.
"""

from __future__ import annotations

import numpy as np
import torch

from seq2trt.reference_model.model import Seq2SeqTransformer


class EagerStepModel:
    def __init__(self, model: Seq2SeqTransformer, device: str | torch.device = "cpu"):
        self.model = model.eval()
        self.device = torch.device(device)
        self.dtype = next(model.parameters()).dtype

    def _ids(self, array: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.ascontiguousarray(array), dtype=torch.int64, device=self.device)

    def _source(self, array: np.ndarray) -> torch.Tensor:
        """Token ids as int64; audio features (floating point) in the model's dtype."""
        if np.issubdtype(np.asarray(array).dtype, np.floating):
            return torch.as_tensor(np.ascontiguousarray(array), device=self.device).to(self.dtype)
        return self._ids(array)

    @torch.inference_mode()
    def encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> list:
        hidden = self.model.encode(self._source(input_ids), self._ids(attention_mask))
        return self.model.cross_kv(hidden)

    @torch.inference_mode()
    def empty_past(self, batch: int) -> list:
        return self.model.empty_past(batch)

    @torch.inference_mode()
    def step(self, input_ids: np.ndarray, encoder_attention_mask: np.ndarray, encoder_state: list,
             past: list) -> tuple[np.ndarray, list]:
        logits, present = self.model.decode_step(self._ids(input_ids), self._ids(encoder_attention_mask),
                                                 encoder_state, past)
        return logits[:, -1].double().cpu().numpy(), present

    def select(self, state: list, index: np.ndarray) -> list:
        idx = self._ids(index)
        return [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in state]


class RecomputeStepModel:
    """No cache: the 'past' is the token history, and each step recomputes everything from the source."""

    def __init__(self, model: Seq2SeqTransformer):
        self.model = model.eval()

    def encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return input_ids, attention_mask

    def empty_past(self, batch: int) -> np.ndarray:
        return np.zeros((batch, 0), dtype=np.int64)

    @torch.inference_mode()
    def step(self, input_ids: np.ndarray, encoder_attention_mask: np.ndarray,
             encoder_state: tuple[np.ndarray, np.ndarray], past: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        history = np.concatenate([past, input_ids], axis=1)
        src, src_mask = (torch.as_tensor(a) for a in encoder_state)
        logits = self.model(src, src_mask, torch.as_tensor(history))
        return logits[:, -1].double().numpy(), history

    def select(self, state, index: np.ndarray):
        if isinstance(state, tuple):
            return tuple(a[index] for a in state)
        return state[index]
