"""Launch plans for the attention kernels, and the launcher on torch tensors.

`plan` is the one place that says which kernels an op call runs, in what order, with which grid, arguments and
block sizes; `SIGNATURES` says in which order each compiled kernel takes its parameters. Two callers share them,
so the interpreter tests check exactly what the TensorRT plugin launches:
- `attention(attrs, *inputs)`: the op on torch tensors through triton's launcher (a GPU, or CPU tensors under
  TRITON_INTERPRET=1 set before triton is first imported); returns what `plugins.op.reference_attention` returns;
- `plugins.cuda_launcher`: the same plan on raw device pointers, packed as ctypes for cuLaunchKernel.

This module imports triton only to launch (`attention`), so the plugin can plan without it. Inputs are contiguous
in the op's layouts (`plugins.op`); strides are derived from the shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from seq2trt.core import dtypes
from seq2trt.plugins.op import INPUTS, OPTIONAL_INPUTS, POSITION_BIAS, AttentionAttrs, AttentionKind
from seq2trt.core.errors import InputError

if TYPE_CHECKING:  # torch only where tensors are: the plans are read by TensorRT's build child, which has none
    import torch

DTYPES = ("fp32", "fp16", "bf16")  # the kernels' element types


def dtype_name(dtype: "torch.dtype") -> str | None:
    """'fp32' / 'fp16' / 'bf16' for a torch dtype the kernels take, else None."""
    return dtypes.dtype_name(dtype)


# The head dims the kernels take: every multiple of 8 up to 256, which covers the Hugging Face families we import.
# Each runs the kernels compiled for the next of KERNEL_HEAD_DIMS (tl.arange needs a power of two, tl.dot >= 16),
# with its own head_dim passed in and the head dimension masked beyond it.
HEAD_DIMS = tuple(range(8, 257, 8))
KERNEL_HEAD_DIMS = (16, 32, 64, 128, 256)
MAX_SPLITS = 64  # flash-decoding partials per (batch, head): the reduction loads them as one block
# Accuracy the kernels promise against `reference_attention` in float64 on the same rounded inputs:
# |kernel - reference| <= atol + rtol * |reference|. fp16/bf16 keep their probabilities in the input dtype for P @ V.
TOLERANCES = {"fp32": (2e-5, 2e-5), "fp16": (2e-3, 2e-3), "bf16": (1.6e-2, 1.6e-2)}
TARGET_PROGRAMS = 264  # flash-decoding aims for ~2 programs per SM of a 132-SM H100/H200

# Runtime parameters of each kernel in order ("{t}" = the op's dtype); constexprs are not parameters.
_STRIDES3 = ("i32", "i32", "i32")
SIGNATURES: dict[str, tuple[tuple[str, str], ...]] = {
    "attn_fwd": tuple(zip(
        ("Q", "K", "V", "Mask", "Bias", "Out", "stride_qb", "stride_qt", "stride_qh", "stride_kb", "stride_kh",
         "stride_kl", "stride_vb", "stride_vh", "stride_vl", "stride_mb", "stride_bh", "stride_ob", "stride_ot",
         "stride_oh", "H", "T", "L", "past_len", "bias_off", "sm_scale", "head_dim"),
        ("*{t}", "*{t}", "*{t}", "*i32", "*{t}", "*{t}") + _STRIDES3 * 4 + ("i32", "i32") + ("i32",) * 5
        + ("fp32", "i32"),
        strict=True)),
    "attn_decode_split": tuple(zip(
        ("Q", "K", "V", "Mask", "Bias", "NewK", "NewV", "PresK", "PresV", "MidO", "MidM", "MidL", "stride_qb",
         "stride_qh", "stride_kb", "stride_kh", "stride_kl", "stride_vb", "stride_vh", "stride_vl", "stride_mb",
         "stride_bh", "stride_nb", "stride_rb", "stride_rh", "H", "L", "keys_per_split", "num_splits", "bias_off",
         "sm_scale", "head_dim"),
        ("*{t}", "*{t}", "*{t}", "*i32", "*{t}") + ("*{t}",) * 4 + ("*fp32",) * 3 + ("i32",) * 18 + ("fp32", "i32"),
        strict=True)),
    "attn_decode_reduce": tuple(zip(
        ("MidO", "MidM", "MidL", "Out", "stride_ob", "stride_oh", "H", "num_splits", "head_dim"),
        ("*fp32", "*fp32", "*fp32", "*{t}", "i32", "i32", "i32", "i32", "i32"), strict=True)),
    "kv_append": tuple(zip(
        ("PastK", "PastV", "NewK", "NewV", "PresK", "PresV", "stride_pb", "stride_ph", "stride_pl",
         "stride_nb", "stride_nh", "stride_nt", "stride_rb", "stride_rh", "stride_rl", "H", "P", "T", "head_dim"),
        ("*{t}",) * 6 + _STRIDES3 * 3 + ("i32",) * 4, strict=True)),
}
SCRATCH_PARAMS = ("global_scratch", "profile_scratch")  # appended by Triton 3.9 to every compiled kernel
# What compiled code assumes each parameter is a multiple of, as triton's JIT would specialise: pointers 16 (bytes);
# head_dim, every token/head/batch stride and keys_per_split 8 (elements: 16 bytes in fp16/bf16, enough for the
# widest vector load), which any head_dim in HEAD_DIMS makes true. The mask and the position bias are read one
# element at a time (a bias row is 2M - 1 long, odd): nothing is assumed of them. `cuda_launcher.pack` checks the rest
# before any launch.
DIVISIBILITY: dict[str, dict[str, int]] = {
    kernel: {n: 16 if ty.startswith("*") else 8 for n, ty in sig
             if (ty.startswith("*") and n not in ("MidL", "Mask", "Bias"))
             or (n.startswith("stride_") and n not in ("stride_mb", "stride_bh"))
             or n in ("keys_per_split", "head_dim")}
    for kernel, sig in SIGNATURES.items()}


def kernel_head_dim(head_dim: int) -> int:
    """The compiled HEAD_DIM that runs a model's head_dim (one of HEAD_DIMS): the next of KERNEL_HEAD_DIMS."""
    return next(d for d in KERNEL_HEAD_DIMS if d >= head_dim)


