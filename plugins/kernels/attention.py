"""Triton kernels for the fused attention op (`plugins.op.reference_attention` is their definition of correct).

- `attn_fwd`: flash attention (Dao et al. 2022, FlashAttention-2 loop order): one program per (block of queries,
  batch x head), keys streamed in blocks with an online softmax, so memory is linear in the length. Covers the
  padded encoder self-attention and cross-attention (key padding mask) and the causal decoder prefill over
  past ++ new keys (query t at absolute position past_len + t sees keys 0 .. past_len + t).
- `attn_decode_split` + `attn_decode_reduce`: flash-decoding (Dao et al. 2023) for one query token: the keys are
  split across programs, each writes a partial (max, sum, unnormalised output) in fp32, and the reduction merges
  them — so a single new token over a long past still fills the GPU.
- `kv_append`: present = past ++ new for decoder self-attention, past (B,H,P,Dh) and new (B,T,H*Dh) token-major,
  before a prefill; a decode step appends inside `attn_decode_split` instead, reading the past once.

Every kernel addresses K/V through (batch, head, token) strides with a contiguous head dimension, so the
token-major (B,T,H*Dh) and head-major (B,H,L,Dh) layouts of the op share one compiled kernel. Scores use exp2 with
log2(e) folded into the scale; accumulation is fp32 for fp32/fp16/bf16 inputs; fp32 dots use IEEE precision (no
TF32) so fp32 stays fp32.

T5's relative position bias (HAS_BIAS) is a pointer to the op's (H, 2M - 1) table by signed distance, in the op's
dtype, contiguous (stride_bh = 2M - 1 is also a row's length): no (H, T, L) bias tensor is built per call. A
BLOCK_M x BLOCK_N tile of `attn_fwd` sees the distances of BLOCK_M + BLOCK_N - 1 consecutive entries, so it loads
that span once (one contiguous row, converted to fp32 log2 units once) and gathers the tile from it in registers,
rather than reading one table entry per score (4,096 scattered 2-byte loads per 64 x 64 tile); a span whose entries
are all equal (T5's buckets beyond max_distance: most tiles of a long sequence) is added as one number. The bias is
added before the mask, so a padded key's score stays MASKED_SCORE.

A key the padding mask hides scores MASKED_SCORE, a large finite negative, while keys beyond the length (block
padding) and causally hidden ones score -inf: so a query row whose every key is padded sees all its L keys alike and
returns the mean of V over them, the op's definition (`plugins.op`), in flash-decoding's split merge too.

HEAD_DIM is a compile-time power of two (tl.arange needs one), the model's head_dim (`head_dim`, a multiple of 8 up to
HEAD_DIM) a runtime argument: loads and stores are masked on d < head_dim, so one compiled kernel serves every head
dim that rounds up to its HEAD_DIM (`launch.kernel_head_dim`).

Parameter order, block sizes and grids live in `launch` (`SIGNATURES`, `block_config`, `plan`), shared by the
launchers, the ahead-of-time compiler and the TensorRT plugin.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
MASKED_SCORE = tl.constexpr(-1.0e30)  # a padded key's score (log2 units): finite, so an all-padded row averages V


@triton.jit
def _bias_tile(row, row_len, first, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The (BLOCK_M, BLOCK_N) position bias of a tile, fp32 in log2 units: query i and key j of the tile add
    row[first + j - i]. Their distances span entries first - (BLOCK_M - 1) .. first + BLOCK_N - 1, loaded once.
    An index outside the row is clamped to its end: only padding rows and keys read there (the plan checks M >= the
    positions), and a tile at the edge of a table whose ends are one bucket stays uniform."""
    tl.static_assert(BLOCK_N <= BLOCK_M)  # so 2 * BLOCK_M, a power of two, covers the BLOCK_M + BLOCK_N - 1 span
    SPAN: tl.constexpr = 2 * BLOCK_M
    offs = tl.arange(0, SPAN)
    at = tl.minimum(tl.maximum(first - (BLOCK_M - 1) + offs, 0), row_len - 1)
    used = offs < BLOCK_M + BLOCK_N - 1
    span = tl.load(row + at, mask=used, other=0.0).to(tl.float32) * LOG2E
    start = tl.load(row + tl.minimum(tl.maximum(first - (BLOCK_M - 1), 0), row_len - 1)).to(tl.float32) * LOG2E
    if tl.max(tl.where(used, tl.abs(span - start), 0.0), 0) == 0.0:  # one cross-warp reduction, not a min and a max
        tile = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32) + start
    else:  # tile[i, j] = span[j - i + BLOCK_M - 1]
        rel = tl.arange(0, BLOCK_N)[None, :] - tl.arange(0, BLOCK_M)[:, None] + (BLOCK_M - 1)
        tile = tl.reshape(tl.gather(span, tl.reshape(rel, [BLOCK_M * BLOCK_N]), 0), [BLOCK_M, BLOCK_N])
    return tile


