"""The fused attention op as a TensorRT plugin: IPluginV3 (OneCore/OneBuild/OneRuntime) + IPluginCreatorV3One.

This is the one plugin route both flavours accept (TensorRT-RTX accepts nothing else; see `trt_compat`). The
classes are made per TensorRT module (`tensorrt` or `tensorrt_rtx`), since they must derive from that module's
bases; `register(trt)` puts the creator in that module's registry under PLUGIN_NAME / PLUGIN_VERSION /
PLUGIN_NAMESPACE, which is what the ONNX parser looks up for a node `op_type=PLUGIN_NAME` with the
`plugin_version` and `plugin_namespace` attributes.

The plugin's fields are the node's attributes (`AttentionAttrs`). Output shapes follow `op.output_shapes`,
written with TensorRT's expression builder; output dtypes equal the query's; each float input/output takes the
query's dtype (fp32, fp16 or bf16), the key padding mask int32, all linear; the optional position bias (the
self-attention kinds, T5) is one more input after the required ones, in the query's dtype, passed to the kernels
as a pointer to its (H, 2M - 1) table. The workspace is the kernels'
(`kernels.launch_plan.workspace_bytes`). `enqueue` hands one `AttentionCall` to a `cuda_launcher.KernelLauncher`
(precompiled kernels, CUDA driver API); nothing else here touches the GPU.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import numpy as np

from seq2trt.core.errors import InputError

from seq2trt.plugins import cuda_launcher
from seq2trt.plugins.kernels.launch_plan import kernel_head_dim_problem, workspace_bytes
from seq2trt.plugins.op import (INPUTS, OUTPUTS, PLUGIN_NAME, PLUGIN_NAMESPACE, PLUGIN_VERSION, AttentionAttrs,
                                AttentionKind, input_names)

logger = logging.getLogger(__name__)

# Node attributes the parser hands over as plugin fields, typed as `AttentionAttrs.onnx_attributes` writes them (any
# instance will do). plugin_version / plugin_namespace select the creator; they arrive as fields too and are checked
# against ours.
_ATTRIBUTES = AttentionAttrs(AttentionKind.ENCODER_SELF, 1, 1, 1.0).onnx_attributes()
INT_FIELDS = tuple(name for name, value in _ATTRIBUTES.items() if isinstance(value, int))
FLOAT_FIELDS = tuple(name for name, value in _ATTRIBUTES.items() if isinstance(value, float))
TEXT_FIELDS = {name: value for name, value in _ATTRIBUTES.items() if isinstance(value, str)}
MASK_INPUT = "key_padding_mask"


def _text(data) -> str:
    raw = data.tobytes() if isinstance(data, np.ndarray) else bytes(data) if not isinstance(data, str) else data
    return raw.decode() if isinstance(raw, bytes) else raw


def attrs_from_fields(fields) -> AttentionAttrs:
    """AttentionAttrs from a PluginFieldCollection (or any iterable of objects with .name/.data); a head_dim the
    kernels do not take is refused here, when TensorRT's parser creates the plugin, not at the first enqueue."""
    values = {}
    for f in fields:
        if f.name in TEXT_FIELDS:
            text = _text(f.data).rstrip("\x00")
            if text != TEXT_FIELDS[f.name]:
                raise InputError(f"{PLUGIN_NAME}: field {f.name}={text!r}, this plugin is {TEXT_FIELDS[f.name]!r}")
        elif f.name in INT_FIELDS or f.name in FLOAT_FIELDS:
            values[f.name] = np.asarray(f.data).reshape(-1)[0].item()
    missing = [n for n in INT_FIELDS + FLOAT_FIELDS if n not in values]
    if missing:
        raise InputError(f"{PLUGIN_NAME}: node lacks attribute(s) {', '.join(missing)}; re-run the fuser")
    attrs = AttentionAttrs.from_onnx(values)
    if problem := kernel_head_dim_problem(attrs.head_dim):
        raise InputError(f"{PLUGIN_NAME}: {problem}")
    return attrs


def field_collection(trt: ModuleType, attrs: AttentionAttrs | None = None) -> tuple:
    """(PluginFieldCollection, its PluginFields): with values (serialization) or empty (the creator's field_names).

    The collection copies raw pointers, not references: keep the fields (which own their arrays) alive with it.
    """
    def field(name, dtype, ftype):
        value = getattr(attrs, name) if attrs is not None else None
        data = np.array([int(value) if dtype == np.int32 else value], dtype=dtype) if attrs is not None \
            else np.array([], dtype=dtype)
        return trt.PluginField(name, data, ftype)

    fields = [field(n, np.int32, trt.PluginFieldType.INT32) for n in INT_FIELDS]
    fields += [field(n, np.float32, trt.PluginFieldType.FLOAT32) for n in FLOAT_FIELDS]
    if attrs is None:
        fields += [trt.PluginField(n, np.array([], dtype=np.int8), trt.PluginFieldType.CHAR) for n in TEXT_FIELDS]
    return trt.PluginFieldCollection(fields), fields


def float_types(trt: ModuleType) -> dict:
    return {trt.float32: "fp32", trt.float16: "fp16", trt.bfloat16: "bf16"}


