"""The reference encoder-decoder Transformer of "Attention Is All You Need" (Vaswani et al., 2017).

Sinusoidal positions (3.5), multi-head attention (3.2.2), position-wise FFN (3.3), residual + LayerNorm
(post-LN as in the paper, or pre-LN). The decoder step is a pure function of its inputs:
`(input_ids, encoder_attention_mask, cross_kv, past_kv) -> (logits, present_kv)` — the KV cache is a value
passed in and returned, never state hidden in a module, so the same code is traced for export.

The config's other architecture values (position tables, embedding LayerNorm, activations, a logits bias) are the
Hugging Face families built the same way (Marian, BART, mBART, M2M100/NLLB): one branch each, here. So are T5's
(Raffel et al., 2020): RMSNorm, the gated FFN, heads x d_kv wider or narrower than d_model, no position table but a
bucketed relative position bias added to the self-attention scores, no 1/sqrt(d_k), logits scaled by d_model^-0.5.
And Whisper's (Radford et al., 2022): the encoder reads log-mel features (B, n_mels, 2 M) through two Conv1d + GELU,
the second of stride 2, instead of token ids, and adds a stored position table; everything after is BART's pre-LN.

The attention implementation — everything between an attention block's projections — is chosen by passing it
in (`Seq2SeqTransformer(cfg, attention=...)` or `use_attention`): `attention_core` here, the exporter's marking
core, or the fused op's kernels. Each block knows its `AttentionKind`; no implementation re-derives it.

Shapes: B batch, S source length, T new target tokens, P past length, D d_model, H heads, Dh head_dim,
I = H * Dh (D in the paper), M a stack's longest sequence (max_src_len or max_tgt_len).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn

from seq2trt.reference_model.config import AttentionKind, Seq2SeqConfig  # noqa: F401 (AttentionKind: the model's, re-exported)
from seq2trt.core.errors import InputError

KV = tuple[torch.Tensor, torch.Tensor]  # (key, value), each (B, H, L, Dh)


def sinusoid_table(num_positions: int, d_model: int, layout: str = "sinusoid") -> torch.Tensor:
    """Rows 0 .. num_positions - 1 of a sinusoid position table, in float64 (`Seq2SeqConfig.positions`).

    sinusoid: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...), interleaved as in the paper;
    sinusoid_halves: the same frequencies, sines in the first half and cosines in the second (Marian);
    sinusoid_fairseq: sines then cosines at frequencies 10000^(-i/(d/2 - 1)) (fairseq's table, M2M100/NLLB).
    """
    pos = torch.arange(num_positions, dtype=torch.float64)[:, None]  # (L, 1)
    if layout == "sinusoid_fairseq":
        half = d_model // 2
        inv_freq = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float64) / (half - 1))
        table = torch.cat([torch.sin(pos * inv_freq), torch.cos(pos * inv_freq)], dim=1)  # (L, 2 * half)
        return torch.nn.functional.pad(table, (0, d_model % 2))  # an odd width ends with a zero column
    inv_freq = torch.exp(-math.log(10000.0) * torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    sin, cos = torch.sin(pos * inv_freq), torch.cos(pos * inv_freq)[:, : d_model // 2]  # (L, ceil(d/2)), (L, d//2)
    if layout == "sinusoid_halves":
        return torch.cat([sin, cos], dim=1)
    table = torch.zeros(num_positions, d_model, dtype=torch.float64)
    table[:, 0::2], table[:, 1::2] = sin, cos
    return table


def relative_position_buckets(max_len: int, bidirectional: bool, num_buckets: int, max_distance: int) -> torch.Tensor:
    """T5's relative position bucket of every signed distance r = key position - query position, |r| < max_len:
    a (2 max_len - 1,) int64 lookup whose entry max_len - 1 + r is the bucket of r.

    Bidirectional (the encoder): half the buckets per direction, the upper half for r > 0; causal (the decoder): all
    of them over max(-r, 0), future keys in bucket 0. Within a direction, n < buckets/2 is its own bucket, larger n
    log-spaced up to max_distance and capped at the last; computed as transformers' `_relative_position_bucket`
    computes it (the log in float32, truncated), so a graph can gather from this table instead of taking a log.
    """
    r = torch.arange(-(max_len - 1), max_len)  # (2M - 1,)
    if bidirectional:
        num_buckets //= 2
        buckets, n = (r > 0).long() * num_buckets, r.abs()
    else:
        buckets, n = torch.zeros_like(r), -torch.min(r, torch.zeros_like(r))
    exact = num_buckets // 2
    large = exact + (torch.log(n.float() / exact) / math.log(max_distance / exact) * (num_buckets - exact)).long()
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(n < exact, n, large)


def distance_bias(bias: torch.Tensor, query_start: int, tgt_len: int, key_len: int) -> torch.Tensor:
    """A bias by signed distance (H, 2M - 1), column M - 1 + r for r = key - query position, -> the scores' bias
    (1, H, T, L) of queries at query_start .. query_start + T - 1 over keys 0 .. L - 1."""
    M = (bias.shape[1] + 1) // 2
    q_pos = query_start + torch.arange(tgt_len, device=bias.device)  # (T,)
    k_pos = torch.arange(key_len, device=bias.device)  # (L,)
    return bias[:, k_pos[None, :] - q_pos[:, None] + M - 1][None]  # (1, H, T, L)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + bias, masked where not `allowed`) v.  q (B,H,T,Dh), k/v (B,H,L,Dh),
    allowed (B|1,1,T|1,L), bias None or (1,H,T,L)."""
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, T, L)
    if bias is not None:
        scores = scores + bias
    # The lowest finite score, not -inf: a row with no allowed key sees its L keys alike and returns the mean of V,
    # the fused op's definition (plugins.op) and transformers' eager attention.
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    # Softmax in at least fp32: fp16 exponent sums overflow on long sources.
    probs = torch.softmax(scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores, dim=-1)
    return probs.to(v.dtype) @ v  # (B, H, T, Dh)