@triton.jit
def attn_fwd(Q, K, V, Mask, Bias, Out,
             stride_qb, stride_qt, stride_qh,
             stride_kb, stride_kh, stride_kl,
             stride_vb, stride_vh, stride_vl,
             stride_mb, stride_bh,
             stride_ob, stride_ot, stride_oh,
             H, T, L, past_len, bias_off, sm_scale, head_dim,
             HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Grid (cdiv(T, BLOCK_M), B * H). Q/Out (B, T, H, Dh) by strides; K/V (B, H, L, Dh) by strides; Mask (B, L).

    With HAS_BIAS, Bias is the (H, 2M - 1) table by signed distance: query t and key j add
    Bias[h, bias_off + j - t] (bias_off = M - 1 - past_len), one span of it per tile (`_bias_tile`)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    d_ok = offs_d < head_dim
    row_ok = offs_m < T

    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_M, Dh)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    qk_scale = sm_scale * LOG2E

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    hi = L
    if IS_CAUSAL:  # keys beyond the last query of this block are never allowed
        hi = tl.minimum(L, past_len + (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < L
        k = tl.load(k_base + cols[None, :] * stride_kl + offs_d[:, None], mask=col_ok[None, :] & d_ok[:, None],
                    other=0.0)  # (Dh, N)
        qk = tl.dot(q, k, input_precision="ieee") * qk_scale  # (BLOCK_M, BLOCK_N) fp32
        if HAS_BIAS:  # before the mask, so a padded key keeps MASKED_SCORE whatever its bias
            qk += _bias_tile(Bias + h * stride_bh, stride_bh, bias_off + start_n - pid_m * BLOCK_M, BLOCK_M, BLOCK_N)
        if HAS_MASK:
            keep = tl.load(Mask + b * stride_mb + cols, mask=col_ok, other=0)
            qk = tl.where(keep[None, :] != 0, qk, MASKED_SCORE)
        allowed = col_ok[None, :]
        if IS_CAUSAL:
            allowed = allowed & (cols[None, :] <= past_len + offs_m[:, None])
        qk = tl.where(allowed, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key in range yet: keep exp2 finite
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * stride_vl + offs_d[None, :], mask=col_ok[:, None] & d_ok[None, :],
                    other=0.0)  # (N, Dh)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _decode_rows(base, new, pres, cols, col_ok, stride_l, offs_d, d_ok, L, head_dim, APPEND: tl.constexpr):
    """Rows `cols` of K or V (BLOCK_N, HEAD_DIM), zero beyond head_dim. With APPEND, row L - 1 is the new token's
    and every row is also written to the present (B, H, L, Dh) at `pres`."""
    if APPEND:
        from_past = col_ok & (cols < L - 1)
        is_new = col_ok & (cols == L - 1)
        x = tl.where(from_past[:, None],
                     tl.load(base + cols[:, None] * stride_l + offs_d[None, :], mask=from_past[:, None] & d_ok[None, :],
                             other=0.0),
                     tl.load(new + offs_d[None, :] + 0 * cols[:, None], mask=is_new[:, None] & d_ok[None, :],
                             other=0.0))
        tl.store(pres + cols[:, None] * head_dim + offs_d[None, :], x, mask=col_ok[:, None] & d_ok[None, :])
    else:
        x = tl.load(base + cols[:, None] * stride_l + offs_d[None, :], mask=col_ok[:, None] & d_ok[None, :],
                    other=0.0)
    return x


@triton.jit
def attn_decode_split(Q, K, V, Mask, Bias, NewK, NewV, PresK, PresV, MidO, MidM, MidL,
                      stride_qb, stride_qh,
                      stride_kb, stride_kh, stride_kl,
                      stride_vb, stride_vh, stride_vl,
                      stride_mb, stride_bh, stride_nb, stride_rb, stride_rh,
                      H, L, keys_per_split, num_splits, bias_off, sm_scale, head_dim,
                      HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, APPEND: tl.constexpr,
                      HAS_BIAS: tl.constexpr):
    """Grid (num_splits, B * H). One query token over L keys; split s covers keys [s * keys_per_split, ...).

    With APPEND (decoder self-attention) K/V are the past (B, H, L - 1, Dh) and key L - 1 is the new token's
    NewK/NewV (B, 1, H*Dh): each split also writes its rows of the present PresK/PresV (B, H, L, Dh), so the past
    is read once. Writes, per (b*h, s): MidO (head_dim,) the unnormalised output, MidM the running max (log2 units),
    MidL the sum. With HAS_BIAS, key j adds Bias[h, bias_off + j] (bias_off = M - 1 - the query's position).
    """
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    d_ok = offs_d < head_dim

    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_d, mask=d_ok, other=0.0).to(tl.float32) * (sm_scale * LOG2E)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    new_off = b * stride_nb + h * head_dim
    pres_off = b * stride_rb + h * stride_rh
    start = pid_s * keys_per_split
    end = tl.minimum(L, start + keys_per_split)

    m_i = tl.full([], float("-inf"), tl.float32)
    l_i = tl.zeros([], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < end
        # K and V both in flight before any arithmetic: the step is memory-bound, and a V load issued after the
        # score's reductions (barriers) would wait a second full memory latency each block
        k = _decode_rows(k_base, NewK + new_off, PresK + pres_off, cols, col_ok, stride_kl, offs_d, d_ok, L, head_dim,
                         APPEND)
        v = _decode_rows(v_base, NewV + new_off, PresV + pres_off, cols, col_ok, stride_vl, offs_d, d_ok, L, head_dim,
                         APPEND)
        s = tl.sum(k.to(tl.float32) * q[None, :], 1)  # (BLOCK_N,)
        if HAS_BIAS:
            s += tl.load(Bias + h * stride_bh + bias_off + cols, mask=col_ok, other=0.0).to(tl.float32) * LOG2E
        if HAS_MASK:
            keep = tl.load(Mask + b * stride_mb + cols, mask=col_ok, other=0)
            s = tl.where(keep != 0, s, MASKED_SCORE)
        s = tl.where(col_ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), 0)
        m_i = m_new
    mid = pid_bh.to(tl.int64) * num_splits + pid_s
    tl.store(MidO + mid * head_dim + offs_d, acc, mask=d_ok)
    tl.store(MidM + mid, m_i)
    tl.store(MidL + mid, l_i)


@triton.jit
def attn_decode_reduce(MidO, MidM, MidL, Out,
                       stride_ob, stride_oh,
                       H, num_splits, head_dim,
                       HEAD_DIM: tl.constexpr, MAX_SPLITS: tl.constexpr):
    """Grid (B * H,). Merges the num_splits (<= MAX_SPLITS) partials of one (batch, head) into Out (B, 1, H, Dh)."""
    pid_bh = tl.program_id(0)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_s = tl.arange(0, MAX_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    d_ok = offs_d < head_dim
    valid = offs_s < num_splits
    mid = pid_bh.to(tl.int64) * num_splits + offs_s
    m = tl.load(MidM + mid, mask=valid, other=float("-inf"))
    l = tl.load(MidL + mid, mask=valid, other=0.0)
    o = tl.load(MidO + mid[:, None] * head_dim + offs_d[None, :], mask=valid[:, None] & d_ok[None, :],
                other=0.0)  # (S, Dh)
    g = tl.max(m, 0)
    # Splits past num_splits weigh 0, and so do all-padded ones beside a split with a token (MASKED_SCORE - g
    # underflows); when every key is padded, all splits hold MASKED_SCORE and weigh alike: the mean of V.
    w = tl.exp2(m - tl.where(g == float("-inf"), 0.0, g))
    num = tl.sum(w[:, None] * o, 0)
    den = tl.sum(w * l, 0)
    out = num / tl.where(den > 0.0, den, 1.0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_ok)


@triton.jit
def kv_append(PastK, PastV, NewK, NewV, PresK, PresV,
              stride_pb, stride_ph, stride_pl,
              stride_nb, stride_nh, stride_nt,
              stride_rb, stride_rh, stride_rl,
              H, P, T, head_dim,
              HEAD_DIM: tl.constexpr, BLOCK_L: tl.constexpr):
    """Grid (cdiv(P + T, BLOCK_L), B * H). Present rows < P come from the past, rows P .. P+T-1 from the new K/V."""
    pid_l = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    rows = pid_l * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_d = tl.arange(0, HEAD_DIM)
    d_ok = (offs_d < head_dim)[None, :]
    in_past = (rows < P)[:, None] & d_ok
    in_new = ((rows >= P) & (rows < P + T))[:, None] & d_ok
    past_off = b * stride_pb + h * stride_ph + rows[:, None] * stride_pl + offs_d[None, :]
    new_off = b * stride_nb + h * stride_nh + (rows - P)[:, None] * stride_nt + offs_d[None, :]
    pres_off = b * stride_rb + h * stride_rh + rows[:, None] * stride_rl + offs_d[None, :]
    k = tl.where(in_past, tl.load(PastK + past_off, mask=in_past, other=0.0),
                 tl.load(NewK + new_off, mask=in_new, other=0.0))
    v = tl.where(in_past, tl.load(PastV + past_off, mask=in_past, other=0.0),
                 tl.load(NewV + new_off, mask=in_new, other=0.0))
    tl.store(PresK + pres_off, k, mask=in_past | in_new)
    tl.store(PresV + pres_off, v, mask=in_past | in_new)


KERNELS = {"attn_fwd": attn_fwd, "attn_decode_split": attn_decode_split,
           "attn_decode_reduce": attn_decode_reduce, "kv_append": kv_append}
