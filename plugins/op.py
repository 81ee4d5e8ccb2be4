"""The fused attention op: one definition shared by the fuser, the TensorRT plugin, the kernels and the validators.

One op, three uses (`AttentionKind`). In ONNX it is a node `op_type=PLUGIN_NAME` in domain `DOMAIN` with the
attributes `plugin_version`, `plugin_namespace` (what TensorRT's ONNX parser needs to find the registered
plugin) and the op's own: `kind`, `num_heads`, `head_dim`, `scale`.

Layouts (B batch, T query tokens, S source length, P past length, H heads, Dh head_dim, D = H * Dh):
- query, and new key/value: (B, T, D), i.e. (B, T, H, Dh) token-major, straight from the projections;
- cached / precomputed key/value: (B, H, L, Dh), the graph contract's KV layout;
- key_padding_mask: (B, S) int32, 1 for a token, 0 for padding;
- position_bias (optional, the self-attention kinds; T5's relative position bias): (H, 2M - 1) in the query's dtype,
  a bias by signed distance added to the scores: query position i and key position j read column M - 1 + j - i,
  query positions starting at the past length (DECODER_SELF) or 0 (ENCODER_SELF); M covers every position;
- output: (B, T, D), ready for the output projection.

`pack_inputs` puts the inputs in their order (`INPUTS[kind]`, then the optional ones given) and `unpack_inputs` names
them again: every caller of the op builds and reads its inputs there.

A query row with no allowed key (an all-padding source, in encoder self-attention or cross-attention) attends to
every one of its L keys alike: its output is the mean of V over the row's L keys. That is what
masking with the lowest finite score gives, and so what the eager model, Hugging Face transformers' eager attention,
the unfused graphs' attention functions and ONNX Runtime's MultiHeadAttention with `mask_filter_value=LOWEST_FP32`
(the fused ORT graphs; its default, -10000 added to the score, would attend to the row as if unmasked) compute.
The kernels give a padded key in range a large finite negative score, so a fully padded row averages its keys too.

`reference_attention` is the definition of correct: every kernel and every backend is tested against it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

# The model's blocks know their kind; the op shares it. From the torch-free config module: TensorRT's build child
# imports this file (the plugin's names and attributes) and would otherwise pay 1.2 s for torch it never uses.
from seq2trt.reference_model.config import AttentionKind

if TYPE_CHECKING:
    import torch

DOMAIN = "seq2trt"
PLUGIN_NAME = "Seq2TrtAttention"
PLUGIN_VERSION = "1"
PLUGIN_NAMESPACE = "seq2trt"
LOWEST_FP32 = -3.4028234663852886e38  # a masked score that keeps a fully masked row finite: every key scores alike


# The required inputs of each kind, in order; an optional input follows them when it is given.
INPUTS: dict[AttentionKind, tuple[str, ...]] = {
    AttentionKind.ENCODER_SELF: ("query", "key", "value", "key_padding_mask"),
    AttentionKind.DECODER_SELF: ("query", "key", "value", "past_key", "past_value"),
    AttentionKind.CROSS: ("query", "cross_key", "cross_value", "key_padding_mask"),
}
POSITION_BIAS = "position_bias"
OPTIONAL_INPUTS: dict[AttentionKind, tuple[str, ...]] = {
    AttentionKind.ENCODER_SELF: (POSITION_BIAS,),
    AttentionKind.DECODER_SELF: (POSITION_BIAS,),
    AttentionKind.CROSS: (),
}
OUTPUTS: dict[AttentionKind, tuple[str, ...]] = {
    AttentionKind.ENCODER_SELF: ("output",),
    AttentionKind.DECODER_SELF: ("output", "present_key", "present_value"),
    AttentionKind.CROSS: ("output",),
}


@dataclass(frozen=True)
class AttentionAttrs:
    kind: AttentionKind
    num_heads: int
    head_dim: int
    scale: float

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.head_dim < 1 or not self.scale > 0:
            raise ValueError(f"invalid attention attributes {self}")

    def marked_attributes(self) -> dict:
        """The op's own attributes (`ATTRIBUTES`), as the exporter's marked nodes carry them."""
        return {"kind": int(self.kind), "num_heads": self.num_heads, "head_dim": self.head_dim,
                "scale": float(self.scale)}

    def onnx_attributes(self) -> dict:
        """Node attributes of the plugin node: TensorRT's plugin lookup keys, then the op's own."""
        return {"plugin_version": PLUGIN_VERSION, "plugin_namespace": PLUGIN_NAMESPACE, **self.marked_attributes()}

    @classmethod
    def from_onnx(cls, attrs: dict) -> "AttentionAttrs":
        return cls(AttentionKind(int(attrs["kind"])), int(attrs["num_heads"]), int(attrs["head_dim"]),
                   float(attrs["scale"]))


ATTRIBUTES = tuple(f.name for f in dataclasses.fields(AttentionAttrs))  # the op's own attribute names


@dataclass(frozen=True)
class OpInputs:
    """The op's inputs by name (`unpack_inputs`); key/value are the cross K/V for CROSS."""
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    key_padding_mask: torch.Tensor | None = None
    past_key: torch.Tensor | None = None
    past_value: torch.Tensor | None = None
    position_bias: torch.Tensor | None = None


def input_names(kind: AttentionKind, position_bias: bool = False) -> tuple[str, ...]:
    """The names of one call's inputs, in order."""
    return INPUTS[kind] + ((POSITION_BIAS,) if position_bias else ())