def attention_core(kind: AttentionKind, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int,
                   scale: float, key_padding_mask: torch.Tensor | None = None, past: KV | None = None,
                   position_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, KV]:
    """Everything in an attention block between the projections: the unit the fused op replaces.

    q (B,T,I) projected queries. k, v: new keys/values (B,T,I) straight from the projections (self-attention)
    or the precomputed cross-attention K/V (B,H,S,Dh) for CROSS. DECODER_SELF appends the new K/V to `past`
    (B,H,P,Dh) and is causal; the other kinds mask the keys with `key_padding_mask` (B,S) of 1/0.
    `position_bias` (self-attention only): a bias by signed distance (H, 2M - 1) added to the scores, the query
    positions starting at the past length (`distance_bias`).
    Returns the output (B,T,I) and the K/V attended to (B,H,L,Dh) — the present, for decoder self-attention.
    Every attention implementation has this signature (`Attention`).
    """
    B, T, D = q.shape
    q = q.view(B, T, num_heads, D // num_heads).transpose(1, 2)  # (B, H, T, Dh)
    if kind is not AttentionKind.CROSS:
        k = k.view(B, -1, num_heads, D // num_heads).transpose(1, 2)  # (B, H, T, Dh)
        v = v.view(B, -1, num_heads, D // num_heads).transpose(1, 2)
    past_len = 0
    if kind is AttentionKind.DECODER_SELF:
        past_len = past[0].shape[2]
        k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)  # (B, H, P + T, Dh)
        allowed = causal_allowed(past_len, T, q.device)
    else:
        allowed = padding_allowed(key_padding_mask)
    bias = None if position_bias is None else distance_bias(position_bias, past_len, T, k.shape[2])  # (1, H, T, L)
    out = attend(q, k, v, allowed, scale, bias)  # (B, H, T, Dh)
    return out.transpose(1, 2).reshape(B, T, D), (k, v)


def padding_allowed(attention_mask: torch.Tensor) -> torch.Tensor:
    """Key padding mask (B, L) of 1/0 -> boolean (B, 1, 1, L)."""
    return (attention_mask != 0)[:, None, None, :]


def causal_allowed(past_len: int, tgt_len: int, device: torch.device) -> torch.Tensor:
    """Query i (absolute position past_len + i) sees keys 0 .. past_len + i.  Returns (1, 1, T, P + T)."""
    q_pos = past_len + torch.arange(tgt_len, device=device)  # (T,)
    k_pos = torch.arange(past_len + tgt_len, device=device)  # (P + T,)
    return (k_pos[None, :] <= q_pos[:, None])[None, None]


Attention = Callable[..., tuple[torch.Tensor, KV]]  # attention_core's signature


class MultiHeadAttention(nn.Module):
    def __init__(self, cfg: Seq2SeqConfig, kind: AttentionKind, attention: Attention = attention_core,
                 relative_table: bool = False):
        super().__init__()
        self.kind, self.core = kind, attention
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.scale = 1.0 / math.sqrt(cfg.head_dim) if cfg.scale_attention else 1.0
        self.q_proj = nn.Linear(cfg.d_model, cfg.inner_dim, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.d_model, cfg.inner_dim, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.d_model, cfg.inner_dim, bias=cfg.bias)
        self.out_proj = nn.Linear(cfg.inner_dim, cfg.d_model, bias=cfg.bias)
        # T5's relative position bias: one scalar per bucket and head.
        self.relative_bias = nn.Embedding(cfg.relative_buckets, cfg.num_heads) if relative_table else None

    def position_bias(self, buckets: torch.Tensor | None, shared: torch.Tensor | None) -> torch.Tensor | None:
        """This block's bias by signed distance (H, 2M - 1) from its own table and the stack's bucket lookup
        (2M - 1,), or `shared`, the bias of the block before it, when it has no table of its own."""
        if self.relative_bias is None:
            return shared
        return self.relative_bias(buckets).t()  # (H, 2M - 1)

    def project_cross(self, h: torch.Tensor) -> KV:
        """Encoder output (B,S,D) -> this block's cross-attention K/V, each (B,H,S,Dh)."""
        B, S, _ = h.shape
        k = self.k_proj(h).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, S, Dh)
        v = self.v_proj(h).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        return k, v

    def forward(self, x: torch.Tensor, kv: KV | None = None, key_padding_mask: torch.Tensor | None = None,
                past: KV | None = None, position_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, KV]:
        """x (B,T,D). Self-attention when `kv` is None (K/V projected from x), else cross-attention on `kv`."""
        k, v = (self.k_proj(x), self.v_proj(x)) if kv is None else kv  # (B, T, I) or (B, H, S, Dh)
        out, present = self.core(self.kind, self.q_proj(x), k, v, self.num_heads, self.scale, key_padding_mask, past,
                                 position_bias)
        return self.out_proj(out), present


class FeedForward(nn.Module):
    """act(x W1 + b1) W2 + b2 (3.3), or with T5 v1.1's gate (Shazeer, 2020): (act(x W1) * x W1') W2."""

    def __init__(self, cfg: Seq2SeqConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.fc1_linear = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias) if cfg.gated_ffn else None
        self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)
        self.act = {"relu": nn.ReLU, "gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
                    "silu": nn.SiLU}[cfg.activation]()
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1(x))  # (B, T, d_ff)
        if self.fc1_linear is not None:
            h = h * self.fc1_linear(x)
        return self.fc2(self.dropout(h))


