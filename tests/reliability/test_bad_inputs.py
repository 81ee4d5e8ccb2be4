"""Issue 9's table, row by row: every bad input ends in one clear error line naming the problem and the fix, exit
code 2 (bad input) or 1 (a check that ran and failed), no traceback, and nothing half-written or overwritten.

Rows run through click's CliRunner (in process: a subprocess costs seconds per row on our CPUs), except Ctrl-C
and two concurrent builds, which need real processes. Rows that need a GPU at run time (an engine from another
TensorRT or GPU, shapes outside the engine's profile) test the checks those runners call, on CPU; token ids, which
no verb takes from a user, are checked where every runner checks its feed.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner, Result
from onnx import TensorProto, helper

from seq2trt.cli.main import cli
from seq2trt.exporters import spec
from seq2trt.exporters.manifest import read_manifest, write_manifest
from seq2trt.plugins import trt_compat
from seq2trt.reference_model.errors import ArtifactError, InputError
from seq2trt.reference_model.tasks import get_task

HAS_RTX = importlib.util.find_spec("tensorrt_rtx") is not None
ENGINES = "engines/tensorrt-rtx-sm_86-fp32"  # as conftest.artifact builds them
MAX_BATCH, MAX_LEN = 4, 16  # conftest.artifact's limits


def snapshot(root: Path) -> dict[str, str]:
    """Every file and folder under `root` (hidden ones included) -> sha256 of its bytes ("dir" for folders)."""
    return {str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}


def invoke(*args) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def assert_clean_error(result, code: int, *fragments: str) -> str:
    """Exit `code`, no traceback, exactly one error line holding every fragment; returns that line."""
    output = result.output
    assert result.exit_code == code, output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in output
    lines = [line for line in output.splitlines() if line.lower().startswith("error:")]
    assert len(lines) == 1, output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


# --- setups: each damages the private copy and returns the command line -----------------------------------------

def rewrite_manifest(out: Path) -> None:
    """Re-hash the files after a deliberate change, so the change reaches the stage instead of the sha256 check."""
    m = read_manifest(out)
    write_manifest(out, m.config, m.data["settings"], list(m.data["files"]), m.data["source"])


def edit_config(w: Path, **changes) -> None:
    path = w / "ckpt" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def edit_weights(w: Path, edit: Callable[[dict], None]) -> None:
    from safetensors.torch import load_file, save_file

    path = w / "ckpt" / "model.safetensors"
    state = load_file(str(path))
    edit(state)
    save_file(state, str(path))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


class Pickled:
    """Anything that is not a tensor: unpickling it would need code (this class)."""


def pickled_pt(w: Path) -> None:
    (w / "ckpt" / "model.safetensors").unlink()
    torch.save({"state_dict": Pickled()}, w / "ckpt" / "model.pt")


def foreign_graph(w: Path) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "other", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), w / "out" / "encoder.onnx")
    rewrite_manifest(w / "out")


def partial_graph(w: Path) -> None:
    from seq2trt.plugins.op import AttentionKind

    path = w / "out" / "encoder.onnx"
    model = onnx.inliner.inline_selected_functions(
        onnx.load(path), [(spec.MARKED_DOMAIN, spec.MARKED_OP_TYPES[AttentionKind.ENCODER_SELF])])
    onnx.save(model, path)
    rewrite_manifest(w / "out")


def append_byte(path: Path) -> None:
    with open(path, "ab") as f:
        f.write(b"\0")


@dataclass(frozen=True)
class Row:
    id: str
    setup: Callable[[Path], list]  # damages the copy, returns the CLI arguments
    code: int
    fragments: tuple[str, ...]  # the problem and the fix, in the error line
    needs_rtx: bool = False


def _unchanged_rows() -> list[Row]:
    ck = lambda w: w / "ckpt"
    out = lambda w: w / "out"
    translate = lambda w: ["translate", ck(w), "123"]
    return [
        # train / translate
        Row("unknown-task", lambda w: ["train", "-o", w / "new", "--task", "poetry"], 2,
            ("unknown task 'poetry'", "available tasks: numbers")),
        Row("unknown-preset", lambda w: ["train", "-o", w / "new", "--preset", "huge"], 2,
            ("unknown preset 'huge'", "choose one of tiny")),
        Row("invalid-train-setting", lambda w: ["train", "-o", w / "new", "--steps", "0"], 2, ("steps must be >= 1",)),
        Row("invalid-config-values", lambda w: edit_config(w, num_heads=3) or translate(w), 2,
            ("must be divisible by num_heads (3)", "config.json")),
        Row("text-outside-vocabulary", lambda w: ["translate", ck(w), "12a"], 2,
            ("outside the vocabulary: ['a']", "allowed: 0123456789")),
        # checkpoint
        Row("checkpoint-missing", lambda w: ["translate", w / "nope", "1"], 2, ("not found", "seq2trt train -o")),
        Row("safetensors-truncated", lambda w: truncate(ck(w) / "model.safetensors") or translate(w), 2,
            ("truncated or not a safetensors file", "re-save or re-download")),
        Row("missing-keys", lambda w: edit_weights(w, lambda s: s.pop("lm_head.weight")) or translate(w), 2,
            ("missing keys ['lm_head.weight']", "re-save the checkpoint")),
        Row("unexpected-keys", lambda w: edit_weights(w, lambda s: s.update(extra=torch.zeros(2))) or translate(w), 2,
            ("unexpected keys ['extra']", "re-save the checkpoint")),
        Row("shape-mismatch", lambda w: edit_weights(w, lambda s: s.update({"lm_head.weight": torch.zeros(3, 32)}))
            or translate(w), 2, ("lm_head.weight: weights have shape (3, 32), config expects", "config.json")),
        Row("config-contradicts-weights", lambda w: edit_config(w, num_decoder_layers=3) or translate(w), 2,
            ("does not match its config", "missing keys ['decoder_layers.2.")),
        Row("pickled-code", lambda w: pickled_pt(w) or translate(w), 2,
            ("holds pickled code or objects", "torch.save(model.state_dict()")),
        # export
        Row("export-over-existing", lambda w: ["export", ck(w), "-o", out(w)], 2, ("already exists", "--force")),
        Row("unsupported-dtype", lambda w: ["export", ck(w), "-o", w / "new", "--dtype", "fp8"], 2,
            ("'fp8' is not one of", "'fp32', 'fp16', 'bf16'")),
        Row("unsupported-opset", lambda w: ["export", ck(w), "-o", w / "new", "--opset", "12"], 2,
            ("opset 12 is not supported", "choose 18..23")),
        Row("max-length-beyond-positions", lambda w: ["export", ck(w), "-o", w / "new", "--max-src-len", "999"], 2,
            ("exceed the model's max_src_len 16", "lower --max-src-len")),
        # fuse / build
        Row("fuse-sha256-differs", lambda w: append_byte(out(w) / "encoder.onnx") or ["fuse", out(w), "--force"], 2,
            ("encoder.onnx does not match its sha256", "seq2trt export --force")),
        Row("build-sha256-differs", lambda w: append_byte(out(w) / "fused/trt/decoder.onnx") or
            ["build", out(w), "--force"], 2, ("decoder.onnx does not match its sha256 in fusion.json",
                                              "--target trt --force"), needs_rtx=True),
        Row("graph-not-ours", lambda w: foreign_graph(w) or ["fuse", out(w), "--force"], 2,
            ("is not a seq2trt encoder graph", "seq2trt export --force")),
        Row("partial-fusion", lambda w: partial_graph(w) or ["fuse", out(w), "--force"], 1,
            ("2 attention block(s) not fused", "--allow-partial")),
        Row("no-tensorrt", lambda w: ["build", out(w), "--backend", "tensorrt", "--force"], 2,
            ("needs the `tensorrt` module", "pip install 'seq2trt[trt]'")),
        Row("build-profile-beyond-positions", lambda w: ["build", out(w), "--max-tgt-len", "64", "--force"], 2,
            ("exceed the model's max_src_len 16 / max_tgt_len 16", "lower --max-src-len / --max-tgt-len")),
        Row("target-not-buildable", lambda w: ["build", out(w), "--target", "sm_90", "--force"], 2,
            ("cannot target sm_90", "needs --backend tensorrt"), needs_rtx=True),
        # run / validate / bench
        Row("batch-larger-than-max", lambda w: ["bench", out(w), "--backends", "ort", "--batch-sizes", "64"], 2,
            ("batch sizes [64] exceed the export's max_batch 4", "--max-batch")),
        Row("decoding-beyond-the-profile", lambda w: ["validate", out(w), "--max-new-tokens", "99"], 2,
            ("--max-new-tokens 99 is outside [1, 15]", "re-export with a larger --max-tgt-len")),
        Row("empty-source", lambda w: ["translate", ck(w), " "], 2, ("empty source", "at least one symbol")),
        Row("source-longer-than-max", lambda w: ["translate", ck(w), "1" * 20], 2,
            ("over the model's max_src_len 16", "shorten it")),
    ]


@pytest.mark.parametrize("row", _unchanged_rows(), ids=lambda r: r.id)
def test_bad_input_is_one_clear_line_and_changes_nothing(work, row):
    if row.needs_rtx and not HAS_RTX:
        pytest.skip("tensorrt_rtx is not installed (pip install 'seq2trt[rtx]')")
    args = row.setup(work)
    before = snapshot(work)
    assert_clean_error(invoke(*args), row.code, *row.fragments)
    assert snapshot(work) == before


def test_debug_shows_the_traceback(work):
    result = invoke("--debug", "translate", work / "ckpt", "12a")
    assert result.exit_code != 0 and isinstance(result.exception, InputError)


def test_no_tensorrt_rtx_installed_names_the_extra(work, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt_rtx", None)  # import fails as if it were not installed
    before = snapshot(work)
    assert_clean_error(invoke("build", work / "out", "--force"), 2, "needs the `tensorrt_rtx` module",
                       "pip install 'seq2trt[rtx]'")
    assert snapshot(work) == before


def test_nan_and_inf_in_outputs_fail_validate_naming_the_output(work):
    """logits[..., 5] = NaN and logits[..., 6] = +Inf, by an Add after the graph's last node."""
    out = work / "out"
    path = out / "decoder.onnx"
    model = onnx.load(path)
    producer = next(n for n in model.graph.node if "logits" in n.output)
    producer.output[list(producer.output).index("logits")] = "logits_clean"
    vocab = len(get_task("numbers").target_vocab)
    poison = np.zeros(vocab, np.float32)
    poison[5], poison[6] = np.nan, np.inf
    model.graph.initializer.append(onnx.numpy_helper.from_array(poison, "poison"))
    model.graph.node.append(helper.make_node("Add", ["logits_clean", "poison"], ["logits"]))
    onnx.save(model, path)
    rewrite_manifest(out)
    line = assert_clean_error(invoke("validate", out, "--samples", "0"), 1, "parity failed", "parity.md")
    result = invoke("validate", out, "--samples", "0")
    assert "logits" in result.output and "nan 1" in result.output and "inf 1" in result.output
    assert "present.0.decoder.key" not in result.output and "encoder_hidden_states" not in result.output, line
    assert json.loads((out / "reports" / "parity.json").read_text())["passed"] is False