@functools.lru_cache(maxsize=None)
def plugin_classes(trt: ModuleType) -> tuple[type, type]:
    """(Plugin, Creator) deriving from this TensorRT module's IPluginV3 interfaces."""

    class AttentionPlugin(trt.IPluginV3, trt.IPluginV3OneCore, trt.IPluginV3OneBuild, trt.IPluginV3OneRuntime):
        def __init__(self, attrs: AttentionAttrs, phase=None):
            trt.IPluginV3.__init__(self)
            trt.IPluginV3OneCore.__init__(self)
            trt.IPluginV3OneBuild.__init__(self)
            trt.IPluginV3OneRuntime.__init__(self)
            self.plugin_name, self.plugin_version, self.plugin_namespace = PLUGIN_NAME, PLUGIN_VERSION, PLUGIN_NAMESPACE
            self.attrs = attrs
            self.phase = phase
            self.num_outputs = len(OUTPUTS[attrs.kind])
            self.launcher: cuda_launcher.KernelLauncher | None = None  # bound on first enqueue

        # -- core / serialization
        def get_capability_interface(self, capability_type):
            return self

        def clone(self):
            twin = AttentionPlugin(self.attrs, self.phase)
            twin.launcher = self.launcher
            return twin

        def get_fields_to_serialize(self):
            collection, self._serialized_fields = field_collection(trt, self.attrs)
            return collection

        # -- build
        def get_output_data_types(self, input_types):
            return [input_types[0]] * self.num_outputs

        def get_output_shapes(self, inputs, shape_inputs, expr_builder):
            query = trt.DimsExprs(inputs[0])  # (B, T, D)
            if self.attrs.kind is not AttentionKind.DECODER_SELF:
                return [query]
            present = trt.DimsExprs(inputs[3])  # past (B, H, P, Dh) -> present (B, H, P + T, Dh)
            present[2] = expr_builder.operation(trt.DimensionOperation.SUM, inputs[3][2], inputs[0][1])
            return [query, present, trt.DimsExprs(present)]

        def supports_format_combination(self, pos, in_out, num_inputs):
            desc = in_out[pos].desc
            if desc.format != trt.TensorFormat.LINEAR:
                return False
            names = input_names(self.attrs.kind, num_inputs > len(INPUTS[self.attrs.kind]))
            if num_inputs != len(names):
                return False  # an input count the op does not take: no format makes this node valid
            if pos < num_inputs and names[pos] == MASK_INPUT:
                return desc.type == trt.int32
            if pos == 0:
                return desc.type in float_types(trt)
            return desc.type == in_out[0].desc.type

        def configure_plugin(self, inputs, outputs):
            pass

        def get_workspace_size(self, inputs, outputs):
            return workspace_bytes(self.attrs, tuple(inputs[0].max)[0])  # for any batch up to the profile's largest

        def get_valid_tactics(self):
            return []

        # -- runtime
        def set_tactic(self, tactic):
            pass

        def on_shape_change(self, inputs, outputs):
            pass

        def attach_to_context(self, resource_context):
            return self.clone()

        def enqueue(self, input_desc, output_desc, inputs, outputs, workspace, stream):
            if self.launcher is None:
                self.launcher = cuda_launcher.default_launcher()
            call = cuda_launcher.AttentionCall(
                self.attrs, float_types(trt)[input_desc[0].type], tuple(tuple(d.dims) for d in input_desc),
                tuple(int(p) for p in inputs), tuple(int(p) for p in outputs), int(workspace), int(stream))
            self.launcher.launch(call)

    class AttentionPluginCreator(trt.IPluginCreatorV3One):
        def __init__(self):
            trt.IPluginCreatorV3One.__init__(self)
            self.name, self.plugin_version, self.plugin_namespace = PLUGIN_NAME, PLUGIN_VERSION, PLUGIN_NAMESPACE
            self.field_names, self._fields = field_collection(trt)

        def create_plugin(self, name, fields, phase):
            return AttentionPlugin(attrs_from_fields(fields), phase)

    return AttentionPlugin, AttentionPluginCreator


def register(trt: ModuleType):
    """Register the creator in `trt`'s plugin registry (idempotent) and return the registered creator."""
    registry = trt.get_plugin_registry()
    found = find_creator(trt)
    if found is not None:
        return found
    creator = plugin_classes(trt)[1]()
    if not registry.register_creator(creator, PLUGIN_NAMESPACE):
        raise RuntimeError(f"{trt.__name__} refused to register plugin {PLUGIN_NAMESPACE}::{PLUGIN_NAME} "
                           f"v{PLUGIN_VERSION}")
    _keep_alive.append(creator)  # the registry holds a raw pointer: the Python object must outlive it
    logger.debug("registered %s::%s v%s with %s", PLUGIN_NAMESPACE, PLUGIN_NAME, PLUGIN_VERSION, trt.__name__)
    return creator


def find_creator(trt: ModuleType):
    """The registered creator of our plugin, or None (scans, since `get_creator` logs an error on a miss)."""
    for creator in trt.get_plugin_registry().all_creators:
        if (creator.name, creator.plugin_version, creator.plugin_namespace) == \
                (PLUGIN_NAME, PLUGIN_VERSION, PLUGIN_NAMESPACE):
            return creator
    return None


_keep_alive: list = []
