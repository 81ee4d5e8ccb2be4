"""The attention plugin's TensorRT registration (TensorRT-RTX on CPU) and the flavour compatibility module.

References are independent of the plugin code: field values come from `AttentionAttrs.onnx_attributes()` as the
ONNX parser passes them, and output shapes from `op.output_shapes` on concrete sizes.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
from onnx import TensorProto, helper

from seq2trt.exporters.tensorrt import trt_compat
from seq2trt.plugins.op import (DOMAIN, INPUTS, OUTPUTS, PLUGIN_NAME, PLUGIN_NAMESPACE, PLUGIN_VERSION,
                                AttentionAttrs, AttentionKind, output_shapes)
from seq2trt.core.errors import ArtifactError, DependencyError, InputError

from helpers.faults import permission_denied, raising

HAS_RTX = importlib.util.find_spec("tensorrt_rtx") is not None
needs_rtx = pytest.mark.skipif(not HAS_RTX, reason="tensorrt_rtx is not installed (pip install 'seq2trt[rtx]')")

ONNX_TYPES = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}


@pytest.fixture(scope="module")
def trt():
    import tensorrt_rtx

    from seq2trt.plugins import tensorrt_plugin

    trt_compat.ensure_rtx_parser_library()
    tensorrt_plugin.register(tensorrt_rtx)
    return tensorrt_rtx


def parser_fields(trt, attrs: AttentionAttrs):
    """Fields as TensorRT's ONNX parser builds them from node attributes (ints int32, floats float32,
    strings NUL-terminated chars)."""
    fields = []
    for name, value in attrs.onnx_attributes().items():
        if isinstance(value, str):
            data, ftype = np.array(list(value.encode() + b"\0"), dtype=np.int8), trt.PluginFieldType.CHAR
        elif isinstance(value, float):
            data, ftype = np.array([value], dtype=np.float32), trt.PluginFieldType.FLOAT32
        else:
            data, ftype = np.array([value], dtype=np.int32), trt.PluginFieldType.INT32
        fields.append(trt.PluginField(name, data, ftype))
    return trt.PluginFieldCollection(fields), fields  # the collection does not keep its fields alive


# --- registration ----------------------------------------------------------------------------------------------

@needs_rtx
def test_creator_is_found_by_name_version_namespace(trt):
    creator = trt.get_plugin_registry().get_creator(PLUGIN_NAME, PLUGIN_VERSION, PLUGIN_NAMESPACE)
    assert creator is not None
    assert (creator.name, creator.plugin_version, creator.plugin_namespace) == \
        (PLUGIN_NAME, PLUGIN_VERSION, PLUGIN_NAMESPACE)
    assert {f.name for f in creator.field_names} >= {"kind", "num_heads", "head_dim", "scale"}


@needs_rtx
def test_register_is_idempotent(trt):
    from seq2trt.plugins import tensorrt_plugin

    tensorrt_plugin.register(trt)
    matches = [c for c in trt.get_plugin_registry().all_creators
               if (c.name, c.plugin_version, c.plugin_namespace) == (PLUGIN_NAME, PLUGIN_VERSION, PLUGIN_NAMESPACE)]
    assert len(matches) == 1


@needs_rtx
@pytest.mark.parametrize("kind", list(AttentionKind))
def test_fields_round_trip(trt, kind):
    from seq2trt.plugins import tensorrt_plugin

    attrs = AttentionAttrs(kind, 8, 64, 0.125)
    creator = tensorrt_plugin.plugin_classes(trt)[1]()
    fields, _alive = parser_fields(trt, attrs)
    plugin = creator.create_plugin("attn", fields, trt.TensorRTPhase.BUILD)
    assert plugin.attrs == attrs
    assert plugin.num_outputs == len(OUTPUTS[kind])
    assert (plugin.plugin_name, plugin.plugin_version, plugin.plugin_namespace) == \
        (PLUGIN_NAME, PLUGIN_VERSION, PLUGIN_NAMESPACE)
    serialized = {f.name: np.asarray(f.data).reshape(-1)[0].item() for f in plugin.get_fields_to_serialize()}
    assert AttentionAttrs.from_onnx(serialized) == attrs
    runtime = creator.create_plugin("attn", plugin.get_fields_to_serialize(), trt.TensorRTPhase.RUNTIME)
    assert runtime.attrs == attrs and runtime.clone().attrs == attrs


@needs_rtx
def test_fields_refuse_wrong_version_and_missing_attributes(trt):
    from seq2trt.plugins import tensorrt_plugin

    wrong = [trt.PluginField("plugin_version", np.array(list(b"2\0"), dtype=np.int8), trt.PluginFieldType.CHAR)]
    with pytest.raises(InputError, match="plugin_version"):
        tensorrt_plugin.attrs_from_fields(wrong)
    partial = [trt.PluginField("kind", np.array([0], dtype=np.int32), trt.PluginFieldType.INT32)]
    with pytest.raises(InputError, match="num_heads"):
        tensorrt_plugin.attrs_from_fields(partial)


@pytest.mark.parametrize("head_dim,ok", [(8, True), (40, True), (256, True), (12, False), (264, False)])
def test_fields_refuse_a_head_dim_the_kernels_do_not_take(head_dim, ok):
    """Checked when the parser creates the plugin; plain objects stand in for PluginFields (no TensorRT needed)."""
    from types import SimpleNamespace

    from seq2trt.plugins import tensorrt_plugin

    attrs = AttentionAttrs(AttentionKind.CROSS, 2, head_dim, head_dim ** -0.5)
    fields = [SimpleNamespace(name=n, data=np.array(list(v.encode() + b"\0"), np.int8) if isinstance(v, str)
                              else np.array([v], np.float32 if isinstance(v, float) else np.int32))
              for n, v in attrs.onnx_attributes().items()]
    if ok:
        assert tensorrt_plugin.attrs_from_fields(fields).head_dim == head_dim
    else:
        with pytest.raises(InputError, match=f"multiple of 8 up to 256; this model's is {head_dim}.*--no-plugin"):
            tensorrt_plugin.attrs_from_fields(fields)


# --- shapes and types through TensorRT's parser --------------------------------------------------------------

def concrete_graph(kind: AttentionKind, dtype: str, B: int, T: int, S: int, P: int, mask_type=TensorProto.INT32):
    H, Dh = 2, 32
    new = [B, S if kind is AttentionKind.ENCODER_SELF else T, H * Dh]
    shapes = {"query": new, "key": new, "value": new, "key_padding_mask": [B, S],
              "past_key": [B, H, P, Dh], "past_value": [B, H, P, Dh],
              "cross_key": [B, H, S, Dh], "cross_value": [B, H, S, Dh]}
    attrs = AttentionAttrs(kind, H, Dh, Dh ** -0.5)
    inputs = [helper.make_tensor_value_info(n, mask_type if n == "key_padding_mask" else ONNX_TYPES[dtype], shapes[n])
              for n in INPUTS[kind]]
    outputs = [helper.make_tensor_value_info(n, ONNX_TYPES[dtype], None) for n in OUTPUTS[kind]]
    node = helper.make_node(PLUGIN_NAME, list(INPUTS[kind]), list(OUTPUTS[kind]), domain=DOMAIN,
                            **attrs.onnx_attributes())
    model = helper.make_model(helper.make_graph([node], "g", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])
    return model, attrs, [tuple(shapes[n]) for n in INPUTS[kind]]


def parse_network(trt, model):
    builder = trt.Builder(trt.Logger(trt.Logger.ERROR))
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, builder.logger)
    ok = parser.parse(model.SerializeToString())
    return ok, network, [str(parser.get_error(i).desc()) for i in range(parser.num_errors)], (builder, parser)


@needs_rtx
@pytest.mark.parametrize("kind", list(AttentionKind))
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("past_len", [0, 5])
def test_output_shapes_and_types(trt, kind, dtype, past_len):
    model, attrs, in_shapes = concrete_graph(kind, dtype, B=3, T=4, S=7, P=past_len)
    ok, network, errors, _keep = parse_network(trt, model)
    assert ok, errors
    expected = output_shapes(attrs, in_shapes)
    got = [tuple(network.get_output(i).shape) for i in range(network.num_outputs)]
    assert got == [tuple(s) for s in expected]
    wanted_type = {"fp32": trt.DataType.FLOAT, "fp16": trt.DataType.HALF, "bf16": trt.DataType.BF16}[dtype]
    assert [network.get_output(i).dtype for i in range(network.num_outputs)] == [wanted_type] * len(expected)


@needs_rtx
def test_int64_mask_is_not_a_supported_format(trt):
    """supports_format_combination takes an int32 mask only: an int64 mask cannot build."""
    model, _, _ = concrete_graph(AttentionKind.CROSS, "fp16", 2, 3, 5, 0, mask_type=TensorProto.INT64)
    ok, network, errors, (builder, _parser) = parse_network(trt, model)
    assert ok, errors
    config = builder.create_builder_config()
    trt_compat.set_targets(trt, "tensorrt-rtx", config, (86,))
    assert builder.build_serialized_network(network, config) is None


# --- trt_compat --------------------------------------------------------------------------------------------------

def test_parse_targets():
    assert trt_compat.parse_targets("tensorrt-rtx", "sm_89, sm_86,sm_86") == (86, 89)
    assert trt_compat.parse_targets("tensorrt-rtx", "current") == ("current",)
    assert trt_compat.parse_targets("tensorrt", "current") == ("current",)
    assert trt_compat.target_tag((86, 89)) == "sm_86+sm_89"
    with pytest.raises(InputError, match="sm_90.*--backend tensorrt"):
        trt_compat.parse_targets("tensorrt-rtx", "sm_90")
    with pytest.raises(InputError, match="current"):
        trt_compat.parse_targets("tensorrt", "sm_86")
    with pytest.raises(InputError, match="form sm_86"):
        trt_compat.parse_targets("tensorrt-rtx", "ampere")
    with pytest.raises(InputError, match="unknown TensorRT backend"):
        trt_compat.flavour_of("tensorrt-lite")


def test_missing_flavour_names_the_extra(monkeypatch):
    monkeypatch.setitem(trt_compat.FLAVOURS, trt_compat.Flavour.TENSORRT, trt_compat.FlavourInfo(
        "seq2trt_no_such_module", "trt", "tensorrt-cu13", (), True, False))
    with pytest.raises(DependencyError, match=r"pip install 'seq2trt\[trt\]'"):
        trt_compat.load("tensorrt")


def test_parser_library_link_is_created_once(tmp_path, monkeypatch):
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    (tmp_path / "libtensorrt_rtx.so.1").write_bytes(b"\x7fELF")
    link = trt_compat.ensure_rtx_parser_library(tmp_path)
    assert link.is_symlink() and os.readlink(link) == "libtensorrt_rtx.so.1"
    assert trt_compat.ensure_rtx_parser_library(tmp_path) == link  # idempotent
    assert sorted(p.name for p in tmp_path.iterdir()) == ["libtensorrt_rtx.so", "libtensorrt_rtx.so.1"]


def test_parser_library_read_only_dir_message_without_root(tmp_path, monkeypatch):
    """The same failure, simulated so it also runs as root."""
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    (tmp_path / "libtensorrt_rtx.so.1").write_bytes(b"\x7fELF")
    monkeypatch.setattr(type(tmp_path), "symlink_to", raising(permission_denied()))
    with pytest.raises(DependencyError, match="could not create it.*LD_LIBRARY_PATH"):
        trt_compat.ensure_rtx_parser_library(tmp_path)
    assert not (tmp_path / "libtensorrt_rtx.so").exists()


def test_parser_library_on_ld_library_path_is_honoured(tmp_path, monkeypatch):
    lib, elsewhere = tmp_path / "wheel", tmp_path / "mine"
    lib.mkdir(), elsewhere.mkdir()
    (lib / "libtensorrt_rtx.so.1").write_bytes(b"")
    (elsewhere / "libtensorrt_rtx.so").write_bytes(b"")
    monkeypatch.setenv("LD_LIBRARY_PATH", str(elsewhere))
    assert trt_compat.ensure_rtx_parser_library(lib) == elsewhere / "libtensorrt_rtx.so"
    assert not (lib / "libtensorrt_rtx.so").exists()


def test_check_engine():
    info = {"flavour": "tensorrt-rtx", "tensorrt_version": "1.7.1.116", "targets": [86, 89]}
    trt_compat.check_engine(info, "tensorrt-rtx", "1.7.0.5", 89)
    with pytest.raises(ArtifactError, match="sm_80.*--target sm_80"):
        trt_compat.check_engine(info, "tensorrt-rtx", "1.7.1.116", 80)
    with pytest.raises(ArtifactError, match="1.8.0"):
        trt_compat.check_engine(info, "tensorrt-rtx", "1.8.0", 86)
    with pytest.raises(ArtifactError, match="built by tensorrt-rtx"):
        trt_compat.check_engine(info, "tensorrt", "1.7.1.116", 86)
    with pytest.raises(ArtifactError, match="--target current"):
        trt_compat.check_engine(info, "tensorrt-rtx", "1.7.1.116", 90)
    enterprise = {"flavour": "tensorrt", "tensorrt_version": "10.13.2.6", "targets": ["current"],
                  "compute_capabilities": [90]}
    trt_compat.check_engine(enterprise, "tensorrt", "10.13.2.6", 90)
    with pytest.raises(ArtifactError, match="10.13.3"):
        trt_compat.check_engine(enterprise, "tensorrt", "10.13.3.1", 90)
    with pytest.raises(ArtifactError, match="sm_86"):
        trt_compat.check_engine(enterprise, "tensorrt", "10.13.2.6", 86)


# --- enqueue: the plugin -> launcher -> CUDA driver path, with the driver faked (no GPU here) --------------------

class FakeDriver:
    """Records cuLaunchKernel calls; reads the kernel parameters back through the pointer array."""

    class CUfunction_attribute:
        CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8

    def __init__(self, param_types):
        self.loaded, self.launches, self.attributes = [], [], []
        self.param_types = list(param_types)  # ctypes types of each launch's parameters, in launch order

    def CUstream(self, handle):
        return ("stream", handle)

    def cuModuleLoadData(self, data):
        self.loaded.append(data)
        return 0, f"module{len(self.loaded)}"

    def cuModuleGetFunction(self, module, name):
        return 0, (module, name)

    def cuFuncSetAttribute(self, function, attribute, value):
        self.attributes.append((function, attribute, value))
        return (0,)

    def cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        import ctypes

        pointers = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        types = self.param_types[len(self.launches)]
        values = [ctypes.cast(pointers[i], ctypes.POINTER(t)).contents.value for i, t in enumerate(types)]
        self.launches.append({"function": function, "grid": (gx, gy, gz), "block": (bx, by, bz), "shared": shared,
                              "stream": stream, "values": values})
        return (0,)


def fake_index(tmp_path, keys, shared=1024):
    import json

    entries = []
    for key in keys:
        for target in ("sm_80", "sm_86", "sm_90"):
            (tmp_path / target).mkdir(exist_ok=True)
            (tmp_path / target / f"{key}.ptx").write_text(f"// {key} {target}")
            (tmp_path / target / f"{key}.cubin").write_bytes(f"CUBIN {key} {target}".encode())
            entries.append({"key": key, "name": f"{key.split('-')[0]}_entry", "target": target,
                            "ptx": f"{target}/{key}.ptx", "cubin": f"{target}/{key}.cubin", "num_warps": 4,
                            "shared": shared, "global_scratch_size": 0})
    (tmp_path / "index.json").write_text(json.dumps({"kernels": entries}))
    return tmp_path / "index.json"


def test_read_index_prefers_exact_cubin_then_older_ptx(tmp_path):
    from seq2trt.plugins.kernels.aot import read_index

    index = fake_index(tmp_path, ["k1"])
    assert read_index(index, 86)["k1"].image == tmp_path / "sm_86" / "k1.cubin"
    assert read_index(index, 89)["k1"].image == tmp_path / "sm_86" / "k1.ptx"  # never sm_90's PTX on sm_89
    assert read_index(index, 75) == {}


@needs_rtx
@pytest.mark.parametrize("kind", list(AttentionKind))
def test_enqueue_launches_the_planned_kernels(trt, tmp_path, kind):
    """enqueue -> AttentionCall -> kernel_launch.launch_plan -> cuLaunchKernel with the packed arguments."""
    from seq2trt.plugins import tensorrt_plugin
    from seq2trt.plugins import cuda_launcher as kernel_launch
    from seq2trt.plugins.kernels import aot

    attrs = AttentionAttrs(kind, 2, 32, 32 ** -0.5)
    B, T, S, P = 2, 1, 5, 3
    shapes = {"query": (B, T, 64), "key": (B, T, 64), "value": (B, T, 64), "key_padding_mask": (B, S),
              "past_key": (B, 2, P, 32), "past_value": (B, 2, P, 32),
              "cross_key": (B, 2, S, 32), "cross_value": (B, 2, S, 32)}
    if kind is AttentionKind.ENCODER_SELF:
        shapes.update(query=(B, S, 64), key=(B, S, 64), value=(B, S, 64))
    in_shapes = [shapes[n] for n in INPUTS[kind]]
    inputs = [0x10000 * (i + 1) for i in range(len(in_shapes))]
    outputs = [0x100000 * (i + 1) for i in range(len(OUTPUTS[kind]))]
    workspace, stream = 0x7000000, 0x1234
    expected = kernel_launch.launch_plan(kernel_launch.AttentionCall(attrs, "fp16", tuple(in_shapes), tuple(inputs),
                                                              tuple(outputs), workspace, stream))

    driver = FakeDriver([[type(a) for a in e.args] for e in expected])
    launcher = kernel_launch.CudaDriverLauncher.__new__(kernel_launch.CudaDriverLauncher)
    launcher.images = aot.read_index(fake_index(tmp_path, {e.kernel for e in expected}, 64 * 1024), 86)
    launcher.plan, launcher.cuda, launcher._functions, launcher._modules = kernel_launch.launch_plan, driver, {}, []

    def desc(shape, dtype):
        d = trt.PluginTensorDesc()
        d.dims, d.type = trt.Dims(shape), dtype
        return d

    plugin = tensorrt_plugin.plugin_classes(trt)[0](attrs)
    plugin.launcher = launcher
    in_desc = [desc(s, trt.int32 if n == "key_padding_mask" else trt.float16) for n, s in zip(INPUTS[kind], in_shapes)]
    out_desc = [desc(s, trt.float16) for s in output_shapes(attrs, in_shapes)]
    plugin.enqueue(in_desc, out_desc, inputs, outputs, workspace, stream)

    # Written from the kernels' contract, not from launch_plan (which the plugin calls, so it cannot judge itself):
    # which kernels, how many programs, which tensors in which order, the scale.
    families = {AttentionKind.ENCODER_SELF: ["attn_fwd"], AttentionKind.DECODER_SELF: ["attn_decode_split",
                                                                                         "attn_decode_reduce"],
                AttentionKind.CROSS: ["attn_decode_split", "attn_decode_reduce"]}[kind]
    assert [e.kernel.split("-")[0] for e in expected] == families
    assert all("-fp16-" in e.kernel and "HEAD_DIM32" in e.kernel for e in expected)
    main = expected[0]
    flags = {AttentionKind.ENCODER_SELF: ("HAS_MASK1", "IS_CAUSAL0"), AttentionKind.DECODER_SELF: ("APPEND1", "HAS_MASK0"),
             AttentionKind.CROSS: ("APPEND0", "HAS_MASK1")}[kind]
    assert all(f in main.kernel for f in flags), main.kernel
    queries = in_shapes[0][1]
    assert main.grid[1] == B * attrs.num_heads  # one program row per (batch, head)
    if kind is AttentionKind.ENCODER_SELF:
        assert main.grid[0] * 64 >= queries  # BLOCK_M 64 query rows per program cover every query
    else:
        assert expected[1].grid[0] == B * attrs.num_heads * queries  # the reduce: one program per query row
    pointers = [a.value for a in main.args if type(a).__name__ == "c_void_p" and a.value is not None]
    order = {AttentionKind.ENCODER_SELF: ["query", "key", "value", "key_padding_mask"],  # the kernels' signatures
             AttentionKind.DECODER_SELF: ["query", "past_key", "past_value", "query", "query", "key", "value"],
             # no mask, no position bias: their slots hold any valid pointer (the query's)
             AttentionKind.CROSS: ["query", "cross_key", "cross_value", "key_padding_mask"]}[kind]
    by_name = dict(zip(INPUTS[kind], inputs))
    assert pointers[:len(order)] == [by_name[n] for n in order]
    assert outputs[0] in [a.value for e in expected for a in e.args]
    assert [a.value for a in main.args if type(a).__name__ == "c_float"] == [pytest.approx(32 ** -0.5, rel=1e-7)]
    ints = [a.value for a in main.args if type(a).__name__ == "c_int"]
    # query strides of (B, T, heads * head_dim): batch T*64, then token 64 and head 32 (the decode kernels take one
    # query token: batch and head only)
    assert ints[:3] == ([queries * 64, 64, 32] if kind is AttentionKind.ENCODER_SELF else [queries * 64, 32, ints[2]])

    assert len(driver.launches) == len(expected) > 0
    for got, want in zip(driver.launches, expected):
        assert got["function"][1] == launcher.images[want.kernel].function.encode()
        assert got["grid"] == want.grid and got["block"] == (128, 1, 1) and got["shared"] == 64 * 1024
        assert got["stream"] == ("stream", stream)
        assert got["values"] == [a.value for a in want.args]
    touched = {v for got in driver.launches for v in got["values"]}
    assert set(inputs) - touched == set() and set(outputs) - touched == set()  # every tensor reaches a kernel
    assert (workspace in touched) == (in_shapes[0][1] == 1)  # one query token: flash-decoding uses the workspace
    assert {a[2] for a in driver.attributes} == {64 * 1024}  # > 48 KiB shared memory was opted into
    assert len(driver.loaded) == len({e.kernel for e in expected})  # each module loaded once