# --- runtime checks that need a GPU to be reached through the CLI: their check functions, on CPU ---------------

def fake_build(artifact: Path, **changes) -> dict:
    path = artifact / "out" / ENGINES / "build.json"
    info = json.loads(path.read_text()) if path.exists() else {
        "flavour": "tensorrt-rtx", "tensorrt_version": "1.7.1.116", "targets": [86], "compute_capabilities": [86]}
    return {**info, **changes}


@pytest.mark.parametrize("changes, runtime, device_cc, fragments", [
    ({"tensorrt_version": "1.6.0.1"}, "1.7.1.116", 86, ("built by tensorrt-rtx 1.6.0.1", "do not move across versions",
                                                        "seq2trt build OUT --backend tensorrt-rtx --target sm_86")),
    ({}, "1.7.1.116", 89, ("targets sm_86, but this GPU is sm_89", "--target sm_89")),
    ({}, "1.7.1.116", 90, ("this GPU is sm_90", "--target current")),
    ({"flavour": "tensorrt"}, "1.7.1.116", 86, ("built by tensorrt, but this runner is tensorrt-rtx", "rebuild")),
], ids=["other-tensorrt-version", "other-gpu", "gpu-rtx-cannot-target", "other-flavour"])
def test_engine_from_another_tensorrt_or_gpu_is_refused(artifact, changes, runtime, device_cc, fragments):
    with pytest.raises(ArtifactError) as info:
        trt_compat.check_engine(fake_build(artifact, **changes), "tensorrt-rtx", runtime, device_cc)
    assert all(f in str(info.value) for f in fragments), str(info.value)
    trt_compat.check_engine(fake_build(artifact), "tensorrt-rtx", "1.7.2.3", 86)  # same major.minor runs


