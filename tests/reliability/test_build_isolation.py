"""Damaged graphs that used to escape as a crash: TensorRT's build runs in a child process, so a graph that makes
TensorRT-RTX abort natively is one BuildError (exit 2, nothing written), and Ctrl-C / SIGTERM stop the child; graph
files whose bytes still parse but break the contract stop `validate` with one ArtifactError line (exit 2).

The artifact is built here (a tiny export, fused for TensorRT, no engines and no reports), not taken from this
folder's conftest, whose artifact holds both: these tests check that nothing of them is written. The TensorRT
reproducer was found by the graph fuzz: the fused encoder's Cast of attention_mask to int32, made a Cast to int64,
still parses and passes `load_graph`, and TensorRT-RTX 1.7 then aborts its process while building
(`malloc_consolidate(): invalid chunk size`; the fuzz found Shape start/end damage doing the same).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import onnx
import pytest

from seq2trt.exporters import spec
from seq2trt.exporters.fuse import Target, fused_dir
from seq2trt.exporters.manifest import read_manifest
from seq2trt.core.errors import Terminated

from helpers.artifacts import checkpoint_and_export, numbers_model
from helpers.cli import invoke


@pytest.fixture(scope="module")
def artifact(make_model, tmp_path_factory) -> Path:
    """A tiny checkpoint of the numbers task, its export (num_heads 1: a head_dim of 32, which the plugin takes) and
    the export fused for TensorRT."""
    model, task = numbers_model(make_model, seed=3, max_src_len=16, max_tgt_len=16, num_heads=1)
    return checkpoint_and_export(tmp_path_factory.mktemp("isolation"), model, task, max_batch=4, fuse=("trt",),
                                 record_task=True)[1]


@pytest.fixture
def out(artifact, tmp_path) -> Path:
    shutil.copytree(artifact, tmp_path / "out")  # the manifest names the module's checkpoint, read only
    return tmp_path / "out"


@pytest.fixture
def rehash(rewrite_manifest, fuzz):
    """Records resealed over damaged graphs (as a writer that knows the formats would), so that only the graphs'
    content is wrong and the damage reaches the stages behind the sha256 checks."""
    def reseal(out: Path) -> None:
        rewrite_manifest(out)
        fuzz.rehash_fusion(out, Target.TRT)

    return reseal


# --- TensorRT in a child process ---------------------------------------------------------------------------------

@pytest.mark.rtx
def test_graph_that_aborts_tensorrt_is_one_build_error(out, rehash, one_error_line):
    encoder = fused_dir(out, Target.TRT) / "encoder.onnx"
    model = onnx.load(encoder)
    cast = next(n for n in model.graph.node if n.op_type == "Cast" and list(n.input) == ["attention_mask"])
    to = next(a for a in cast.attribute if a.name == "to")
    assert to.i == onnx.TensorProto.INT32
    to.i = onnx.TensorProto.INT64
    onnx.save(model, encoder)
    rehash(out)
    result = invoke("build", out, "--target", "sm_86")
    one_error_line(result, 2, "crashed on", str(encoder), "SIGABRT", "exit code 134", "re-export")
    engines = out / "engines"
    assert not engines.exists() or [p.name for p in engines.iterdir() if not p.name.endswith(".lock")] == []


@pytest.mark.rtx
def test_child_that_dies_is_a_build_error_and_the_next_child_builds(out, monkeypatch):
    """Any death of the child (here: an abort as it starts) is a BuildError; a later build starts a new child."""
    from seq2trt.exporters.tensorrt import child as tensorrt_child
    from seq2trt.exporters.tensorrt.engines import EngineRequest, build_engines

    entry = tensorrt_child._ENTRY
    monkeypatch.setattr(tensorrt_child, "_ENTRY", "import os; os.abort()")
    with pytest.raises(tensorrt_child.BuildError, match=r"encoder\.onnx \(killed by SIGABRT, exit code 134\)"):
        build_engines(out, EngineRequest("tensorrt-rtx", (86,)))
    assert not (out / "engines" / "tensorrt-rtx-sm_86-fp32").exists()
    monkeypatch.setattr(tensorrt_child, "_ENTRY", entry)
    engine_dir = build_engines(out, EngineRequest("tensorrt-rtx", (86,)))
    assert sorted(p.name for p in engine_dir.iterdir()) == ["build.json", "decoder.plan", "encoder.plan"]


@pytest.mark.rtx
@pytest.mark.parametrize("signum, raised", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, Terminated)])
def test_interrupt_kills_the_child_at_once(out, signum, raised):
    from seq2trt.exporters.tensorrt.build import build
    from seq2trt.exporters.tensorrt.child import BuildChild

    m = read_manifest(out)
    graph = fused_dir(out, Target.TRT) / "decoder.onnx"
    pids = []

    def interrupt():  # once the child runs (its start alone takes about a second)
        while child.pid is None:
            time.sleep(0.01)
        pids.append(child.pid)
        os.kill(os.getpid(), signum)

    with BuildChild() as child:
        threading.Thread(target=interrupt, daemon=True).start()
        start = time.perf_counter()
        with pytest.raises(raised):
            build(graph, spec.profiles(m.config, m.limits)[spec.GraphKind.DECODER], (86,), child=child)
        assert time.perf_counter() - start < 30
        assert child.pid is None
    with pytest.raises(ProcessLookupError):  # killed and reaped, not left running
        os.kill(pids[0], 0)


# --- graph files that break the contract reach validate ----------------------------------------------------------

def _flip_in_text(data: bytes, text: bytes) -> bytes:
    """`data` with the top bit of the first byte of `text`'s first occurrence set: no longer valid UTF-8."""
    at = data.index(text)
    return data[:at] + bytes([data[at] | 0x80]) + data[at + 1:]


