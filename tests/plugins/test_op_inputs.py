"""The fused op's inputs in one place (`op.pack_inputs` / `unpack_inputs`), and its optional position bias.

The position bias (T5's relative position bias, by signed distance) is checked in the op's reference against a
loop-per-query softmax written here in float64, for encoder self-attention over a padded batch and for decoder
self-attention at past lengths 0 and > 0 (the query position is the past length), with attention scale 1.0. The
eager model's attention core agrees with it, and the model computed through the op (`op_core`) equals the model.
"""

from __future__ import annotations

import pytest
import torch

from seq2trt.exporters import attention_functions
from seq2trt.plugins import op
from seq2trt.plugins.eager_kernels import kernel_attention
from seq2trt.plugins.op import INPUTS, AttentionAttrs, AttentionKind, pack_inputs, reference_attention, unpack_inputs
from seq2trt.reference_model.model import attention_core

B, H, DH, M = 2, 3, 4, 12  # M: the positions the bias covers; its columns are 2M - 1 signed distances


def naive(q, k, v, allowed, scale, bias, first_query):
    """softmax(q.k * scale + bias[h, M - 1 + j - i]) v, one query row at a time; a row with no key: mean of V."""
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            for t in range(q.shape[2]):
                i = first_query + t  # the query's position
                keys = [j for j in range(k.shape[2]) if allowed(b, i, j)] or list(range(k.shape[2]))
                w = torch.stack([(q[b, h, t] * k[b, h, j]).sum() * scale + bias[h, M - 1 + j - i] for j in keys])
                w = torch.exp(w - w.max())
                out[b, h, t] = sum(wi * v[b, h, j] for wi, j in zip(w / w.sum(), keys))
    return out


def split(x):
    return x.view(x.shape[0], x.shape[1], H, DH).transpose(1, 2)  # (B, H, T, Dh)


def merge(x):
    return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], H * DH)  # (B, T, D)


def test_encoder_bias_against_the_loop():
    torch.manual_seed(0)
    T = 7
    q, k, v = (torch.randn(B, T, H * DH, dtype=torch.float64) for _ in range(3))
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    bias = torch.randn(H, 2 * M - 1, dtype=torch.float64) * 2
    attrs = AttentionAttrs(AttentionKind.ENCODER_SELF, H, DH, 1.0)
    (got,) = reference_attention(attrs, *pack_inputs(attrs.kind, q, k, v, mask, position_bias=bias))
    want = merge(naive(split(q), split(k), split(v), lambda b, i, j: bool(mask[b, j]), 1.0, bias, 0))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    core, _ = attention_core(attrs.kind, q, k, v, H, 1.0, key_padding_mask=mask, position_bias=bias)
    torch.testing.assert_close(core, want, rtol=0, atol=1e-12)
    (unbiased,) = reference_attention(attrs, *pack_inputs(attrs.kind, q, k, v, mask))
    assert (unbiased - want).abs().max() > 1e-2  # the bias is not lost on the way


@pytest.mark.parametrize("past_len, T", [(0, 5), (4, 1), (6, 3), (M - 1, 1)])
def test_decoder_bias_reads_rows_from_the_past_length(past_len, T):
    torch.manual_seed(past_len)
    q, k, v = (torch.randn(B, T, H * DH, dtype=torch.float64) for _ in range(3))
    past = tuple(torch.randn(B, H, past_len, DH, dtype=torch.float64) for _ in range(2))
    bias = torch.randn(H, 2 * M - 1, dtype=torch.float64) * 2
    attrs = AttentionAttrs(AttentionKind.DECODER_SELF, H, DH, 1.0)
    got, pk, pv = reference_attention(attrs, *pack_inputs(attrs.kind, q, k, v, past=past, position_bias=bias))
    assert torch.equal(pk, torch.cat([past[0], split(k)], 2)) and torch.equal(pv, torch.cat([past[1], split(v)], 2))
    want = merge(naive(split(q), pk, pv, lambda b, i, j: j <= i, 1.0, bias, past_len))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    core, (ck, cv) = attention_core(attrs.kind, q, k, v, H, 1.0, past=past, position_bias=bias)
    torch.testing.assert_close(core, want, rtol=0, atol=1e-12)
    assert torch.equal(ck, pk) and torch.equal(cv, pv)