@pytest.fixture(scope="module")
def manifest(artifact):
    return read_manifest(artifact / "out")


def encoder_feed(batch: int, src_len: int, token: int = 5) -> dict[str, np.ndarray]:
    return {"input_ids": np.full((batch, src_len), token, np.int64),
            "attention_mask": np.ones((batch, src_len), np.int64)}


@pytest.mark.parametrize("batch, src_len, fragment", [
    (MAX_BATCH + 1, 4, "(5, 4) is outside the engine's profile [(1, 1), (4, 16)]"),
    (1, MAX_LEN + 1, "(1, 17) is outside the engine's profile [(1, 1), (4, 16)]"),
    (1, 0, "(1, 0) is outside the engine's profile"),
], ids=["batch", "src-len", "empty"])
def test_shapes_outside_the_build_profile_are_refused_before_tensorrt(manifest, batch, src_len, fragment):
    from seq2trt.validation.trt_runner import TensorRTRunner

    kind = spec.GraphKind.ENCODER
    runner = TensorRTRunner(b"", manifest.config, kind, "fp32", manifest.limits)
    runner.profile = spec.profiles(manifest.config, manifest.limits)[kind]  # what activation reads from the engine
    runner.input_names = list(runner.profile)
    feed = {k: torch.from_numpy(v) for k, v in encoder_feed(batch, src_len).items()}
    with pytest.raises(InputError, match="rebuild with larger --max-batch") as info:
        runner.infer_device(feed)  # raises before touching CUDA
    assert fragment in str(info.value)