def pack_inputs(kind: AttentionKind, query, key, value, key_padding_mask=None, past=None,
                position_bias=None) -> tuple:
    """The op's inputs in order (`input_names`) from what an attention core holds: `past` the (key, value) of
    DECODER_SELF, the mask as int32 (the op's mask dtype). A missing input or a bias on CROSS raises ValueError."""
    import torch

    if position_bias is not None and POSITION_BIAS not in OPTIONAL_INPUTS[kind]:
        raise ValueError(f"{kind.name} attention takes no position bias")
    past_key, past_value = past if past is not None else (None, None)
    mask = None if key_padding_mask is None else key_padding_mask.to(torch.int32)
    named = {"query": query, "key": key, "value": value, "cross_key": key, "cross_value": value,
             "key_padding_mask": mask, "past_key": past_key, "past_value": past_value, POSITION_BIAS: position_bias}
    names = input_names(kind, position_bias is not None)
    missing = [name for name in names if named[name] is None]
    if missing:
        raise ValueError(f"{kind.name} attention needs {', '.join(missing)}")
    return tuple(named[name] for name in names)


def unpack_inputs(kind: AttentionKind, inputs) -> OpInputs:
    """The op's inputs (`pack_inputs`' order) by name; a wrong count raises ValueError."""
    required, optional = INPUTS[kind], OPTIONAL_INPUTS[kind]
    if not len(required) <= len(inputs) <= len(required) + len(optional):
        raise ValueError(f"{kind.name} attention takes {len(required)} inputs ({', '.join(required)}) and optionally "
                         f"{', '.join(optional) or 'none'}, got {len(inputs)}")
    named = dict(zip(required + optional, inputs))
    return OpInputs(named["query"], named.get("key", named.get("cross_key")),
                    named.get("value", named.get("cross_value")), named.get("key_padding_mask"),
                    named.get("past_key"), named.get("past_value"), named.get(POSITION_BIAS))


def output_shapes(attrs: AttentionAttrs, input_shapes: list[tuple]) -> list[tuple]:
    """Output shapes from input shapes (ints or symbolic sizes), for every kind."""
    query = input_shapes[0]
    if attrs.kind is AttentionKind.DECODER_SELF:
        past = input_shapes[3]  # (B, H, P, Dh)
        present = (past[0], past[1], past[2] + query[1], past[3])
        return [tuple(query), present, present]
    return [tuple(query)]


def _heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    B, T, D = x.shape
    return x.reshape(B, T, num_heads, D // num_heads).transpose(1, 2)  # (B, H, T, Dh)


def _bias_by_distance(bias: torch.Tensor, first_query: int, tgt_len: int, key_len: int) -> torch.Tensor:
    """(H, 2M - 1) by signed distance -> (H, T, L) for queries first_query .. + T - 1 and keys 0 .. L - 1."""
    import torch

    if bias.dim() != 2 or bias.shape[1] % 2 == 0:
        raise ValueError(f"position_bias must be (heads, 2M - 1), got {tuple(bias.shape)}")
    M = (bias.shape[1] + 1) // 2
    if max(first_query + tgt_len, key_len) > M:
        raise ValueError(f"position_bias covers {M} positions, the call reaches {max(first_query + tgt_len, key_len)}")
    distance = torch.arange(key_len, device=bias.device)[None, :] - torch.arange(
        first_query, first_query + tgt_len, device=bias.device)[:, None]  # (T, L): key - query position
    return bias[:, distance + M - 1]


def reference_attention(attrs: AttentionAttrs, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The op in plain PyTorch. fp16/bf16 inputs are computed in fp32 and returned in their own dtype."""
    import torch

    ins = unpack_inputs(attrs.kind, inputs)
    dtype = ins.query.dtype
    compute = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    q = _heads(ins.query.to(compute), attrs.num_heads)  # (B, H, T, Dh)
    B, H, T, _ = q.shape
    P = 0
    if attrs.kind is AttentionKind.DECODER_SELF:
        present_key = torch.cat([ins.past_key, _heads(ins.key, attrs.num_heads)], dim=2)  # (B, H, P + T, Dh)
        present_value = torch.cat([ins.past_value, _heads(ins.value, attrs.num_heads)], dim=2)
        k, v = present_key.to(compute), present_value.to(compute)
        P = ins.past_key.shape[2]
        q_pos = P + torch.arange(T, device=q.device)
        allowed = (torch.arange(P + T, device=q.device)[None, :] <= q_pos[:, None])[None, None]  # (1, 1, T, P+T)
    else:
        if attrs.kind is AttentionKind.ENCODER_SELF:
            k, v = _heads(ins.key.to(compute), attrs.num_heads), _heads(ins.value.to(compute), attrs.num_heads)
        else:
            k, v = ins.key.to(compute), ins.value.to(compute)  # already (B, H, S, Dh)
        allowed = (ins.key_padding_mask != 0)[:, None, None, :]  # (B, 1, 1, S)
    scores = (q @ k.transpose(-2, -1)) * attrs.scale  # (B, H, T, L)
    if ins.position_bias is not None:
        scores = scores + _bias_by_distance(ins.position_bias.to(compute), P, T, k.shape[2])  # (H, T, L) over B
    scores = scores.masked_fill(~allowed, float("-inf"))
    scores = scores.masked_fill(~allowed.any(-1, keepdim=True), 0.0)  # no allowed key: all alike, mean of V
    probs = torch.softmax(scores, dim=-1)
    out = (probs @ v).transpose(1, 2).reshape(B, T, H * attrs.head_dim).to(dtype)  # (B, T, D)
    if attrs.kind is AttentionKind.DECODER_SELF:
        return out, present_key, present_value
    return (out,)


def attrs_from_node(node) -> AttentionAttrs:
    """The attributes of a plugin node (an onnx NodeProto), read as `AttentionAttrs.from_onnx` reads them."""
    from onnx import helper

    return AttentionAttrs.from_onnx({a.name: helper.get_attribute_value(a) for a in node.attribute})