class RMSNorm(nn.Module):
    """T5's LayerNorm (Zhang & Sennrich, 2019): w * x / sqrt(mean(x^2) + eps), no mean subtracted, no bias.
    Computed in at least fp32 (transformers' T5LayerNorm takes the variance in fp32), in the weight's dtype after."""

    def __init__(self, d_model: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d_model))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(self.weight.dtype)


def make_norm(cfg: Seq2SeqConfig) -> nn.Module:
    """The config's normalisation over d_model (`Seq2SeqConfig.norm`)."""
    if cfg.norm == "rms":
        return RMSNorm(cfg.d_model, cfg.layer_norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)


class Residual(nn.Module):
    """x + Sublayer(x) with the LayerNorm after (post-LN, the paper) or before (pre-LN)."""

    def __init__(self, cfg: Seq2SeqConfig):
        super().__init__()
        self.norm = make_norm(cfg)
        self.dropout = nn.Dropout(cfg.dropout)
        self.pre_norm = cfg.pre_norm

    def forward(self, x: torch.Tensor, sublayer) -> torch.Tensor:
        if self.pre_norm:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


def owns_relative_table(cfg: Seq2SeqConfig, index: int) -> bool:
    """Whether self-attention layer `index` of a stack holds a relative bias table (`Seq2SeqConfig.relative_bias`)."""
    return cfg.relative_bias == "per_layer" or (cfg.relative_bias == "shared" and index == 0)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: Seq2SeqConfig, attention: Attention, index: int = 0):
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg, AttentionKind.ENCODER_SELF, attention, owns_relative_table(cfg, index))
        self.ffn = FeedForward(cfg)
        self.attn_block, self.ffn_block = Residual(cfg), Residual(cfg)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor,
                position_bias: torch.Tensor | None = None) -> torch.Tensor:
        x = self.attn_block(x, lambda h: self.self_attn(h, key_padding_mask=attention_mask,
                                                        position_bias=position_bias)[0])
        return self.ffn_block(x, self.ffn)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Seq2SeqConfig, attention: Attention, index: int = 0):
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg, AttentionKind.DECODER_SELF, attention, owns_relative_table(cfg, index))
        self.cross_attn = MultiHeadAttention(cfg, AttentionKind.CROSS, attention)
        self.ffn = FeedForward(cfg)
        self.self_block, self.cross_block, self.ffn_block = Residual(cfg), Residual(cfg), Residual(cfg)

    def forward(self, x: torch.Tensor, past: KV, cross: KV, encoder_attention_mask: torch.Tensor,
                position_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, KV]:
        present: list[KV] = []

        def self_attention(h: torch.Tensor) -> torch.Tensor:
            out, kv = self.self_attn(h, past=past, position_bias=position_bias)
            present.append(kv)  # (B, H, P + T, Dh)
            return out

        x = self.self_block(x, self_attention)
        x = self.cross_block(x, lambda h: self.cross_attn(h, cross, key_padding_mask=encoder_attention_mask)[0])
        return self.ffn_block(x, self.ffn), present[0]


