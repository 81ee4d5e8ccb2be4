"""`seq2trt bench` backends `ort-generate`, `ort-generate-int8` (`seq2trt ort-search --int8`) and `ort-generate-cuda`:
generate.onnx (ONNX Runtime's BeamSearch, the whole search in one session run) behind bench's timing interface
(bench_backends). Greedy runs are forced-length like every backend's (eos masked until `new_tokens` by BeamSearch's
min_length); beam runs search for real (eos stops a hypothesis).
It has no separate encoder or step call: those curves are not timed for it.
"""

from __future__ import annotations

import time
import numpy as np

from seq2trt.reference_model.decoding import DecodeSettings

from seq2trt.validation.bench.backends import peak_rss_mb, sequences, settle


class OrtSearchBackend:
    scope = "process"

    def __init__(self, name: str, model, cfg, threads: int, close=lambda: None):
        """`model`: an open `GenerateModel` (the registry's whole-search backends open it); `close` releases it."""
        self.name, self.model, self.cfg, self.threads, self._close = name, model, cfg, threads, close

    def activate(self) -> None:
        settle(self.threads)

    def decode(self, input_ids: np.ndarray, attention_mask: np.ndarray, new_tokens: int) -> tuple[float, list[float]]:
        settings = DecodeSettings.for_model(self.cfg, new_tokens)  # the rules built into the graph (imported models')
        start = time.perf_counter()
        self.model.decode(input_ids, attention_mask, settings, 1, forced_length=True)
        return time.perf_counter() - start, []

    def search(self, input_ids: np.ndarray, attention_mask: np.ndarray, settings: DecodeSettings, beam: int,
               length_penalty: float) -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        outputs = self.model.decode(input_ids, attention_mask, settings, beam, length_penalty)
        return time.perf_counter() - start, sequences(outputs)  # --n-best: every hypothesis, flattened

    def encode_seconds(self, input_ids, attention_mask):
        return None

    def step_seconds(self, input_ids, attention_mask, past_len, calls):
        return None

    def steps_by_past(self, input_ids, attention_mask, new_tokens):
        return None

    def memory(self) -> dict:
        return {"peak_rss_mb": round(peak_rss_mb(), 1), "scope": "process (shared by the in-process backends)"}

    def threading(self) -> str:
        return f"{self.threads} intra-op thread(s), one BeamSearch session"

    def close(self) -> None:
        self._close()

