"""Ahead-of-time compilation of the attention kernels (no GPU): artifacts, targets, entry points, the cache.

Compiles run in child processes — the module CLI, then `compile_all` — because an interpreter run
(TRITON_INTERPRET=1) in the same process would replace triton's compiler. The representative subset is every
kernel mode at head_dim 64 in all three dtypes for sm_80 and sm_90 (36 artifacts), plus the padded HEAD_DIM 16
(head_dim 8) for sm_90 and the largest tile, fp32 at 256, for sm_86; the full sweep (360) is
`python -m seq2trt.plugins.kernels.aot --out DIR`. Also here, without triton: the launch plan asks only for
variants that the compiler builds, and the plugin's launcher (`kernel_launch`) packs arguments as the compiled
kernels take them.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from seq2trt.plugins import cuda_launcher as kernel_launch
from seq2trt.plugins.kernels import aot
from seq2trt.plugins.kernels import launch_plan as launch
from seq2trt.plugins.op import AttentionAttrs, AttentionKind
from seq2trt.core.errors import InputError

TARGETS = ("sm_80", "sm_90")
SUBSET = ["--dtypes", "fp32,fp16,bf16", "--head-dims", "64"]


@pytest.fixture(scope="module")
def triton_cache(tmp_path_factory) -> str:
    """A fresh triton cache, so the first call really compiles and the second can only hit our own cache."""
    return str(tmp_path_factory.mktemp("triton-cache"))


def _env(triton_cache: str) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=triton_cache)
    env.pop("TRITON_INTERPRET", None)
    return env


def _cli(out: Path, env: dict, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "seq2trt.plugins.kernels.aot", "--out", str(out),
                           "--targets", ",".join(TARGETS), *SUBSET, *extra],
                          env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, triton_cache) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("kernels")
    proc = _cli(out, _env(triton_cache))
    if proc.returncode != 0:
        pytest.fail(f"aot CLI exited with {proc.returncode}:\n{proc.stderr[-4000:]}")
    return out, json.loads((out / "index.json").read_text())


def _subset_keys() -> set[tuple[str, str]]:
    return {(v.key, t) for v in aot.all_variants() if dict(v.constexprs)["HEAD_DIM"] == 64 for t in TARGETS}


def test_index_lists_every_requested_artifact(compiled):
    out, index = compiled
    assert {(e["key"], e["target"]) for e in index["kernels"]} == _subset_keys()
    assert not any(e["cached"] for e in index["kernels"])


def test_artifacts_target_their_architecture(compiled):
    out, index = compiled
    for e in index["kernels"]:
        ptx, cubin = (out / e["ptx"]).read_text(), (out / e["cubin"]).read_bytes()
        cc = aot.TARGETS[e["target"]]
        target = re.search(r"^\.target\s+(sm_\d+a?)", ptx, re.M).group(1)
        assert target in (f"sm_{cc}", f"sm_{cc}a"), (e["key"], target)
        major, minor = map(int, re.search(r"^\.version\s+(\d+)\.(\d+)", ptx, re.M).groups())
        assert 10 * major + minor <= 90, f"{e['key']}: PTX {major}.{minor} is newer than a CUDA 13.0 driver takes"
        assert cubin[:4] == b"\x7fELF" and aot.cubin_arch(cubin) == cc, e["key"]
        assert e["shared"] <= aot.MAX_SHARED[cc]


def test_cubin_arch_agrees_with_cuobjdump(compiled):
    triton = pytest.importorskip("triton")
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        pytest.skip(f"no cuobjdump at {cuobjdump}")
    out, index = compiled
    for target in TARGETS:
        e = next(e for e in index["kernels"] if e["target"] == target)
        header = subprocess.run([str(cuobjdump), "-elf", str(out / e["cubin"])], capture_output=True, text=True).stdout
        assert re.search(r"sm=(\d+)a?", header).group(1) == target[3:], header[:300]


def test_entry_points_and_parameters(compiled):
    out, index = compiled
    for e in index["kernels"]:
        ptx, cubin = (out / e["ptx"]).read_text(), (out / e["cubin"]).read_bytes()
        assert e["name"] == e["kernel"]
        params = re.search(rf"\.visible \.entry {e['name']}\((.*?)\)", ptx, re.S).group(1)
        assert params.count(".param") == len(launch.SIGNATURES[e["kernel"]]) + len(launch.SCRATCH_PARAMS)
        assert f".text.{e['name']}".encode() in cubin
        assert [p[0] for p in e["params"]] == [n for n, _ in launch.SIGNATURES[e["kernel"]]] + \
            list(launch.SCRATCH_PARAMS)
        assert e["global_scratch_size"] == 0 and e["profile_scratch_size"] == 0


def test_second_call_hits_the_cache_and_edits_miss_it(compiled, triton_cache):
    out, index = compiled
    changed = index["kernels"][0]
    (out / changed["cubin"]).write_bytes(b"tampered")  # a damaged artifact is rebuilt, the others are reused
    code = (f"import json, sys; from seq2trt.plugins.kernels import aot; "
            f"v = [v for v in aot.all_variants() if dict(v.constexprs)['HEAD_DIM'] == 64]; "
            f"print(json.dumps(aot.compile_all(sys.argv[1], {list(TARGETS)!r}, v, jobs=1)))")
    proc = subprocess.run([sys.executable, "-c", code, str(out)], env=_env(triton_cache), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    again = json.loads(proc.stdout.strip().splitlines()[-1])
    rebuilt = [(e["key"], e["target"]) for e in again["kernels"] if not e["cached"]]
    assert rebuilt == [(changed["key"], changed["target"])]
    assert (out / changed["cubin"]).read_bytes()[:4] == b"\x7fELF"


def test_cli_refuses_to_compile_under_the_interpreter(tmp_path, triton_cache):
    proc = _cli(tmp_path, dict(_env(triton_cache), TRITON_INTERPRET="1"), "--kernels", "kv_append")
    assert proc.returncode == 2 and "TRITON_INTERPRET" in proc.stderr


def test_unknown_target_is_refused():
    with pytest.raises(InputError, match="sm_70"):
        aot.parse_kernel_targets("sm_80,sm_70")


PLAN_HEAD_DIMS = (8, 16, 24, 40, 64, 96, 128, 200, 256)  # every compiled HEAD_DIM, exactly and masked


def _plans():
    """Every dtype x kind x head_dims reaching every compiled HEAD_DIM, with one and with several query tokens,
    with and without a workspace, the self-attention kinds with and without a position bias (M = 128 positions)."""
    for dtype in launch.DTYPES:
        for head_dim in PLAN_HEAD_DIMS:
            for kind in AttentionKind:
                attrs = AttentionAttrs(kind, 2, head_dim, 0.125)
                for T, L, ws in [(1, 100, 1 << 20), (1, 100, None), (9, 5, 1 << 20)]:
                    D = 2 * head_dim
                    shapes = {AttentionKind.ENCODER_SELF: [(3, T, D), (3, T, D), (3, T, D), (3, T)],
                              AttentionKind.CROSS: [(3, T, D), (3, 2, L, head_dim), (3, 2, L, head_dim), (3, L)],
                              AttentionKind.DECODER_SELF: [(3, T, D), (3, T, D), (3, T, D), (3, 2, L, head_dim),
                                                           (3, 2, L, head_dim)]}[kind]
                    for bias in ([], [(2, 255)]) if kind is not AttentionKind.CROSS else ([],):
                        ptrs = [4096 * (i + 1) for i in range(len(shapes + bias))]
                        yield attrs, dtype, shapes + bias, ptrs, ws


def test_launch_plan_uses_only_compiled_variants():
    compiled = {v.key for v in aot.all_variants()}
    used = {launch_.key for args in _plans() for launch_ in launch.plan(*args[:4], args[3][:3], args[4])}
    assert used <= compiled, sorted(used - compiled)
    assert used == compiled, f"variants no plan uses: {sorted(compiled - used)}"


def test_pack_orders_arguments_as_the_compiled_kernel():
    attrs = AttentionAttrs(AttentionKind.DECODER_SELF, 2, 64, 0.125)
    shapes = [(3, 1, 128), (3, 1, 128), (3, 1, 128), (3, 2, 40, 64), (3, 2, 40, 64)]
    plan = launch.plan(attrs, "fp16", shapes, [4096, 8192, 12288, 16384, 20480], [24576, 28672, 32768], 65536)
    assert [p.kernel for p in plan] == ["attn_decode_split", "attn_decode_reduce"]  # the step appends in the split
    packed = kernel_launch.pack(plan[0])
    assert len(packed.args) == len(launch.SIGNATURES["attn_decode_split"]) + 2
    # Q, past K/V, then the mask and bias slots (no mask, no bias: any valid pointer, the query's), new K/V, present
    assert [a.value for a in packed.args[:9]] == [4096, 16384, 20480, 4096, 4096, 8192, 12288, 28672, 32768]
    prefill = launch.plan(attrs, "fp16", [(3, 5, 128)] * 3 + shapes[3:], [4096 * i for i in range(1, 6)],
                          [24576, 28672, 32768], 65536)
    assert [p.kernel for p in prefill] == ["kv_append", "attn_fwd"]
    assert isinstance(packed.args[-4], ctypes.c_float) and packed.args[-4].value == pytest.approx(0.125)
    assert isinstance(packed.args[-3], ctypes.c_int32) and packed.args[-3].value == 64  # the model's head_dim
    assert packed.args[-1].value is None and packed.args[-2].value is None  # null scratch
    assert packed.grid[1:] == (6, 1)


def _values(packed) -> list:
    return [(p.kernel, p.grid, [(type(a).__name__, a.value) for a in p.args]) for p in packed]


def test_launch_plan_packs_what_plan_and_pack_give_for_any_pointers():
    """The plugin's enqueue packs from a template cached per shape signature; every call's own pointers go in."""
    rng = random.Random(0)
    for attrs, dtype, shapes, ptrs, ws in _plans():
        n_out = 3 if attrs.kind is AttentionKind.DECODER_SELF else 1
        for _ in range(2):  # the second call hits the cache with other buffers
            inputs = [16 * rng.randrange(1, 2**36) for _ in shapes]
            outputs = [16 * rng.randrange(1, 2**36) for _ in range(n_out)]
            workspace = 16 * rng.randrange(1, 2**36) if ws is not None else 0
            call = kernel_launch.AttentionCall(attrs, dtype, tuple(map(tuple, shapes)), tuple(inputs), tuple(outputs),
                                               workspace, 0)
            want = [kernel_launch.pack(x)
                    for x in launch.plan(attrs, dtype, shapes, inputs, outputs, workspace or None)]
            assert _values(kernel_launch.launch_plan(call)) == _values(want)


def test_launch_plan_refuses_misaligned_buffers_from_the_cache():
    attrs = AttentionAttrs(AttentionKind.CROSS, 2, 64, 0.125)
    shapes = ((1, 4, 128), (1, 2, 9, 64), (1, 2, 9, 64), (1, 9))
    call = kernel_launch.AttentionCall(attrs, "bf16", shapes, (4096, 8192, 12288, 16384), (20480,), 0, 0)
    kernel_launch.launch_plan(call)
    with pytest.raises(InputError, match="K=8200"):
        kernel_launch.launch_plan(dataclasses.replace(call, inputs=(4096, 8200, 12288, 16384)))


def test_pack_refuses_misaligned_buffers():
    attrs = AttentionAttrs(AttentionKind.CROSS, 2, 64, 0.125)
    shapes = [(1, 4, 128), (1, 2, 9, 64), (1, 2, 9, 64), (1, 9)]
    (fwd,) = launch.plan(attrs, "bf16", shapes, [4096, 8200, 12288, 16384], [20480])
    with pytest.raises(InputError, match="K=8200"):
        kernel_launch.pack(fwd)


def test_workspace_covers_the_largest_decode():
    attrs = AttentionAttrs(AttentionKind.CROSS, 8, 128, 0.1)
    plan = launch.plan(attrs, "fp32", [(4, 1, 1024), (4, 8, 6139, 128), (4, 8, 6139, 128), (4, 6139)],
                       [0] * 4, [0], workspace=0, num_splits=launch.MAX_SPLITS)
    end = max(int(v) for p in plan for n, v in p.args.items() if n.startswith("Mid"))
    splits = plan[0].args["num_splits"]
    assert splits == launch.MAX_SPLITS and end + 4 * 4 * 8 * splits <= launch.workspace_bytes(attrs, 4)



def test_index_path_follows_the_kernel_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("SEQ2TRT_KERNEL_DIR", str(tmp_path))
    assert aot.index_path() == tmp_path / "index.json"
    assert aot.index_path(tmp_path / "elsewhere") == tmp_path / "elsewhere" / "index.json"


def test_planning_does_not_import_triton():
    """The plugin sizes and plans launches where triton may be absent (TensorRT builders, the engine runtime)."""
    code = ("import sys; from seq2trt.plugins import cuda_launcher as kernel_launch, tensorrt_plugin; "
            "from seq2trt.plugins.kernels import aot, launch_plan; "
            "assert kernel_launch.launch_plan and 'triton' not in sys.modules, "
            "sorted(m for m in sys.modules if 'triton' in m)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_head_dims_are_the_multiples_of_8_up_to_256():
    assert launch.HEAD_DIMS == tuple(range(8, 257, 8))
    assert [launch.kernel_head_dim(d) for d in (8, 16, 24, 40, 64, 72, 128, 136, 256)] == \
        [16, 16, 32, 64, 64, 128, 128, 256, 256]
    for head_dim in (12, 264):
        attrs = AttentionAttrs(AttentionKind.CROSS, 2, head_dim, 0.1)
        shapes = [(1, 1, 2 * head_dim), (1, 2, 9, head_dim), (1, 2, 9, head_dim), (1, 9)]
        with pytest.raises(InputError, match=f"multiple of 8 up to 256, got {head_dim}"):
            launch.plan(attrs, "fp16", shapes, [4096] * 4, [8192])
        assert f"this model's is {head_dim}" in launch.kernel_head_dim_problem(head_dim, "out")


def test_masked_head_dim_passes_its_own_size_to_the_wider_kernel():
    attrs = AttentionAttrs(AttentionKind.DECODER_SELF, 3, 40, 0.125)
    shapes = [(2, 1, 120), (2, 1, 120), (2, 1, 120), (2, 3, 7, 40), (2, 3, 7, 40)]
    split, reduce = launch.plan(attrs, "bf16", shapes, [4096 * i for i in range(1, 6)], [40960, 45056, 49152], 65536)
    for step in (split, reduce):
        assert step.constexprs["HEAD_DIM"] == 64 and step.args["head_dim"] == 40
    assert (split.args["stride_qh"], split.args["stride_kl"], split.args["stride_rh"]) == (40, 40, 8 * 40)
    assert reduce.args["MidM"] == 65536 + 4 * 2 * 3 * split.args["num_splits"] * 40  # partials of 40, not 64


def test_pack_refuses_a_stride_the_kernels_do_not_assume():
    attrs = AttentionAttrs(AttentionKind.CROSS, 2, 64, 0.125)
    shapes = [(1, 4, 128), (1, 2, 9, 64), (1, 2, 9, 64), (1, 9)]
    (fwd,) = launch.plan(attrs, "fp16", shapes, [4096, 8192, 12288, 16384], [20480])
    with pytest.raises(InputError, match="stride_kl=12 is not a multiple of 8"):
        kernel_launch.pack(dataclasses.replace(fwd, args={**fwd.args, "stride_kl": 12}))


PADDED_CODE = """
import json, sys
from seq2trt.plugins.kernels import aot
variants = [v for v in aot.all_variants() if v.dtype == "fp16" and dict(v.constexprs)["HEAD_DIM"] == 16]
widest = [v for v in aot.all_variants() if v.dtype == "fp32" and v.kernel == "attn_fwd"
          and dict(v.constexprs)["HEAD_DIM"] == 256 and dict(v.constexprs)["HAS_MASK"] == 1]