def test_pack_order_is_the_ops_inputs():
    """Each kind's tensors come out in `INPUTS[kind]`'s order, the bias last; unpack names them back."""
    q, k, v, pk, pv, bias = (torch.full((1,), float(i)) for i in range(6))
    mask = torch.ones(1, dtype=torch.int64)
    expect = {AttentionKind.ENCODER_SELF: {"query": q, "key": k, "value": v, "key_padding_mask": mask},
              AttentionKind.DECODER_SELF: {"query": q, "key": k, "value": v, "past_key": pk, "past_value": pv},
              AttentionKind.CROSS: {"query": q, "cross_key": k, "cross_value": v, "key_padding_mask": mask}}
    for kind, named in expect.items():
        mask_in = mask if "key_padding_mask" in named else None
        past = (pk, pv) if kind is AttentionKind.DECODER_SELF else None
        packed = pack_inputs(kind, q, k, v, mask_in, past)
        assert len(packed) == len(INPUTS[kind]) == len(named)
        for name, got in zip(INPUTS[kind], packed):
            assert torch.equal(got, named[name]), (kind, name)
        if mask_in is not None:
            assert packed[INPUTS[kind].index("key_padding_mask")].dtype == torch.int32  # the op's mask dtype
        ins = unpack_inputs(kind, packed)
        assert (ins.query, ins.key, ins.value, ins.position_bias) == (q, k, v, None)
        if kind is not AttentionKind.CROSS:
            biased = pack_inputs(kind, q, k, v, mask_in, past, position_bias=bias)
            assert biased[-1] is bias and op.input_names(kind, True)[-1] == op.POSITION_BIAS
            assert unpack_inputs(kind, biased).position_bias is bias


def test_pack_refuses_what_the_op_does_not_take():
    q = torch.zeros(1, 1, 4)
    with pytest.raises(ValueError, match="CROSS attention takes no position bias"):
        pack_inputs(AttentionKind.CROSS, q, q, q, torch.ones(1, 1), position_bias=torch.zeros(1, 1))
    with pytest.raises(ValueError, match="key_padding_mask"):
        pack_inputs(AttentionKind.ENCODER_SELF, q, q, q)
    with pytest.raises(ValueError, match="past_key, past_value"):
        pack_inputs(AttentionKind.DECODER_SELF, q, q, q)
    with pytest.raises(ValueError, match="takes 4 inputs"):
        unpack_inputs(AttentionKind.CROSS, (q,) * 5)


def test_scale_one_is_an_attribute():
    attrs = AttentionAttrs(AttentionKind.ENCODER_SELF, 6, 64, 1.0)
    assert AttentionAttrs.from_onnx(attrs.onnx_attributes()) == attrs


def test_the_model_through_the_op_with_a_bias(make_model):
    """A T5-shaped model computed through `op_core` with the op's reference as its run equals the model."""
    model = make_model(positions="none", norm="rms", gated_ffn=True, activation="gelu_tanh", bias=False, pre_norm=True,
                       scale_attention=False, relative_bias="shared", relative_buckets=8, relative_max_distance=6,
                       d_kv=6)
    torch.manual_seed(3)
    src, tgt = torch.randint(3, 13, (2, 20)), torch.randint(3, 17, (2, 9))
    mask = torch.ones_like(src)
    mask[1, 12:] = 0
    with torch.no_grad():
        want = model(src, mask, tgt)
        with kernel_attention(model, lambda attrs, inputs: reference_attention(attrs, *inputs)):
            got = model(src, mask, tgt)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_one_lowest_fp32():
    assert attention_functions.LOWEST_FP32 is op.LOWEST_FP32
