"""Enterprise TensorRT >= 10.9 only: the attention op as a `tensorrt.plugin` ahead-of-time (QDP) plugin.

An engine whose plugin layers are AOT plugins embeds their PTX and launch parameters and runs without Python
(e.g. under trtexec). TensorRT-RTX rejects this route (its `plugin` module is a stub; see `trt_compat`), and
enterprise TensorRT does not install on our machines, so NOTHING IN THIS MODULE HAS RUN YET: it is written
against the documented `tensorrt.plugin` API (register / autotune / aot_impl, KernelLaunchParams, SymIntExprs).

Limits of the route, and how they are met:
- An AOT plugin launches ONE kernel, with parameters in the order (input pointers, int32 scalars, output
  pointers) and no float scalar. Encoder self-attention and cross-attention fit (one flash-attention launch, the
  scale baked in as a constexpr); decoder self-attention needs a KV append and, for one token, a split + reduce,
  so it stays on the Python IPluginV3 route. `aot_graph` renames only the eligible nodes to `AOT_OP_TYPE`.
- The kernel comes from the kernels package's `qdp_kernel(kind, dtype, head_dim, scale, cc)`, which must return
  (entry name, PTX text, num_warps, shared bytes, BLOCK_M) for a flash-attention variant with that calling
  convention: (Q, K, V, Mask, B, T, L, H, Out). Until the kernels provide it, registration works but building an
  AOT layer raises a DependencyError saying so.
"""

from __future__ import annotations

import logging
from types import ModuleType

from seq2trt.reference_model.errors import DependencyError

from . import trt_compat
from .op import DOMAIN, PLUGIN_NAME, PLUGIN_NAMESPACE, AttentionAttrs, AttentionKind

logger = logging.getLogger(__name__)

AOT_OP_TYPE = f"{PLUGIN_NAME}Aot"
AOT_KINDS = (AttentionKind.ENCODER_SELF, AttentionKind.CROSS)
QDP_VERSION = "1"  # tensorrt.plugin registers every plugin as version "1"


def aot_graph(model):
    """A copy of a fused graph whose eligible plugin nodes point at the AOT plugin; returns (copy, renamed count)."""
    import onnx
    from onnx import helper

    out = onnx.ModelProto()
    out.CopyFrom(model)
    renamed = 0
    for node in out.graph.node:
        if node.op_type != PLUGIN_NAME or node.domain != DOMAIN:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if AttentionKind(int(attrs["kind"])) not in AOT_KINDS:
            continue
        node.op_type = AOT_OP_TYPE
        for a in node.attribute:
            if a.name == "plugin_version":
                a.s = QDP_VERSION.encode()
        renamed += 1
    return out, renamed


def _kernel(kind: AttentionKind, dtype: str, head_dim: int, scale: float, cc: int):
    try:
        from seq2trt.plugins.kernels import aot
    except ImportError as exc:
        raise DependencyError(f"the attention kernels are not importable ({exc})") from exc
    qdp_kernel = getattr(aot, "qdp_kernel", None)
    if qdp_kernel is None:
        raise DependencyError("the AOT (tensorrt.plugin) route needs seq2trt.plugins.kernels.aot.qdp_kernel: a "
                              "flash-attention variant taking (inputs, int32 scalars, outputs) with the scale as a "
                              "constexpr; it is not provided yet, so build with the default IPluginV3 route")
    return qdp_kernel(kind, dtype, head_dim, scale, cc)


def register_aot(trt: ModuleType) -> None:
    """Register the AOT plugin `seq2trt::Seq2TrtAttentionAot` with enterprise TensorRT's `tensorrt.plugin`."""
    if trt.__name__ != trt_compat.FLAVOURS[trt_compat.Flavour.TENSORRT].module or \
            trt_compat.PluginRoute.QDP_AOT not in trt_compat.plugin_routes(trt, trt_compat.Flavour.TENSORRT):
        raise DependencyError(f"the tensorrt.plugin AOT route needs enterprise TensorRT >= "
                              f"{'.'.join(map(str, trt_compat.QDP_MIN_VERSION))}, not {trt.__name__} {trt.__version__}")
    import tensorrt.plugin as trtp

    plugin_id = f"{PLUGIN_NAMESPACE}::{AOT_OP_TYPE}"
    if plugin_id in _registered:
        return

    @trtp.register(plugin_id)
    def describe(query: trtp.TensorDesc, key: trtp.TensorDesc, value: trtp.TensorDesc,
                 key_padding_mask: trtp.TensorDesc, kind: int, num_heads: int, head_dim: int,
                 scale: float) -> trtp.TensorDesc:
        return query.like()  # (B, T, D), the query's dtype

    @trtp.autotune(plugin_id)
    def formats(query: trtp.TensorDesc, key: trtp.TensorDesc, value: trtp.TensorDesc,
                key_padding_mask: trtp.TensorDesc, outputs: tuple[trtp.TensorDesc]) -> list[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(f"{t}, {t}, {t}, INT32, {t}") for t in ("FP32", "FP16", "BF16")]

    @trtp.aot_impl(plugin_id)
    def kernel(query: trtp.TensorDesc, key: trtp.TensorDesc, value: trtp.TensorDesc,
               key_padding_mask: trtp.TensorDesc, kind: int, num_heads: int, head_dim: int, scale: float,
               outputs: tuple[trtp.TensorDesc], tactic: int
               ) -> tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymExprs]:
        attrs = AttentionAttrs(AttentionKind(kind), num_heads, head_dim, scale)
        dtype = {trt.float32: "fp32", trt.float16: "fp16", trt.bfloat16: "bf16"}[query.dtype]
        name, ptx, num_warps, shared, block_m = _kernel(attrs.kind, dtype, head_dim, scale, _current_cc())
        q = query.shape_expr  # (B, T, D)
        length = key.shape_expr[1] if attrs.kind is AttentionKind.ENCODER_SELF else key.shape_expr[2]
        params = trtp.KernelLaunchParams()
        params.grid_x = trtp.cdiv(q[1], block_m)
        params.grid_y = q[0] * num_heads
        params.block_x = 32 * num_warps
        params.shared_mem = shared
        scalars = trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in (q[0], q[1], length, num_heads)])
        return name, ptx, params, scalars

    _registered.add(plugin_id)
    logger.debug("registered the tensorrt.plugin AOT route %s", plugin_id)


_registered: set[str] = set()


def _current_cc() -> int:
    """Enterprise TensorRT builds on the GPU it targets: its compute capability picks the PTX."""
    import torch

    major, minor = torch.cuda.get_device_capability()
    return 10 * major + minor