index = aot.compile_all(sys.argv[1] + "/sm_90", ["sm_90"], variants, jobs=2)
index["kernels"] += aot.compile_all(sys.argv[1] + "/sm_86", ["sm_86"], widest, jobs=1)["kernels"]
print(json.dumps(index))
"""


def test_padded_head_dims_compile(tmp_path, triton_cache):
    """HEAD_DIM 16 (what head_dim 8 runs) for sm_90, and the fp32 HEAD_DIM 256 tile within sm_86's shared memory."""
    proc = subprocess.run([sys.executable, "-c", PADDED_CODE, str(tmp_path)], env=_env(triton_cache),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    entries = json.loads(proc.stdout.strip().splitlines()[-1])["kernels"]
    assert {e["kernel"] for e in entries if e["target"] == "sm_90"} == set(launch.SIGNATURES)
    planned = {x.key for kind in AttentionKind for T in (1, 5)
               for x in launch.plan(AttentionAttrs(kind, 2, 8, 0.3), "fp16",
                                    [(1, T, 16)] * 3 + ([(1, 2, 4, 8)] * 2 if kind is AttentionKind.DECODER_SELF
                                                        else [(1, 4)]), [4096] * 5, [8192] * 3, 16384)}
    assert planned <= {e["key"] for e in entries}
    for e in entries:
        folder = tmp_path / e["target"]
        ptx = (folder / e["ptx"]).read_text()
        assert e["constexprs"]["HEAD_DIM"] in (16, 256) and e["divisibility"]["head_dim"] == 8
        assert re.search(r"^\.target\s+sm_(\d+)", ptx, re.M).group(1) == e["target"][3:]
        assert aot.cubin_arch((folder / e["cubin"]).read_bytes()) == aot.TARGETS[e["target"]]
        assert e["shared"] <= aot.MAX_SHARED[aot.TARGETS[e["target"]]]
        assert [p[0] for p in e["params"]][:len(launch.SIGNATURES[e["kernel"]])] == \
            [n for n, _ in launch.SIGNATURES[e["kernel"]]]
