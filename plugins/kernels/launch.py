"""Launchers: the fused attention op (`plugins.op`) on torch tensors through the Triton kernels of `attention`.

`attention(attrs, *inputs)` takes the op's inputs in the op's order and returns its outputs, like
`plugins.op.reference_attention`. It runs wherever triton does: on a GPU, or on CPU tensors with TRITON_INTERPRET=1
set before triton is first imported. The grids and the flash-decoding split count computed here are the ones the
TensorRT plugin must reproduce (`decode_splits`, `decode_workspace_bytes`).

`random_inputs` builds seeded inputs of the op for the interpreter tests and the GPU check.
"""

from __future__ import annotations

import math

import torch

from seq2trt.plugins.kernels import attention as K
from seq2trt.plugins.op import AttentionAttrs, AttentionKind
from seq2trt.reference_model.errors import InputError

DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
TARGET_PROGRAMS = 264  # flash-decoding aims for ~2 programs per SM of a 132-SM H100/H200


def _check(attrs: AttentionAttrs, query: torch.Tensor) -> str:
    if query.dtype not in DTYPE_NAMES:
        raise InputError(f"attention kernels take {sorted(DTYPE_NAMES.values())} queries, got {query.dtype}; "
                         "cast the inputs or use plugins.op.reference_attention")
    if attrs.head_dim not in K.HEAD_DIMS:
        raise InputError(f"attention kernels take head_dim in {K.HEAD_DIMS}, got {attrs.head_dim}")
    if query.shape[-1] != attrs.num_heads * attrs.head_dim:
        raise InputError(f"query last dim {query.shape[-1]} != num_heads * head_dim = "
                         f"{attrs.num_heads} * {attrs.head_dim}")
    return DTYPE_NAMES[query.dtype]


def decode_splits(batch_heads: int, num_keys: int, block_n: int, num_splits: int | None = None) -> tuple[int, int]:
    """(num_splits, keys_per_split) for one query token over num_keys keys; every split is non-empty."""
    blocks = max(1, math.ceil(num_keys / block_n))
    wanted = num_splits if num_splits is not None else math.ceil(TARGET_PROGRAMS / max(1, batch_heads))
    splits = max(1, min(K.MAX_SPLITS, blocks, wanted))
    blocks_per_split = math.ceil(blocks / splits)
    return math.ceil(blocks / blocks_per_split), blocks_per_split * block_n


def decode_workspace_bytes(batch_heads: int, head_dim: int, num_splits: int) -> int:
    """fp32 partials of flash-decoding: output (Dh), max and sum per (batch*head, split)."""
    return 4 * batch_heads * num_splits * (head_dim + 2)


