"""Export a model to the encoder graph and the one KV-cached decoder graph (docs/design.md, "Graph contract").

`torch.onnx.export(dynamo=True)` traces thin wrappers around `Seq2SeqTransformer.encode`/`cross_kv` and
`decode_step`. The traced copy computes attention with `marked_core` (`Seq2SeqTransformer.use_attention`), which
emits each attention block as one node of domain `spec.MARKED_DOMAIN`; the graph then gets one ONNX local function per
kind (`attention_functions`) so it still runs anywhere (spec.py documents the marking for the fuser).

fp16/bf16 exports are strongly typed (every tensor has one dtype, as TensorRT 11 wants), keep LayerNorm in fp32
(cast in, fp32 weights, cast out; RMSNorm takes its variance in fp32 itself), tanh-GELU in fp32, and softmax in fp32
inside the attention functions. fp16 is refused for gated-FFN T5 models, whose activations overflow it; bf16 has
fp32's range.
"""

from __future__ import annotations

import copy
import logging
import time
import warnings
from typing import Callable
from pathlib import Path

import onnx
import torch
import torch.nn as nn

from seq2trt.core.dtypes import DTYPES, torch_dtype
from seq2trt.plugins.op import AttentionAttrs, AttentionKind, pack_inputs
from seq2trt.core.errors import ArtifactError, ConfigError
from seq2trt.core.swap import staged_directory
from seq2trt.reference_model.model import Seq2SeqTransformer

from seq2trt.exporters import graph_files, spec
from seq2trt.exporters.attention_functions import attention_functions, marked_kind, marked_op_type
from seq2trt.exporters.manifest import MANIFEST, write_manifest
from seq2trt.exporters.torch_cache import check_torch_cache, reused_torchlib_registry
from seq2trt.exporters.whisper_features import write_model_features

logger = logging.getLogger(__name__)

TORCH_DTYPES = {name: torch_dtype(name) for name in DTYPES}


def marked_core(kind: AttentionKind, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int,
                scale: float, key_padding_mask: torch.Tensor | None = None, past=None, position_bias=None):
    """`attention_core`'s signature; emits one marked node carrying the fused op's inputs and attributes (the biased
    variant, `position_bias` (H, 2M - 1) its last input, when the block has a relative position bias)."""
    B, T, D = q.shape
    attrs = AttentionAttrs(kind, num_heads, D // num_heads, float(scale))
    onnx_attrs = attrs.marked_attributes()
    op = f"{spec.MARKED_DOMAIN}::{marked_op_type(kind, position_bias is not None)}"
    inputs = list(pack_inputs(kind, q, k, v, key_padding_mask, past, position_bias))
    if kind is AttentionKind.DECODER_SELF:
        present_shape = (B, num_heads, past[0].shape[2] + T, attrs.head_dim)  # (B, H, P + T, Dh)
        out, key, value = torch.onnx.ops.symbolic_multi_out(
            op, inputs, onnx_attrs, dtypes=[q.dtype] * 3,
            shapes=[q.shape, present_shape, present_shape], version=spec.MARKED_VERSION)
        return out, (key, value)
    out = torch.onnx.ops.symbolic(op, inputs, onnx_attrs, dtype=q.dtype, shape=q.shape, version=spec.MARKED_VERSION)
    return out, (k, v)


class Float32LayerNorm(nn.Module):
    """LayerNorm computed in fp32 with fp32 weights, returning the input's dtype (fp16/bf16 exports)."""

    def __init__(self, norm: nn.LayerNorm):
        super().__init__()
        self.norm = copy.deepcopy(norm).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.float()).to(x.dtype)


class Float32Activation(nn.Module):
    """An activation computed in fp32, returning the input's dtype: tanh-GELU's constants (sqrt(2/pi), 0.044715)
    would otherwise be stored rounded to fp16/bf16, a change of the function rather than of its arithmetic."""

    def __init__(self, act: nn.Module):
        super().__init__()
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x.float()).to(x.dtype)


class Float32FrontEnd(nn.Module):
    """An audio front end computed in fp32 on the export dtype's own (rounded, exactly widened) weights, returning
    that dtype: ONNX's Conv takes no bfloat16 before opset 22, and in fp16 the erf-GELU's constant stored rounded
    changes the function where the convolutions' sums cancel (0.7071 to 0.7070)."""

    def __init__(self, frontend: nn.Module):
        super().__init__()
        self.frontend = copy.deepcopy(frontend).float()

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.frontend(features.float()).to(features.dtype)


