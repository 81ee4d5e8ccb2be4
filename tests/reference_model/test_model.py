"""The eager model against independent computations, in float64."""

import math

import pytest
import torch

from seq2trt.reference_model.model import AttentionKind, attention_core, sinusoid_table
from seq2trt.reference_model.sources import ordinary_ids


def test_sinusoid_table_is_the_papers_formula():
    table = sinusoid_table(50, 16)
    for pos in (0, 1, 7, 49):
        for i in range(8):
            angle = pos / 10000 ** (2 * i / 16)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-12)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-12)


def test_double_model_has_exact_float64_positions(make_model):
    model = make_model()
    assert model.positions.dtype == torch.float64
    assert torch.equal(model.positions, sinusoid_table(*model.positions.shape))


def naive_attention(q, k, v, allowed, scale):
    """Loop-per-query softmax attention: independent of the model's batched code."""
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            for t in range(q.shape[2]):
                keys = [j for j in range(k.shape[2]) if allowed(b, t, j)]
                w = torch.stack([(q[b, h, t] * k[b, h, j]).sum() * scale for j in keys])
                w = torch.exp(w - w.max())
                out[b, h, t] = sum(wi * v[b, h, j] for wi, j in zip(w / w.sum(), keys))
    return out


@pytest.mark.parametrize("past_len", [0, 1, 5])
def test_attention_core_matches_naive_causal(past_len):
    torch.manual_seed(0)
    B, H, T, Dh = 2, 3, 4, 5
    q, k, v = (torch.randn(B, T, H * Dh, dtype=torch.float64) for _ in range(3))
    past = tuple(torch.randn(B, H, past_len, Dh, dtype=torch.float64) for _ in range(2))
    out, (pk, pv) = attention_core(AttentionKind.DECODER_SELF, q, k, v, H, 0.3, past=past)
    split = lambda x: x.view(B, T, H, Dh).transpose(1, 2)
    assert torch.equal(pk, torch.cat([past[0], split(k)], 2)) and torch.equal(pv, torch.cat([past[1], split(v)], 2))
    ref = naive_attention(split(q), pk, pv, lambda b, t, j: j <= past_len + t, 0.3)
    torch.testing.assert_close(out, ref.transpose(1, 2).reshape(B, T, H * Dh), rtol=0, atol=1e-12)


def test_attention_core_matches_naive_padded():
    torch.manual_seed(1)
    B, H, T, S, Dh = 2, 2, 3, 6, 4
    q = torch.randn(B, T, H * Dh, dtype=torch.float64)
    k, v = (torch.randn(B, H, S, Dh, dtype=torch.float64) for _ in range(2))
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    out, _ = attention_core(AttentionKind.CROSS, q, k, v, H, 0.5, key_padding_mask=mask)
    ref = naive_attention(q.view(B, T, H, Dh).transpose(1, 2), k, v, lambda b, t, j: bool(mask[b, j]), 0.5)
    torch.testing.assert_close(out, ref.transpose(1, 2).reshape(B, T, H * Dh), rtol=0, atol=1e-12)


@pytest.mark.parametrize("pre_norm", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_cached_steps_equal_full_forward(make_model, pre_norm, activation):
    """Prefill + one-token steps through the KV cache give the teacher-forced logits at every position."""
    model = make_model(pre_norm=pre_norm, activation=activation)
    src_ids = torch.as_tensor(ordinary_ids(model.cfg, model.cfg.src_vocab_size))
    tgt_ids = torch.as_tensor(ordinary_ids(model.cfg, model.cfg.tgt_vocab_size))
    torch.manual_seed(2)
    src = src_ids[torch.randint(0, len(src_ids), (3, 9))]
    mask = torch.ones_like(src)
    mask[1, 6:] = 0
    tgt = tgt_ids[torch.randint(0, len(tgt_ids), (3, 8))]
    with torch.no_grad():
        full = model(src, mask, tgt)
        cross = model.cross_kv(model.encode(src, mask))
        logits, past = model.decode_step(tgt[:, :3], mask, cross, model.empty_past(3))  # prefill of 3
        steps = [logits]
        for t in range(3, 8):
            logits, past = model.decode_step(tgt[:, t:t + 1], mask, cross, past)
            steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-10)
    assert past[0][0].shape == (3, model.cfg.num_heads, 8, model.cfg.head_dim)


def test_padding_does_not_change_a_source(make_model):
    model = make_model()
    src = torch.tensor([[5, 6, 7, 2]])
    padded = torch.tensor([[5, 6, 7, 2, 0, 0, 0]])
    tgt = torch.tensor([[1, 4, 9]])
    with torch.no_grad():
        alone = model(src, torch.ones_like(src), tgt)
        pad = model(padded, (padded != 0).long(), tgt)
    torch.testing.assert_close(pad, alone, rtol=0, atol=1e-12)


def test_tied_embeddings_share_storage(make_model):
    model = make_model(tie_embeddings=True)
    assert model.lm_head.weight.data_ptr() == model.tgt_embed.weight.data_ptr()