@pytest.mark.parametrize("feed, fragment", [
    (encoder_feed(1, 4, token=13), "token ids must lie in [0, 13)"),
    (encoder_feed(MAX_BATCH + 1, 4), "batch = 5 is outside [1, 4]"),
    (encoder_feed(1, MAX_LEN + 1), "src_len = 17 is outside [1, 16]"),
    (encoder_feed(1, 0), "src_len = 0 is outside [1, 16]"),
    ({**encoder_feed(1, 4), "attention_mask": np.full((1, 4), 2, np.int64)}, "a mask holds 0 (pad) and 1"),
], ids=["token-id-ge-vocab", "batch", "src-len", "empty-source", "mask-values"])
def test_runner_refuses_a_bad_feed_with_one_error(artifact, manifest, feed, fragment):
    from seq2trt.validation.runners import OrtRunner

    runner = OrtRunner(artifact / "out" / "encoder.onnx", manifest.config, spec.GraphKind.ENCODER, "fp32",
                       manifest.limits)
    with runner, pytest.raises(InputError, match="feed does not match the graph contract") as info:
        runner.infer(feed)
    assert fragment in str(info.value)


# --- disk full and interrupted writes: the old artifact stays intact ---------------------------------------------

def fail_on_call(n: int, exc: BaseException, real: Callable) -> Callable:
    """A stand-in for `real` that raises `exc` on its n-th call (1-based): a write that stops midway."""
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise exc
        return real(*args, **kwargs)

    return wrapper


DISK_FULL = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("exc, code, fragments", [
    (DISK_FULL, 2, ("no space left on the device", "free some space")),
    (KeyboardInterrupt(), 130, ("interrupted",)),
], ids=["disk-full", "interrupted"])
def test_failed_fuse_keeps_the_old_fused_graphs(work, monkeypatch, exc, code, fragments):
    """The second graph's save fails inside the staged directory: the previous fused/trt stays as it was."""
    monkeypatch.setattr(onnx, "save", fail_on_call(2, exc, onnx.save))
    before = snapshot(work)
    result = invoke("fuse", work / "out", "--force")
    assert result.exit_code == code and "Traceback" not in result.output, result.output
    assert all(f in result.output for f in fragments), result.output
    assert snapshot(work) == before


