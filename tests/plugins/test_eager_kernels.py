"""The eager model with every attention block computed by the fused op's kernels
(`plugins.eager_kernels.kernel_attention`), on CPU in triton's interpreter: the kernels' contract matches the model's
blocks (encoder self-attention with padding, cross-attention, decoder prefill and cached steps), so decoding with them
agrees with the eager model.

The interpreter must be on before triton is first imported, so the decoding runs in a child process: this file run
as a script, printing one JSON line. On the GPU machine the same swap runs with the AOT cubins
(`python3 scripts/gpu_check.py eager`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _child() -> dict:
    import numpy as np
    import torch

    from seq2trt.plugins.eager_kernels import kernel_attention
    from seq2trt.reference_model import Seq2SeqTransformer, preset
    from seq2trt.reference_model.decoding import DecodeSettings, beam_search, greedy_decode
    from seq2trt.reference_model.eager import EagerStepModel
    from seq2trt.reference_model.model import MultiHeadAttention, attention_core

    torch.manual_seed(0)
    cfg = preset("tiny", src_vocab_size=13, tgt_vocab_size=17, d_model=64, num_heads=2, tie_embeddings=False)
    model = Seq2SeqTransformer(cfg).float().eval()
    with torch.no_grad():  # sharper logits than the default init: fewer near-ties between tokens
        model.lm_head.weight.mul_(8)
    rng = np.random.default_rng(0)
    lengths = [7, 3, 5]
    ids = np.zeros((3, 7), np.int64)
    mask = np.zeros((3, 7), np.int64)
    for row, n in enumerate(lengths):
        ids[row, :n], mask[row, :n] = rng.integers(3, 13, n), 1
    eager = EagerStepModel(model)
    settings = DecodeSettings(cfg.bos_id, cfg.eos_id, cfg.pad_id, 12)
    prefix = rng.integers(3, 17, (3, 4))

    def teacher_forced() -> list[np.ndarray]:
        """Logits of a 4-token prefill (causal, past 0), then 3 cached one-token steps."""
        state = eager.encode(ids, mask)
        logits, past = eager.step(prefix, mask, state, eager.empty_past(3))
        out = [logits]
        for t in range(3):
            logits, past = eager.step(prefix[:, t:t + 1], mask, state, past)
            out.append(logits)
        return out

    want = teacher_forced(), greedy_decode(eager, ids, mask, settings), beam_search(eager, ids, mask, settings, 3)
    with kernel_attention(model):
        got = teacher_forced(), greedy_decode(eager, ids, mask, settings), beam_search(eager, ids, mask, settings, 3)
    return {"logit_max_abs": [float(np.abs(g - w).max()) for g, w in zip(got[0], want[0])],
            "logit_scale": float(max(np.abs(w).max() for w in want[0])),
            "greedy": [got[1], want[1]], "beam": [got[2], want[2]],
            "restored": all(m.core is attention_core for m in model.modules() if isinstance(m, MultiHeadAttention))}


@pytest.fixture(scope="module")
def result() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_logits_through_the_kernels_match_the_eager_model(result):
    assert len(result["logit_max_abs"]) == 4  # the prefill and three cached steps
    assert max(result["logit_max_abs"]) <= 1e-4 * max(1.0, result["logit_scale"]), result


def test_decoding_through_the_kernels_picks_the_eager_tokens(result):
    got, want = result["greedy"]
    assert got == want and any(want)
    got, want = result["beam"]
    assert got == want


def test_the_swap_is_undone(result):
    assert result["restored"]


if __name__ == "__main__":
    print(json.dumps(_child()))