def _fixed_batch(data: bytes) -> bytes:
    model = onnx.load_from_string(data)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 3  # the batch axis fixed: the contract's varies
    return model.SerializeToString()


def _short_embedding(data: bytes) -> bytes:
    """The token embedding cut to 3 rows: the graph loads (shapes still agree) and fails as it runs on a token id
    the contract allows (its vocabulary has more)."""
    from onnx import numpy_helper

    model = onnx.load_from_string(data)
    gather = next(n for n in model.graph.node if n.op_type == "Gather" and "input_ids" in n.input)
    table = next(i for i in model.graph.initializer if i.name == gather.input[0])
    table.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(table)[:3].copy(), table.name))
    return model.SerializeToString()


# damage -> (what it does to decoder.onnx's bytes, what the error names)
DAMAGE = {
    # the fuzz's find (run seed 3779825379, case 0:4): a flipped byte inside a node's name-scope metadata, which
    # localisation read as bytes and failed on with a TypeError
    "metadata-text": (lambda data: _flip_in_text(data, b"model.decoder_layers"), "metadata_props"),
    "node-name": (lambda data: _flip_in_text(data, b"node_MatMul"), "].name is not valid UTF-8"),
    "fixed-batch": (_fixed_batch, "input_ids has 3 for batch"),
    "short-embedding": (_short_embedding, "ONNX Runtime failed to run"),
}


def test_undamaged_export_validates(out):
    """The control: the same export and command pass, so each refusal below is the damage's doing."""
    result = invoke("validate", out, "--samples", "0", "--localize-budget", "1")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_graph_is_one_error_from_validate(out, damage, rehash, one_error_line):
    change, named = DAMAGE[damage]
    decoder = out / "decoder.onnx"
    decoder.write_bytes(change(decoder.read_bytes()))
    rehash(out)
    result = invoke("validate", out, "--samples", "0", "--localize-budget", "1")
    one_error_line(result, 2, str(decoder), named, "re-export")
    assert not (out / "reports" / "parity.json").exists()


def test_the_build_child_imports_no_torch():
    """What TensorRT's build child imports (the build path and the plugin's definitions) must not import torch: it
    cost every build call 1.2 s of the child's 1.7 s start, for tensors the child never makes."""
    code = ("import sys; import seq2trt.exporters.tensorrt.child, seq2trt.exporters.tensorrt.build, "
            "seq2trt.plugins.tensorrt_plugin; print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