def export_copy(model: Seq2SeqTransformer, dtype: str) -> Seq2SeqTransformer:
    """A copy of `model` in `dtype`, eval mode, every attention block marked (`marked_core`), with fp32 LayerNorms
    and tanh-GELUs when the dtype is narrower, and an audio front end convolving in fp32."""
    if dtype not in TORCH_DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of {', '.join(TORCH_DTYPES)}")
    if dtype == "fp16" and model.cfg.gated_ffn and model.cfg.relative_bias != "none":
        # T5 v1.1 / mT5 / UMT5 activations pass fp16's 65504 in the gated FFN (transformers keeps `wo` in fp32).
        raise ConfigError("fp16 is refused for gated-FFN T5 models (T5 v1.1, flan-t5, mT5, UMT5): their FFN "
                          "activations overflow fp16; export with --dtype bf16 (same range as fp32) or fp32")
    # The copy starts sharing every weight with the model (a deep copy of the modules only); weights in another
    # dtype are then replaced in the copy alone, one tensor at a time. So an fp32 export holds one copy of the
    # weights and an fp16/bf16 export the fp32 model plus its narrow weights, never a second fp32 copy.
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    copied = copy.deepcopy(model, shared).eval().use_attention(marked_core)
    norms = {name: m for name, m in copied.named_modules() if isinstance(m, nn.LayerNorm)}
    _convert_copy(copied, TORCH_DTYPES[dtype])
    if dtype != "fp32":
        for name, norm in norms.items():
            parent_name, _, child = name.rpartition(".")
            setattr(copied.get_submodule(parent_name), child, Float32LayerNorm(norm))
        for block in [m for m in copied.modules() if isinstance(getattr(m, "act", None), nn.GELU)]:
            if block.act.approximate == "tanh":
                block.act = Float32Activation(block.act)
    if dtype != "fp32" and copied.frontend is not None:
        copied.frontend = Float32FrontEnd(copied.frontend)
    return copied


def _convert_copy(copied: nn.Module, dtype: torch.dtype) -> None:
    """What `copied.to(dtype)` does to floating-point parameters and buffers, with new tensors set on `copied` only
    (`.to` would change the shared tensors of the model it was copied from); a tensor shared by two modules (a
    tied embedding) stays one tensor."""
    converted: dict[int, torch.Tensor] = {}
    for module in copied.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is None or not tensor.is_floating_point() or tensor.dtype == dtype:
                    continue
                if id(tensor) not in converted:
                    narrow = tensor.detach().to(dtype)
                    converted[id(tensor)] = nn.Parameter(narrow, tensor.requires_grad) \
                        if isinstance(tensor, nn.Parameter) else narrow
                table[name] = converted[id(tensor)]


class EncoderGraph(nn.Module):
    def __init__(self, model: Seq2SeqTransformer):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hidden = self.model.encode(input_ids, attention_mask)  # (B, S, D)
        return (hidden, *spec.flatten_kv(self.model.cross_kv(hidden)))


class AudioEncoderGraph(EncoderGraph):
    """The encoder of an audio source: features (B, n_mels, 2 M) in, the conv front end inside; its self-attention
    mask is all ones (B, M), made in the graph from the batch size (Whisper masks nothing)."""

    def forward(self, input_features: torch.Tensor) -> tuple[torch.Tensor, ...]:
        mask = torch.ones(input_features.shape[0], self.model.cfg.max_src_len, dtype=torch.int64,
                          device=input_features.device)  # (B, M)
        return super().forward(input_features, mask)


class DecoderGraph(nn.Module):
    def __init__(self, model: Seq2SeqTransformer):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, encoder_attention_mask: torch.Tensor, cross: tuple, past: tuple
                ) -> tuple[torch.Tensor, ...]:
        logits, present = self.model.decode_step(input_ids, encoder_attention_mask, list(cross), list(past))
        return (logits, *spec.flatten_kv(present))


def _examples(model: Seq2SeqTransformer, kind: spec.GraphKind) -> tuple[tuple, tuple]:
    """Example inputs and dynamic shapes. Sizes are >= 2 and pairwise distinct, so no axis is specialised
    or merged with another; past_len's Dim starts at 0 so the same graph serves the first step."""
    from torch.export import Dim

    cfg = model.cfg
    if min(cfg.max_src_len, cfg.max_tgt_len) < 4:
        raise ConfigError("export needs max_src_len and max_tgt_len >= 4 to trace dynamic axes")
    B, S, T, P = 2, min(7, cfg.max_src_len), 3, min(5, cfg.max_tgt_len - 3)
    batch = Dim(spec.BATCH, min=1)
    src = Dim(spec.SRC_LEN, min=1, max=cfg.max_src_len)
    ids = torch.randint(3, min(cfg.src_vocab_size, cfg.tgt_vocab_size), (B, S))
    mask = torch.ones(B, S, dtype=torch.int64)
    param = next(model.parameters())
    if kind is spec.GraphKind.ENCODER and spec.audio_source(cfg):
        return (torch.randn(B, cfg.n_mels, cfg.source_frames).to(param.dtype),), ({0: batch},)
    if kind is spec.GraphKind.ENCODER:
        return (ids, mask), ({0: batch, 1: src}, {0: batch, 1: src})
    tgt = Dim(spec.TGT_LEN, min=1, max=cfg.max_tgt_len)
    past = Dim(spec.PAST_LEN, min=0, max=cfg.max_tgt_len - 1)
    H, Dh, L = cfg.num_heads, cfg.head_dim, cfg.num_decoder_layers
    kv = lambda n: tuple((param.new_zeros(B, H, n, Dh), param.new_zeros(B, H, n, Dh)) for _ in range(L))
    kv_dims = lambda axis: tuple(({0: batch, 2: axis}, {0: batch, 2: axis}) for _ in range(L))
    args = (ids[:, :T], mask, kv(S), kv(P))
    return args, ({0: batch, 1: tgt}, {0: batch, 1: src}, kv_dims(src), kv_dims(past))


