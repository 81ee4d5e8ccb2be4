"""Bad inputs, row by row: every bad input ends in one clear error line naming the problem and the fix, exit
code 2 (bad input) or 1 (a check that ran and failed), no traceback, and nothing half-written or overwritten.

Rows run through click's CliRunner (in process: a subprocess costs seconds per row on our CPUs); a full disk, Ctrl-C
and two concurrent builds are in test_interrupted_writes.py. Rows that need a GPU at run time (an engine from
another TensorRT or GPU, shapes outside the engine's profile) test the checks those runners call, on CPU; token ids,
which no verb takes from a user, are checked where every runner checks its feed.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from seq2trt.exporters import spec
from seq2trt.exporters.manifest import read_manifest
from seq2trt.exporters.tensorrt import trt_compat
from seq2trt.core.errors import ArtifactError, InputError
from seq2trt.reference_model.tasks import get_task

MAX_BATCH, MAX_LEN = 4, 16  # conftest.artifact's limits


# --- setups: each damages the private copy and returns the command line -----------------------------------------

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


def partial_graph(w: Path) -> None:
    from seq2trt.plugins.op import AttentionKind

    path = w / "out" / "encoder.onnx"
    model = onnx.inliner.inline_selected_functions(
        onnx.load(path), [(spec.MARKED_DOMAIN, spec.MARKED_OP_TYPES[AttentionKind.ENCODER_SELF])])
    onnx.save(model, path)


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
    rehash: bool = False  # the setup changed a graph on purpose: re-hash the manifest so the stage sees the change


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
        Row("train-diverges", lambda w: ["train", "-o", w / "new", "--preset", "tiny", "--steps", "3", "--batch-size",
                                         "4", "--lr", "1e30", "--eval-examples", "1"], 1,
            ("training diverged: the loss is nan at step 2 of 3", "--lr 1e+30", "lower --lr", "nothing was written")),
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
            ("config.json: num_decoder_layers is 3 but", "holds weights for 2 decoder layers",
             "load the weights with the config.json they were saved with")),
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
            ("is not a seq2trt encoder graph", "seq2trt export --force"), rehash=True),
        Row("partial-fusion", lambda w: partial_graph(w) or ["fuse", out(w), "--force"], 1,
            ("2 attention block(s) not fused", "--allow-partial"), rehash=True),
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


@pytest.mark.parametrize("row", [pytest.param(r, id=r.id, marks=[pytest.mark.rtx] if r.needs_rtx else [])
                                 for r in _unchanged_rows()])
def test_bad_input_is_one_clear_line_and_changes_nothing(work, row, snapshot, invoke, one_error_line,
                                                         rewrite_manifest):
    args = row.setup(work)
    if row.rehash:
        rewrite_manifest(work / "out")
    before = snapshot(work)
    one_error_line(invoke(*args), row.code, *row.fragments)
    assert snapshot(work) == before


def test_debug_shows_the_traceback(work, invoke):
    result = invoke("--debug", "translate", work / "ckpt", "12a")
    assert result.exit_code != 0 and isinstance(result.exception, InputError)


def test_no_tensorrt_rtx_installed_names_the_extra(work, monkeypatch, snapshot, invoke, one_error_line):
    monkeypatch.setitem(sys.modules, "tensorrt_rtx", None)  # import fails as if it were not installed
    before = snapshot(work)
    one_error_line(invoke("build", work / "out", "--force"), 2, "needs the `tensorrt_rtx` module",
                       "pip install 'seq2trt[rtx]'")
    assert snapshot(work) == before


def test_nan_and_inf_in_outputs_fail_validate_naming_the_output(work, invoke, one_error_line, rewrite_manifest):
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
    line = one_error_line(invoke("validate", out, "--samples", "0"), 1, "parity failed", "parity.md")
    result = invoke("validate", out, "--samples", "0")
    assert "logits" in result.output and "nan 1" in result.output and "inf 1" in result.output
    assert "present.0.decoder.key" not in result.output and "encoder_hidden_states" not in result.output, line
    assert json.loads((out / "reports" / "parity.json").read_text())["passed"] is False


# --- runtime checks that need a GPU to be reached through the CLI: their check functions, on CPU ---------------

def fake_build(engine_dir: Path, **changes) -> dict:
    path = engine_dir / "build.json"
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
def test_engine_from_another_tensorrt_or_gpu_is_refused(artifact, engines, changes, runtime, device_cc, fragments):
    engine_dir = artifact / "out" / engines
    with pytest.raises(ArtifactError) as info:
        trt_compat.check_engine(fake_build(engine_dir, **changes), "tensorrt-rtx", runtime, device_cc)
    assert all(f in str(info.value) for f in fragments), str(info.value)
    trt_compat.check_engine(fake_build(engine_dir), "tensorrt-rtx", "1.7.2.3", 86)  # same major.minor runs


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
    from seq2trt.runtime.tensorrt_runner import TensorRTRunner

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
    from seq2trt.runtime.runners import OrtRunner

    runner = OrtRunner(artifact / "out" / "encoder.onnx", manifest.config, spec.GraphKind.ENCODER, "fp32",
                       manifest.limits)
    with runner, pytest.raises(InputError, match="feed does not match the graph contract") as info:
        runner.infer(feed)
    assert fragment in str(info.value)


def test_an_unwritable_torch_compile_cache_is_one_line(work, tmp_path, monkeypatch, invoke, one_error_line):
    """torch.export writes into torch's compile cache as it loads: one that is a file (or cannot be written) was a
    FileExistsError traceback from inside torch; now one line naming it, and no export written."""
    blocker = tmp_path / "cache"
    blocker.write_text("not a folder")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(blocker))
    one_error_line(invoke("export", work / "ckpt", "-o", tmp_path / "out"), 2,
                   f"TORCHINDUCTOR_CACHE_DIR {blocker} is not a folder it can write", "point TORCHINDUCTOR_CACHE_DIR")
    assert not (tmp_path / "out").exists()