class AudioFrontEnd(nn.Module):
    """Whisper's convolutional front end: log-mel features (B, n_mels, 2S) -> GELU(Conv1d(k 3, pad 1)) ->
    GELU(Conv1d(k 3, stride 2, pad 1)) -> (B, S, D), exact (erf) GELU both times."""

    def __init__(self, cfg: Seq2SeqConfig):
        super().__init__()
        self.conv1 = nn.Conv1d(cfg.n_mels, cfg.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(cfg.d_model, cfg.d_model, kernel_size=3, stride=2, padding=1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = nn.functional.gelu(self.conv1(features))  # (B, D, 2S)
        x = nn.functional.gelu(self.conv2(x))  # (B, D, S)
        return x.transpose(1, 2)  # (B, S, D)


class Seq2SeqTransformer(nn.Module):
    def __init__(self, cfg: Seq2SeqConfig, attention: Attention = attention_core):
        super().__init__()
        self.cfg = cfg
        self.tgt_embed = nn.Embedding(cfg.tgt_vocab_size, cfg.d_model)
        self.src_embed = self.tgt_embed if cfg.share_vocab else nn.Embedding(cfg.src_vocab_size, cfg.d_model)
        self.frontend = AudioFrontEnd(cfg) if cfg.audio else None  # an audio source instead of src_embed's ids
        self.encoder_layers = nn.ModuleList(EncoderLayer(cfg, attention, i) for i in range(cfg.num_encoder_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(cfg, attention, i) for i in range(cfg.num_decoder_layers))
        # Pre-LN stacks end with a LayerNorm; post-LN outputs are already normalised.
        self.encoder_norm = make_norm(cfg) if cfg.pre_norm else nn.Identity()
        self.decoder_norm = make_norm(cfg) if cfg.pre_norm else nn.Identity()
        # BART and mBART normalise embeddings + positions before the first layer.
        self.src_embed_norm = make_norm(cfg) if cfg.embed_norm else nn.Identity()
        self.tgt_embed_norm = make_norm(cfg) if cfg.embed_norm else nn.Identity()
        # A tied head is the embedding: made on the meta device, so that no second (vocabulary x d_model) matrix
        # is allocated only to be replaced (2.3 GB for a 560,000-token Marian).
        self.lm_head = nn.Linear(cfg.d_model, cfg.tgt_vocab_size, bias=False,
                                 device="meta" if cfg.tie_embeddings else None)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tgt_embed.weight
        self.logits_bias = nn.Parameter(torch.zeros(cfg.tgt_vocab_size)) if cfg.logits_bias else None
        self.embed_scale = math.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0
        self.dropout = nn.Dropout(cfg.dropout)
        if cfg.positions == "learned":  # one table per stack; position p reads row p + offset
            self.src_positions = nn.Embedding(cfg.max_src_len + cfg.position_offset, cfg.d_model)
            self.tgt_positions = nn.Embedding(cfg.max_tgt_len + cfg.position_offset, cfg.d_model)
        elif cfg.positions != "none":  # rows offset .. offset + max - 1 of the sinusoid, so position p is row p here
            self.register_buffer("positions", self._sinusoid().float(), persistent=False)
        if cfg.relative_bias != "none":  # each stack's bucket of every signed distance (encoder both ways)
            lookup = lambda n, both: relative_position_buckets(n, both, cfg.relative_buckets, cfg.relative_max_distance)
            self.register_buffer("src_buckets", lookup(cfg.max_src_len, True), persistent=False)  # (2M - 1,)
            self.register_buffer("tgt_buckets", lookup(cfg.max_tgt_len, False), persistent=False)
        self.reset_parameters()

    def _sinusoid(self) -> torch.Tensor:
        cfg = self.cfg
        return sinusoid_table(cfg.max_positions + cfg.position_offset, cfg.d_model, cfg.positions)[cfg.position_offset:]

    def reset_parameters(self) -> None:
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
        nn.init.normal_(self.tgt_embed.weight, std=self.cfg.d_model ** -0.5)
        if not self.cfg.share_vocab:
            nn.init.normal_(self.src_embed.weight, std=self.cfg.d_model ** -0.5)

    def use_attention(self, attention: Attention) -> "Seq2SeqTransformer":
        """Compute every attention block with `attention` (attention_core's signature) from now on."""
        for module in self.modules():
            if isinstance(module, MultiHeadAttention):
                module.core = attention
        return self

    def _apply(self, fn, recurse=True):
        # Rebuild the table from float64, so .double() gives exact positions rather than widened float32 ones.
        super()._apply(fn, recurse)
        if self.cfg.positions not in ("learned", "none"):
            self.positions = self._sinusoid().to(self.positions)
        return self

    def position_table(self, decoder: bool) -> torch.Tensor:
        """(max_len, D): row p is the vector added at position p on that side."""
        if self.cfg.positions != "learned":
            return self.positions
        return (self.tgt_positions if decoder else self.src_positions).weight[self.cfg.position_offset:]

    def embed(self, ids: torch.Tensor, decoder: bool, offset: int = 0) -> torch.Tensor:
        """ids (B, T) at positions offset .. offset + T - 1 -> (B, T, D), normalised where the config says so.
        An audio encoder's `ids` are its features (B, n_mels, 2S): the front end's output takes the ids' place."""
        table, norm = (self.tgt_embed, self.tgt_embed_norm) if decoder else (self.src_embed, self.src_embed_norm)
        if self.frontend is not None and not decoder:
            x = self.frontend(ids)  # (B, S, D)
            return self.dropout(norm(x + self.position_table(False)[: x.shape[1]]))
        if self.cfg.positions == "none":
            return self.dropout(norm(table(ids) * self.embed_scale))  # (B, T, D)
        pos = self.position_table(decoder)[offset: offset + ids.shape[1]]  # (T, D)
        if self.cfg.pad_position_zero:  # fairseq: a pad token reads the table's zero padding row
            pos = pos * (ids != self.cfg.pad_id).unsqueeze(-1).to(pos.dtype)  # (B, T, D)
        return self.dropout(norm(table(ids) * self.embed_scale + pos))  # (B, T, D)

    def _check_length(self, length: int, decoder: bool) -> None:
        """Refuse a sequence past the stack's limit (the position table or the bucket lookup holds no row for it).
        Skipped while torch.export traces: the graphs' dynamic axes carry the limits."""
        if torch.compiler.is_compiling():
            return
        cfg, name = self.cfg, "max_tgt_len" if decoder else "max_src_len"
        limit = cfg.max_tgt_len if decoder else cfg.max_src_len
        if length > limit:
            what = "target tokens (the start token included)" if decoder else "source tokens"
            fix = (f"shorten the input, or raise {name} in the checkpoint's config.json (this model has no position "
                   "table to outgrow)" if cfg.positions == "none" else "shorten the input")
            raise InputError(f"{length} {what} exceed the model's {name} {limit}; {fix}")

    def _buckets(self, decoder: bool) -> torch.Tensor | None:
        """The stack's bucket lookup (2M - 1,), None without a relative bias."""
        if self.cfg.relative_bias == "none":
            return None
        return self.tgt_buckets if decoder else self.src_buckets

    def _check_features(self, features: torch.Tensor) -> None:
        """Refuse audio features of the wrong shape: (B, n_mels, 2 x max_src_len) exactly, as transformers' Whisper."""
        if torch.compiler.is_compiling():
            return
        cfg = self.cfg
        if features.dim() != 3 or tuple(features.shape[1:]) != (cfg.n_mels, cfg.source_frames):
            raise InputError(f"audio features must be (batch, {cfg.n_mels}, {cfg.source_frames}) (n_mels, frames: "
                             f"30 s at 100 frames a second, padded or trimmed), got {tuple(features.shape)}; compute "
                             "them with the model's feature extractor")

    # -- encoder side -------------------------------------------------------------------------------------
    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, S) ids and 1/0 mask -> encoder hidden states (B, S, D). An audio model's `input_ids` are its
        features (B, n_mels, 2 max_src_len) and `attention_mask` (B, max_src_len) is all ones (Whisper masks nothing)."""
        if self.frontend is not None:
            self._check_features(input_ids)
        else:
            self._check_length(input_ids.shape[1], decoder=False)
        x = self.embed(input_ids, decoder=False)
        buckets, bias = self._buckets(decoder=False), None
        for layer in self.encoder_layers:
            bias = layer.self_attn.position_bias(buckets, bias)  # (H, 2M - 1), or None
            x = layer(x, attention_mask, bias)
        return self.encoder_norm(x)

    def cross_kv(self, encoder_hidden_states: torch.Tensor) -> list[KV]:
        """Cross-attention K/V of every decoder layer, computed once per source: each (B, H, S, Dh)."""
        return [layer.cross_attn.project_cross(encoder_hidden_states) for layer in self.decoder_layers]

    def empty_past(self, batch: int) -> list[KV]:
        p = self.tgt_embed.weight
        empty = p.new_zeros(batch, self.cfg.num_heads, 0, self.cfg.head_dim)  # (B, H, 0, Dh)
        return [(empty, empty) for _ in self.decoder_layers]

    # -- decoder side -------------------------------------------------------------------------------------
    def decode_step(self, input_ids: torch.Tensor, encoder_attention_mask: torch.Tensor, cross_kv: list[KV],
                    past_kv: list[KV]) -> tuple[torch.Tensor, list[KV]]:
        """One decoder call: (B, T) new tokens -> logits (B, T, V) and the present K/V (B, H, P + T, Dh).

        T = 1 for a decoding step, T > 1 for a prefill; positions are P + arange(T), P from the past's shape.
        """
        self._check_length(past_kv[0][0].shape[2] + input_ids.shape[1], decoder=True)
        x = self.embed(input_ids, decoder=True, offset=past_kv[0][0].shape[2])
        buckets, bias = self._buckets(decoder=True), None
        present = []
        for layer, past, cross in zip(self.decoder_layers, past_kv, cross_kv):
            bias = layer.self_attn.position_bias(buckets, bias)  # (H, 2M - 1), or None; rows from the past length
            x, kv = layer(x, past, cross, encoder_attention_mask, bias)
            present.append(kv)
        h = self.decoder_norm(x)  # (B, T, D)
        if self.cfg.scale_logits:  # T5 with tied embeddings: Mesh TensorFlow's rescale before the shared projection
            h = h * self.cfg.d_model ** -0.5
        logits = self.lm_head(h)  # (B, T, V)
        return (logits if self.logits_bias is None else logits + self.logits_bias), present

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                decoder_input_ids: torch.Tensor) -> torch.Tensor:
        """Teacher forcing over the whole target: logits (B, T, V)."""
        enc = self.encode(input_ids, attention_mask)
        logits, _ = self.decode_step(decoder_input_ids, attention_mask, self.cross_kv(enc),
                                     self.empty_past(input_ids.shape[0]))
        return logits