@pytest.mark.parametrize("exc, code, fragments", [
    (DISK_FULL, 2, ("cannot write", "report.md: no space left", "the previous report.md is intact")),
    (KeyboardInterrupt(), 130, ("interrupted",)),
], ids=["disk-full", "interrupted"])
def test_failed_report_write_keeps_the_old_report(work, monkeypatch, exc, code, fragments):
    """fsync fails after the bytes went to the temporary file: the old report.md stays, no temporary is left."""
    monkeypatch.setattr(os, "fsync", fail_on_call(1, exc, os.fsync))
    before = snapshot(work)
    result = invoke("report", work / "out")
    assert result.exit_code == code and "Traceback" not in result.output, result.output
    assert all(f in result.output for f in fragments), result.output
    assert snapshot(work) == before


@pytest.mark.skipif(not HAS_RTX, reason="tensorrt_rtx is not installed (pip install 'seq2trt[rtx]')")
def test_disk_full_mid_build_keeps_the_old_engines(work, monkeypatch):
    """The disk fills while the first plan is written: the old engine directory stays, nothing staged is left."""
    monkeypatch.setattr(os, "fsync", fail_on_call(1, DISK_FULL, os.fsync))
    before = snapshot(work)
    line = assert_clean_error(invoke("build", work / "out", "--force"), 2, "encoder.plan: no space left on the device",
                              "free some space")
    assert snapshot(work) == before, line


def test_interrupt_between_the_final_renames_puts_the_old_directory_back(work, monkeypatch):
    """Ctrl-C after the old fused/trt was set aside but before the new one took its place."""
    real = os.replace

    def replace(src, dst):
        if str(src).endswith(".partial"):
            raise KeyboardInterrupt
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    before = snapshot(work)
    result = invoke("fuse", work / "out", "--force")
    assert result.exit_code == 130 and "Traceback" not in result.output, result.output
    assert snapshot(work) == before


def test_train_force_interrupted_mid_training_keeps_the_old_checkpoint(work, monkeypatch):
    from seq2trt.cli import model_commands

    def interrupted(settings, progress):
        progress(1, 1.0)
        raise KeyboardInterrupt

    monkeypatch.setattr(model_commands, "train_model", interrupted)
    before = snapshot(work)
    result = invoke("train", "-o", work / "ckpt", "--preset", "tiny", "--steps", "5", "--force")
    assert result.exit_code == 130 and "interrupted" in result.output, result.output
    assert snapshot(work) == before


# --- Ctrl-C mid-build, and two builds at once (real processes) ----------------------------------------------------

def seq2trt(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "seq2trt.cli.main", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def plans_match_build_json(engine_dir: Path) -> bool:
    info = json.loads((engine_dir / "build.json").read_text())
    return all(hashlib.sha256((engine_dir / g["plan"]).read_bytes()).hexdigest() == g["plan_sha256"]
               for g in info["graphs"].values()) and len(info["graphs"]) == 2


@pytest.mark.skipif(not HAS_RTX, reason="tensorrt_rtx is not installed (pip install 'seq2trt[rtx]')")
def test_ctrl_c_mid_build_exits_130_and_keeps_the_old_engines(work):
    before = snapshot(work)
    engines = work / "out" / "engines"
    proc = seq2trt("build", work / "out", "--force")
    deadline = time.monotonic() + 120
    while not list(engines.glob(".*.partial")):  # the build has started writing its staged directory
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr
    assert snapshot(work) == before  # old engines intact; no staged directory, lock file or .old left


@pytest.mark.skipif(not HAS_RTX, reason="tensorrt_rtx is not installed (pip install 'seq2trt[rtx]')")
def test_two_builds_on_the_same_out_take_turns(work):
    out, engine_dir = work / "out", work / "out" / ENGINES
    shutil.rmtree(engine_dir)
    procs = [seq2trt("build", out) for _ in range(2)]  # no --force: exactly one may write the engines
    results = [(p.communicate(timeout=300)[1], p.returncode)[::-1] for p in procs]
    assert sorted(code for code, _ in results) == [0, 2], results
    assert any("already exists" in err and "--force" in err for code, err in results if code == 2)
    assert plans_match_build_json(engine_dir)
    procs = [seq2trt("build", out, "--force") for _ in range(2)]  # both replace it, one after the other
    results = [(p.communicate(timeout=300)[1], p.returncode)[::-1] for p in procs]
    assert [code for code, _ in results] == [0, 0], results
    assert plans_match_build_json(engine_dir)
    assert sorted(p.name for p in (out / "engines").iterdir()) == [engine_dir.name]  # no .partial/.old/.lock