def trace_program(model: Seq2SeqTransformer, kind: spec.GraphKind, opset: int):
    """torch.onnx's program of one graph (its tensors still the model's: nothing is copied until it is written)."""
    encoder = AudioEncoderGraph if spec.audio_source(model.cfg) else EncoderGraph
    wrapper = (encoder if kind is spec.GraphKind.ENCODER else DecoderGraph)(model).eval()
    args, dynamic = _examples(model, kind)
    names_in = [s.name for s in spec.inputs(model.cfg, kind)]
    names_out = [s.name for s in spec.outputs(model.cfg, kind)]
    with torch.no_grad(), warnings.catch_warnings(), reused_torchlib_registry():
        # Dims that share constraints produce "axis name ... will not be used" notes; the names are checked below.
        warnings.filterwarnings("ignore", message=".*will not be used.*")
        warnings.filterwarnings("ignore", category=FutureWarning)
        return torch.onnx.export(wrapper, args, dynamo=True, dynamic_shapes=dynamic, input_names=names_in,
                                 output_names=names_out, opset_version=opset, external_data=False, verbose=False)


def finish(proto: onnx.ModelProto, cfg, opset: int) -> onnx.ModelProto:
    """The traced graph made the contract's: attention functions attached, nodes named after their blocks."""
    proto.functions.extend(attention_functions(opset, biased=cfg.relative_bias != "none"))
    _name_blocks(proto)
    proto.producer_name = "seq2trt"
    return proto


def trace(model: Seq2SeqTransformer, kind: spec.GraphKind, opset: int) -> onnx.ModelProto:
    """One graph in memory, marked, with its attention functions attached and its nodes named after their blocks
    (a small model's: `write_graph` writes a graph of any size)."""
    return finish(trace_program(model, kind, opset).model_proto, model.cfg, opset)


def write_graph(model: Seq2SeqTransformer, kind: spec.GraphKind, opset: int, path: Path,
                progress: Callable[[str], None] = logger.info) -> onnx.ModelProto:
    """Trace one graph into `path` (its weights streamed into external data past the threshold: graph_files) and
    return its structure, finished (`finish`) and written back over the file (the data file is unchanged)."""
    import onnx_ir as ir

    program = trace_program(model, kind, opset)
    size = sum(v.const_value.nbytes for v in program.model.graph.initializers.values() if v.const_value is not None)
    external = size > graph_files.threshold()
    progress(f"writing the {kind.value} graph: {size / 2**30:.2f} GiB of weights"
             + (f" to {graph_files.data_name(path)}" if external else ""))
    ir.save(program.model, str(path), external_data=graph_files.data_name(path) if external else None,
            size_threshold_bytes=graph_files.INLINE_TENSOR_BYTES)
    del program  # the torch tensors it references belong to the model; its own buffers go now
    proto = finish(onnx.load(str(path), load_external_data=False), model.cfg, opset)
    onnx.save(proto, str(path))
    return proto


def _name_blocks(proto: onnx.ModelProto) -> None:
    """Name each marked node after its module path, taken from the exporter's name-scope metadata."""
    for node in proto.graph.node:
        if node.domain != spec.MARKED_DOMAIN:
            continue
        scopes = next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.name_scopes"), "")
        attn = [s.strip(" '") for s in scopes.strip("[]").split(",") if s.strip(" '").endswith("_attn")]
        if not attn:
            raise ArtifactError(f"marked node {node.name} has no attention module scope ({scopes!r}); "
                                "the exporter's metadata changed: update _name_blocks")
        node.name = attn[-1].removeprefix("model.")