def _fwd(q, k, v, k_strides, v_strides, mask, attrs, past_len, causal, dtype_name):
    """q/out (B, T, H*Dh); k/v addressed by (batch, head, token) strides over L keys."""
    B, T, D = q.shape
    H, L = attrs.num_heads, k.shape[2] if k.dim() == 4 else k.shape[1]
    out = torch.empty_like(q)
    cfg = K.block_config("attn_fwd", dtype_name, attrs.head_dim)
    grid = (math.ceil(T / cfg["BLOCK_M"]), B * H)
    mask_arg = mask if mask is not None else q  # never read when HAS_MASK is off
    K.attn_fwd[grid](q, k, v, mask_arg, out,
                     q.stride(0), q.stride(1), attrs.head_dim,
                     *k_strides, *v_strides,
                     mask.stride(0) if mask is not None else 0,
                     out.stride(0), out.stride(1), attrs.head_dim,
                     H, T, L, past_len, attrs.scale,
                     HEAD_DIM=attrs.head_dim, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                     HAS_MASK=mask is not None, IS_CAUSAL=causal,
                     num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def _decode(q, k, v, k_strides, v_strides, mask, attrs, num_keys, dtype_name, num_splits):
    """One query token (B, 1, H*Dh) over num_keys keys: split, then reduce."""
    B, H, Dh = q.shape[0], attrs.num_heads, attrs.head_dim
    cfg = K.block_config("attn_decode_split", dtype_name, Dh)
    splits, keys_per_split = decode_splits(B * H, num_keys, cfg["BLOCK_N"], num_splits)
    mid_o = torch.empty((B * H, splits, Dh), dtype=torch.float32, device=q.device)
    mid_m = torch.empty((B * H, splits), dtype=torch.float32, device=q.device)
    mid_l = torch.empty((B * H, splits), dtype=torch.float32, device=q.device)
    K.attn_decode_split[(splits, B * H)](
        q, k, v, mask if mask is not None else q, mid_o, mid_m, mid_l,
        q.stride(0), Dh, *k_strides, *v_strides, mask.stride(0) if mask is not None else 0,
        H, num_keys, keys_per_split, splits, attrs.scale,
        HEAD_DIM=Dh, BLOCK_N=cfg["BLOCK_N"], HAS_MASK=mask is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    out = torch.empty_like(q)
    rcfg = K.block_config("attn_decode_reduce", dtype_name, Dh)
    K.attn_decode_reduce[(B * H,)](mid_o, mid_m, mid_l, out, out.stride(0), Dh, H, splits,
                                   HEAD_DIM=Dh, MAX_SPLITS=rcfg["MAX_SPLITS"],
                                   num_warps=rcfg["num_warps"], num_stages=rcfg["num_stages"])
    return out


def kv_append(attrs: AttentionAttrs, key, value, past_key, past_value, dtype_name: str):
    """present = past ++ new: past (B, H, P, Dh), new (B, T, H*Dh) -> present (B, H, P + T, Dh) each."""
    B, H, P, Dh = past_key.shape
    T = key.shape[1]
    present_key = torch.empty((B, H, P + T, Dh), dtype=key.dtype, device=key.device)
    present_value = torch.empty_like(present_key)
    cfg = K.block_config("kv_append", dtype_name, Dh)
    grid = (math.ceil((P + T) / cfg["BLOCK_L"]), B * H)
    K.kv_append[grid](past_key, past_value, key, value, present_key, present_value,
                      past_key.stride(0), past_key.stride(1), past_key.stride(2),
                      key.stride(0), Dh, key.stride(1),
                      present_key.stride(0), present_key.stride(1), present_key.stride(2),
                      H, P, T, HEAD_DIM=Dh, BLOCK_L=cfg["BLOCK_L"],
                      num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return present_key, present_value


def _token_major(x: torch.Tensor, head_dim: int) -> tuple[int, int, int]:
    """(batch, head, token) strides of a (B, T, H*Dh) tensor."""
    return x.stride(0), head_dim, x.stride(1)


def _head_major(x: torch.Tensor) -> tuple[int, int, int]:
    """(batch, head, token) strides of a (B, H, L, Dh) tensor."""
    return x.stride(0), x.stride(1), x.stride(2)


def attention(attrs: AttentionAttrs, *inputs: torch.Tensor, num_splits: int | None = None) -> tuple[torch.Tensor, ...]:
    """The op through the Triton kernels; inputs and outputs as in `plugins.op.reference_attention`.

    One query token takes the flash-decoding path (`num_splits` overrides its split count), more take flash attention.
    """
    inputs = tuple(x.contiguous() for x in inputs)
    query = inputs[0]
    dtype_name = _check(attrs, query)
    T = query.shape[1]
    if attrs.kind is AttentionKind.DECODER_SELF:
        key, value, past_key, past_value = inputs[1:5]
        present_key, present_value = kv_append(attrs, key, value, past_key, past_value, dtype_name)
        P, L = past_key.shape[2], present_key.shape[2]
        kv = (present_key, present_value, _head_major(present_key), _head_major(present_value), None)
        if T == 1:  # the one query sits at position P and sees every key: no causal mask needed
            out = _decode(query, *kv, attrs, L, dtype_name, num_splits)
        else:
            out = _fwd(query, *kv, attrs, P, True, dtype_name)
        return out, present_key, present_value
    key, value, mask = inputs[1:4]
    mask = mask.to(torch.int32)
    if attrs.kind is AttentionKind.ENCODER_SELF:
        kv = (key, value, _token_major(key, attrs.head_dim), _token_major(value, attrs.head_dim), mask)
        L = key.shape[1]
    else:
        kv = (key, value, _head_major(key), _head_major(value), mask)
        L = key.shape[2]
    if T == 1:
        return (_decode(query, *kv, attrs, L, dtype_name, num_splits),)
    return (_fwd(query, *kv, attrs, 0, False, dtype_name),)


def random_inputs(kind: AttentionKind, *, batch: int, heads: int, head_dim: int, tgt_len: int, kv_len: int,
                  dtype: torch.dtype, seed: int, device: str | torch.device = "cpu",
                  empty_row: bool = False) -> tuple[AttentionAttrs, tuple[torch.Tensor, ...]]:
    """Seeded op inputs. kv_len is the source length (ENCODER_SELF: = tgt_len is forced, CROSS) or the past length
    (DECODER_SELF, may be 0). Key padding masks keep 1..S tokens per row; `empty_row` pads the last row entirely."""
    g = torch.Generator().manual_seed(seed)
    attrs = AttentionAttrs(kind, heads, head_dim, 1.0 / math.sqrt(head_dim))
    D = heads * head_dim

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    def padding_mask(S):
        lengths = torch.randint(1, S + 1, (batch,), generator=g)
        if empty_row:
            lengths[-1] = 0
        return (torch.arange(S)[None, :] < lengths[:, None]).to(torch.int32).to(device)  # (B, S)

    query = rand(batch, tgt_len, D)
    if kind is AttentionKind.ENCODER_SELF:
        return attrs, (query, rand(batch, tgt_len, D), rand(batch, tgt_len, D), padding_mask(tgt_len))
    if kind is AttentionKind.CROSS:
        kv = (rand(batch, heads, kv_len, head_dim), rand(batch, heads, kv_len, head_dim))
        return attrs, (query, *kv, padding_mask(kv_len))
    return attrs, (query, rand(batch, tgt_len, D), rand(batch, tgt_len, D),
                   rand(batch, heads, kv_len, head_dim), rand(batch, heads, kv_len, head_dim))
