"""The fused attention op: one definition shared by the fuser, the TensorRT plugin, the kernels and the validators.

One op, three uses (`AttentionKind`). In ONNX it is a node `op_type=PLUGIN_NAME` in domain `DOMAIN` with the
attributes `plugin_version`, `plugin_namespace` (what TensorRT's ONNX parser needs to find the registered
plugin) and the op's own: `kind`, `num_heads`, `head_dim`, `scale`.

Layouts (B batch, T query tokens, S source length, P past length, H heads, Dh head_dim, D = H * Dh):
- query, and new key/value: (B, T, D), i.e. (B, T, H, Dh) token-major, straight from the projections;
- cached / precomputed key/value: (B, H, L, Dh), the graph contract's KV layout;
- key_padding_mask: (B, S) int32, 1 for a token, 0 for padding;
- output: (B, T, D), ready for the output projection.

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


INPUTS: dict[AttentionKind, tuple[str, ...]] = {
    AttentionKind.ENCODER_SELF: ("query", "key", "value", "key_padding_mask"),
    AttentionKind.DECODER_SELF: ("query", "key", "value", "past_key", "past_value"),
    AttentionKind.CROSS: ("query", "cross_key", "cross_value", "key_padding_mask"),
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


def reference_attention(attrs: AttentionAttrs, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The op in plain PyTorch. fp16/bf16 inputs are computed in fp32 and returned in their own dtype."""
    import torch

    query = inputs[0]
    dtype = query.dtype
    compute = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    q = _heads(query.to(compute), attrs.num_heads)  # (B, H, T, Dh)
    B, H, T, _ = q.shape
    if attrs.kind is AttentionKind.DECODER_SELF:
        key, value, past_key, past_value = inputs[1:5]
        present_key = torch.cat([past_key, _heads(key, attrs.num_heads)], dim=2)  # (B, H, P + T, Dh)
        present_value = torch.cat([past_value, _heads(value, attrs.num_heads)], dim=2)
        k, v = present_key.to(compute), present_value.to(compute)
        P = past_key.shape[2]
        q_pos = P + torch.arange(T, device=q.device)
        allowed = (torch.arange(P + T, device=q.device)[None, :] <= q_pos[:, None])[None, None]  # (1, 1, T, P+T)
    else:
        key, value, mask = inputs[1:4]
        if attrs.kind is AttentionKind.ENCODER_SELF:
            k, v = _heads(key.to(compute), attrs.num_heads), _heads(value.to(compute), attrs.num_heads)
        else:
            k, v = key.to(compute), value.to(compute)  # already (B, H, S, Dh)
        allowed = (mask != 0)[:, None, None, :]  # (B, 1, 1, S)
    scores = (q @ k.transpose(-2, -1)) * attrs.scale  # (B, H, T, L)
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