def check_graph(proto: onnx.ModelProto, cfg, kind: spec.GraphKind, dtype: str) -> None:
    """Raise ArtifactError listing every way the exported graph breaks the contract: frozen or renamed axes,
    wrong dtypes, an `If`/`Loop`/`Scan` node, a missing or miscounted attention block."""
    problems = []
    elem = spec.DTYPES[dtype][1]
    for want, have in ((spec.inputs(cfg, kind), proto.graph.input), (spec.outputs(cfg, kind), proto.graph.output)):
        have_by_name = {v.name: v for v in have}
        if [s.name for s in want] != [v.name for v in have]:
            problems.append(f"names {[v.name for v in have]} differ from the spec's {[s.name for s in want]}")
            continue
        for s in want:
            t = have_by_name[s.name].type.tensor_type
            want_elem = onnx.TensorProto.INT64 if s.dtype == "int64" else elem
            if t.elem_type != want_elem:
                problems.append(f"{s.name}: elem type {t.elem_type}, expected {want_elem}")
            dims = [d.dim_param or d.dim_value for d in t.shape.dim]
            if len(dims) != len(s.axes) or any(
                    (d != a) if isinstance(a, int) else not isinstance(d, str) or
                    (a != spec.PRESENT_LEN and d != a) for d, a in zip(dims, s.axes)):
                problems.append(f"{s.name}: axes {dims}, expected {list(s.axes)} (a number where a name is "
                                "expected means the export froze that axis)")
    bodies = [proto.graph.node] + [f.node for f in proto.functions]
    control = sorted({n.op_type for nodes in bodies for n in nodes if n.op_type in ("If", "Loop", "Scan")})
    if control:
        problems.append(f"control-flow nodes {control} in the graph (TensorRT rejects them)")
    kinds = [marked_kind(n.op_type) for n in proto.graph.node if n.domain == spec.MARKED_DOMAIN]
    counts = {k: sum(found is not None and found[0] is k for found in kinds) for k in AttentionKind}
    want_counts = {k: spec.expected_blocks(cfg, kind).get(k, 0) for k in AttentionKind}
    biased = {bool(found[1]) for found in kinds if found is not None and found[0] is not AttentionKind.CROSS}
    if biased - {cfg.relative_bias != "none"}:
        problems.append(f"self-attention blocks {'with' if True in biased else 'without'} a position bias in a model "
                        f"whose relative_bias is {cfg.relative_bias!r}")
    if counts != want_counts:
        problems.append(f"attention blocks {dict((k.name, v) for k, v in counts.items())}, expected "
                        f"{dict((k.name, v) for k, v in want_counts.items())}")
    if problems:
        raise ArtifactError(f"exported {kind.value} graph breaks the contract: " + "; ".join(problems))


def export(model: Seq2SeqTransformer, out: Path, dtype: str = "fp32", opset: int = spec.DEFAULT_OPSET,
           limits: spec.Limits | None = None, force: bool = False, source: dict | None = None,
           progress: Callable[[str], None] = logger.info) -> Path:
    """Write `out/encoder.onnx`, `out/decoder.onnx` and `out/manifest.json` atomically; returns `out`.

    `source` (checkpoint path and weights hash) is recorded in the manifest so `validate` can find the model;
    `progress` hears each graph traced, written and checked (a big model's take minutes).
    """
    if opset not in spec.OPSETS:
        raise ConfigError(f"opset {opset} is not supported; choose {spec.OPSETS.start}..{spec.OPSETS.stop - 1}")
    check_torch_cache()
    limits = limits or spec.Limits.for_model(model.cfg)
    if dtype != "fp32":
        progress(f"converting the model's weights to {dtype}")
    exported = export_copy(model, dtype)
    timings = {}
    protect = (Path(source["checkpoint"]),) if source and source.get("checkpoint") else ()
    with staged_directory(out, force, "export", kind=MANIFEST, protect=protect) as tmp:
        for kind in spec.GraphKind:
            start = time.perf_counter()
            progress(f"tracing the {kind.value} graph")
            proto = write_graph(exported, kind, opset, tmp / kind.filename, progress)
            check_graph(proto, model.cfg, kind, dtype)
            del proto
            progress(f"checking the {kind.value} graph (onnx checker, full type inference)")
            graph_files.check_model_file(tmp / kind.filename, full_check=True)  # strict type inference
            timings[kind.value] = round(time.perf_counter() - start, 2)
            progress(f"exported the {kind.value} graph in {timings[kind.value]:.1f} s")
        files = [p.name for k in spec.GraphKind for p in graph_files.graph_files(tmp / k.filename)]
        if spec.audio_source(model.cfg):
            progress("writing the features graph (log-mel front end)")
            files += [p.name for p in graph_files.graph_files(write_model_features(tmp, model.cfg, source, opset))]
        settings = {"dtype": dtype, "opset": opset, "limits": vars(limits), "export_seconds": timings}
        write_manifest(tmp, model.cfg, settings, files, source=source)
    return Path(out)