def block_config(kernel: str, dtype: str, head_dim: int) -> dict:
    """Block sizes (constexprs) and launch options of one kernel for one dtype and head_dim (its compiled HEAD_DIM's).

    Tiles are sized for ~100 KB of shared memory (the sm_86/sm_89 limit); fp32 tiles are twice as large.
    """
    head_dim = kernel_head_dim(head_dim)
    wide = 4 if dtype == "fp32" else 2
    if kernel == "attn_fwd":
        if head_dim * wide >= 1024:  # fp32 at 256: 64-row tiles need 107-140 KB whatever BLOCK_N or stages
            return {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
        block_n = 32 if head_dim * wide >= 512 else 64
        return {"BLOCK_M": 64, "BLOCK_N": block_n, "num_warps": 4 if head_dim <= 64 else 8, "num_stages": 2}
    if kernel == "attn_decode_split":
        return {"BLOCK_N": 64 if head_dim * wide <= 256 else 32, "num_warps": 4, "num_stages": 2}
    if kernel == "attn_decode_reduce":
        return {"MAX_SPLITS": MAX_SPLITS, "num_warps": 4, "num_stages": 1}
    if kernel == "kv_append":
        return {"BLOCK_L": 32, "num_warps": 4, "num_stages": 1}
    raise ValueError(f"unknown kernel {kernel!r}; expected one of {sorted(SIGNATURES)}")


def variant_key(kernel: str, dtype: str, constexprs: dict, num_warps: int, num_stages: int) -> str:
    """Name of one compiled variant, e.g. attn_fwd-fp16-BLOCK_M64-BLOCK_N64-HAS_MASK1-HEAD_DIM64-IS_CAUSAL0-w4-s2."""
    parts = [f"{k}{int(v)}" for k, v in sorted(constexprs.items())]
    return "-".join([kernel, dtype, *parts, f"w{num_warps}", f"s{num_stages}"])


@dataclass(frozen=True)
class Launch:
    """One kernel launch: runtime arguments by name (tensors or pointers), constexprs and options."""
    kernel: str
    dtype: str
    grid: tuple[int, int, int]
    args: dict[str, Any]
    constexprs: dict[str, int]
    num_warps: int
    num_stages: int

    @property
    def key(self) -> str:
        return variant_key(self.kernel, self.dtype, self.constexprs, self.num_warps, self.num_stages)


def _launch(kernel, dtype, head_dim, grid, args, **flags) -> Launch:
    cfg = block_config(kernel, dtype, head_dim)
    constexprs = {"HEAD_DIM": kernel_head_dim(head_dim), **{k: v for k, v in cfg.items() if k.isupper()}, **flags}
    return Launch(kernel, dtype, tuple(grid) + (1,) * (3 - len(grid)), {**args, "head_dim": head_dim}, constexprs,
                  cfg["num_warps"], cfg["num_stages"])


def decode_splits(batch_heads: int, num_keys: int, block_n: int, num_splits: int | None = None) -> tuple[int, int]:
    """(num_splits, keys_per_split) for one query token over num_keys keys; every split is non-empty."""
    blocks = max(1, math.ceil(num_keys / block_n))
    wanted = num_splits if num_splits is not None else math.ceil(TARGET_PROGRAMS / max(1, batch_heads))
    splits = max(1, min(MAX_SPLITS, blocks, wanted))
    blocks_per_split = math.ceil(blocks / splits)
    return math.ceil(blocks / blocks_per_split), blocks_per_split * block_n


def decode_workspace_bytes(batch_heads: int, head_dim: int, num_splits: int = MAX_SPLITS) -> int:
    """fp32 partials of flash-decoding: output (Dh), max and sum per (batch*head, split)."""
    return 4 * batch_heads * num_splits * (head_dim + 2)


def workspace_bytes(attrs: AttentionAttrs, max_batch: int) -> int:
    """The op's workspace: scratch for any call up to max_batch (one query token takes flash-decoding, in every kind),
    whatever the dtype (the partials are fp32). What the TensorRT plugin asks for, within the builder's limit."""
    return decode_workspace_bytes(max_batch * attrs.num_heads, attrs.head_dim)


def kernel_head_dim_problem(head_dim: int, out: object = "OUT") -> str | None:
    """Why the compiled kernels cannot run a model of this head_dim, with the ways around it; None when they can.
    Unchecked, the plugin would fail only inside TensorRT's enqueue on a GPU, with a message that names nothing."""
    if head_dim in HEAD_DIMS:
        return None
    return (f"the attention plugin's kernels take head_dim {_described(HEAD_DIMS)}; this model's is "
            f"{head_dim}; build the unfused graphs with `seq2trt build {out} --no-plugin` (TensorRT's own fusion), "
            f"or run fused graphs on ONNX Runtime (`seq2trt fuse {out} --target ort`)")


def _described(dims: tuple[int, ...]) -> str:
    step = dims[0]
    if len(dims) > 3 and dims == tuple(range(step, dims[-1] + 1, step)):
        return f"a multiple of {step} up to {dims[-1]}"
    return ", ".join(map(str, dims))


def _check(attrs: AttentionAttrs, dtype: str, query_shape) -> None:
    if dtype not in DTYPES:
        raise InputError(f"attention kernels take {sorted(DTYPES)}, got {dtype}; "
                         "cast the inputs or use plugins.op.reference_attention")
    if attrs.head_dim not in HEAD_DIMS:
        raise InputError(f"attention kernels take head_dim {_described(HEAD_DIMS)}, got {attrs.head_dim}")
    if query_shape[-1] != attrs.num_heads * attrs.head_dim:
        raise InputError(f"query last dim {query_shape[-1]} != num_heads * head_dim = "
                         f"{attrs.num_heads} * {attrs.head_dim}")


def _kv_source(attrs: AttentionAttrs, dtype: str, shapes, inputs, outputs, decode: bool):
    """(KV append launches, K/V/mask and append arguments, past length, number of keys) of one op call.

    A decoder prefill appends first (`kv_append`) and attends to the present; a decode step (`decode`) reads the
    past and the new token and writes the present inside attn_decode_split (APPEND)."""
    B, T, D = shapes[0]
    H, Dh = attrs.num_heads, attrs.head_dim
    head_major = lambda L: (H * L * Dh, L * Dh, Dh)  # noqa: E731  (B, H, L, Dh)
    launches, mask = [], None
    append = {"NewK": inputs[0], "NewV": inputs[0], "PresK": inputs[0], "PresV": inputs[0],
              "stride_nb": 0, "stride_rb": 0, "stride_rh": 0}  # never touched without APPEND
    if attrs.kind is AttentionKind.DECODER_SELF:
        P = shapes[3][2]
        L = P + T
        past_present = {"NewK": inputs[1], "NewV": inputs[2], "PresK": outputs[1], "PresV": outputs[2]}
        if decode:
            append = {**past_present, "stride_nb": D, "stride_rb": H * L * Dh, "stride_rh": L * Dh}
            K, V, strides = inputs[3], inputs[4], head_major(P)
        else:
            block_l = block_config("kv_append", dtype, Dh)["BLOCK_L"]
            launches.append(_launch("kv_append", dtype, Dh, (math.ceil(L / block_l), B * H), {
                "PastK": inputs[3], "PastV": inputs[4], **past_present,
                **dict(zip(("stride_pb", "stride_ph", "stride_pl"), head_major(P))),
                "stride_nb": T * D, "stride_nh": Dh, "stride_nt": D,
                **dict(zip(("stride_rb", "stride_rh", "stride_rl"), head_major(L))), "H": H, "P": P, "T": T}))
            K, V, strides = outputs[1], outputs[2], head_major(L)
    elif attrs.kind is AttentionKind.ENCODER_SELF:
        P, L, mask = 0, shapes[1][1], inputs[3]
        K, V, strides = inputs[1], inputs[2], (L * D, Dh, D)  # token-major (B, L, H, Dh)
    else:
        P, L, mask = 0, shapes[1][2], inputs[3]
        K, V, strides = inputs[1], inputs[2], head_major(L)
    kv_args = {"K": K, "V": V, "Mask": inputs[0] if mask is None else mask, "stride_mb": 0 if mask is None else L,
               **dict(zip(("stride_kb", "stride_kh", "stride_kl"), strides)),
               **dict(zip(("stride_vb", "stride_vh", "stride_vl"), strides))}
    return launches, kv_args, append, P, L


def _bias_args(attrs: AttentionAttrs, shapes, inputs, P: int, T: int, L: int) -> tuple[dict, int]:
    """(Bias, stride_bh, bias_off) and HAS_BIAS of one call: the position bias follows the required inputs when given.
    bias_off = M - 1 - P, the table's column of key 0 for query 0 (at position P)."""
    n = len(INPUTS[attrs.kind])
    if len(shapes) == n:
        return {"Bias": inputs[0], "stride_bh": 0, "bias_off": 0}, 0  # never read without HAS_BIAS
    if len(shapes) != n + 1 or POSITION_BIAS not in OPTIONAL_INPUTS[attrs.kind]:
        raise InputError(f"{attrs.kind.name} attention takes {n} inputs"
                         f"{' and optionally a position bias' if OPTIONAL_INPUTS[attrs.kind] else ''}, "
                         f"got {len(shapes)}; pass the op's inputs as plugins.op.pack_inputs orders them")
    bias = tuple(shapes[n])
    M = (bias[-1] + 1) // 2 if len(bias) == 2 else 0
    if len(bias) != 2 or bias[0] != attrs.num_heads or bias[1] % 2 == 0 or M < max(P + T, L):
        raise InputError(f"position_bias must be (heads={attrs.num_heads}, 2M - 1) with M >= {max(P + T, L)} "
                         f"positions, got {bias}; build the table for the export's longest sequence")
    return {"Bias": inputs[n], "stride_bh": bias[1], "bias_off": M - 1 - P}, 1


def plan(attrs: AttentionAttrs, dtype: str, shapes, inputs, outputs, workspace=None,
         at: Callable[[Any, int], Any] = lambda ptr, offset: ptr + offset,
         num_splits: int | None = None) -> list[Launch]:
    """The launches of one op call. shapes: the inputs' shapes in `op.input_names` order (the position bias last,
    when given); inputs/outputs: handles (tensors or device pointers) in op order; workspace: `workspace_bytes` of
    scratch, `at(workspace, byte_offset)` addressing into it. One query token takes flash-decoding when a workspace
    is given, else flash attention."""
    _check(attrs, dtype, shapes[0])
    B, T, D = shapes[0]
    H, Dh = attrs.num_heads, attrs.head_dim
    decode = T == 1 and workspace is not None  # the one query (position P) sees every key: no causal mask needed
    launches, kv_args, append, P, L = _kv_source(attrs, dtype, shapes, inputs, outputs, decode)
    bias_args, has_bias = _bias_args(attrs, shapes, inputs, P, T, L)
    kv_args = {**kv_args, **bias_args}
    q_args = {"Q": inputs[0], "stride_qb": T * D, "stride_qh": Dh}
    has_mask = int(attrs.kind is not AttentionKind.DECODER_SELF)
    if decode:
        block_n = block_config("attn_decode_split", dtype, Dh)["BLOCK_N"]
        splits, keys_per_split = decode_splits(B * H, L, block_n, num_splits)
        mid = {"MidO": at(workspace, 0), "MidM": at(workspace, 4 * B * H * splits * Dh),
               "MidL": at(workspace, 4 * B * H * splits * (Dh + 1))}
        launches.append(_launch("attn_decode_split", dtype, Dh, (splits, B * H), {
            **q_args, **kv_args, **append, **mid, "H": H, "L": L, "keys_per_split": keys_per_split,
            "num_splits": splits, "sm_scale": attrs.scale},
            HAS_MASK=has_mask, APPEND=1 - has_mask, HAS_BIAS=has_bias))
        launches.append(_launch("attn_decode_reduce", dtype, Dh, (B * H,), {
            **mid, "Out": outputs[0], "stride_ob": D, "stride_oh": Dh, "H": H, "num_splits": splits}))
    else:
        block_m = block_config("attn_fwd", dtype, Dh)["BLOCK_M"]
        launches.append(_launch("attn_fwd", dtype, Dh, (math.ceil(T / block_m), B * H), {
            **q_args, "stride_qt": D, **kv_args, "Out": outputs[0], "stride_ob": T * D, "stride_ot": D,
            "stride_oh": Dh, "H": H, "T": T, "L": L, "past_len": P, "sm_scale": attrs.scale},
            HAS_MASK=has_mask, IS_CAUSAL=1 - has_mask, HAS_BIAS=has_bias))
    return launches


def attention(attrs: AttentionAttrs, *inputs: torch.Tensor, num_splits: int | None = None) -> tuple[torch.Tensor, ...]:
    """The op through the Triton kernels; inputs and outputs as in `plugins.op.reference_attention`."""
    import torch

    from seq2trt.plugins.kernels.attention import KERNELS

    inputs = tuple(x.contiguous() for x in inputs)
    query = inputs[0]
    dtype = dtype_name(query.dtype)
    if dtype is None:
        raise InputError(f"attention kernels take {sorted(DTYPES)} queries, got {query.dtype}")
    if attrs.kind is not AttentionKind.DECODER_SELF:
        inputs = inputs[:3] + (inputs[3].to(torch.int32),) + inputs[4:]
    n = len(INPUTS[attrs.kind])
    if len(inputs) > n:  # the position bias, in the op's dtype
        inputs = inputs[:n] + (inputs[n].to(query.dtype).contiguous(),)
    outputs = [torch.empty_like(query)]
    if attrs.kind is AttentionKind.DECODER_SELF:
        B, H, P, Dh = inputs[3].shape
        outputs += [query.new_empty((B, H, P + query.shape[1], Dh)) for _ in range(2)]
    workspace = torch.empty(workspace_bytes(attrs, query.shape[0]) // 4, dtype=torch.float32, device=query.device)
    for launch in plan(attrs, dtype, [tuple(x.shape) for x in inputs], inputs, outputs, workspace,
                       at=lambda ws, offset: ws[offset // 4:], num_splits=num_splits):
        KERNELS[launch.kernel][launch.grid](**launch.args, **launch.constexprs,
                                            num_warps=launch.num_warps, num_stages=launch.num_stages)
    return tuple(outputs)


def random_inputs(kind: AttentionKind, *, batch: int, heads: int, head_dim: int, tgt_len: int, kv_len: int,
                  dtype: torch.dtype, seed: int, device: str | torch.device = "cpu",
                  empty_row: bool = False, bias_positions: int | None = None,
                  ) -> tuple[AttentionAttrs, tuple[torch.Tensor, ...]]:
    """Seeded op inputs. kv_len is the source length (CROSS; ENCODER_SELF uses tgt_len) or the past length
    (DECODER_SELF, may be 0). Key padding masks keep 1..S tokens per row; `empty_row` pads the last row entirely.
    `bias_positions` M (self-attention kinds): a random position bias (H, 2M - 1) follows, as T5's table would."""
    import torch

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
        inputs = (query, rand(batch, tgt_len, D), rand(batch, tgt_len, D), padding_mask(tgt_len))
    elif kind is AttentionKind.CROSS:
        kv = (rand(batch, heads, kv_len, head_dim), rand(batch, heads, kv_len, head_dim))
        inputs = (query, *kv, padding_mask(kv_len))
    else:
        inputs = (query, rand(batch, tgt_len, D), rand(batch, tgt_len, D),
                  rand(batch, heads, kv_len, head_dim), rand(batch, heads, kv_len, head_dim))
    if bias_positions is not None:
        inputs += (rand(heads, 2 * bias_positions - 1),)
    return attrs, inputs
