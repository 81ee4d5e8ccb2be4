"""The Triton attention kernels on CPU (TRITON_INTERPRET=1) against `plugins.op.reference_attention` in float64.

Head dims: 32, 64 and 128 over every length; then head dims that run a wider compiled HEAD_DIM with the rest masked
(8 -> 16, 40 and 48 -> 64, 80 and 96 -> 128) and 16 and 256, on small shapes.

The interpreter must be switched on before triton is first imported, and the ahead-of-time tests import triton
without it, so the sweep runs in a child process: this file run as a script. The parent lists the cases, the child
runs them all once and prints one JSON line of errors, and each case is its own test.

Also here: `reference_attention` itself against the reference model's `attention_core` in float64, and the parts of
scripts/gpu_kernels.py that need no GPU (its unfused PyTorch baseline; the whole script on CPU in the interpreter).
"""

from __future__ import annotations

import json
import math
import os
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from seq2trt.plugins.kernels.launch_plan import KERNEL_HEAD_DIMS, TOLERANCES, kernel_head_dim
from seq2trt.plugins.op import AttentionAttrs, AttentionKind, reference_attention
from seq2trt.reference_model.model import attention_core

OTHER_HEAD_DIMS = (8, 16, 40, 48, 80, 96, 256)
LENGTHS = {  # (tgt_len, kv_len): kv_len is the source length (CROSS) or the past length (DECODER_SELF)
    AttentionKind.ENCODER_SELF: [(1, 1), (7, 7), (17, 17), (65, 65)],
    AttentionKind.CROSS: [(1, 65), (7, 17), (17, 1), (65, 7)],
    AttentionKind.DECODER_SELF: [(1, 0), (1, 65), (7, 0), (17, 9), (65, 3)],
}


def _case(kind, dtype, head_dim, tgt_len, kv_len, empty_row=False, num_splits=None, seed=0):
    return {"kind": kind.name, "dtype": dtype, "head_dim": head_dim, "tgt_len": tgt_len, "kv_len": kv_len,
            "empty_row": empty_row, "num_splits": num_splits, "seed": seed}


def _cases() -> list[dict]:
    cases = [_case(kind, dtype, head_dim, t, s, seed=i)
             for i, (kind, dtype, head_dim) in enumerate(
                 (k, d, h) for k in AttentionKind for d in TOLERANCES for h in (32, 64, 128))
             for t, s in LENGTHS[kind]]
    for dtype in TOLERANCES:
        cases += [  # boundaries: a fully padded row, forced split counts, blocks crossing the causal diagonal
            _case(AttentionKind.ENCODER_SELF, dtype, 64, 17, 17, empty_row=True),
            _case(AttentionKind.CROSS, dtype, 64, 1, 33, empty_row=True, num_splits=2),
            _case(AttentionKind.CROSS, dtype, 32, 1, 300, num_splits=64),
            _case(AttentionKind.DECODER_SELF, dtype, 64, 1, 200, num_splits=1),
            _case(AttentionKind.DECODER_SELF, dtype, 64, 1, 200, num_splits=3),
            _case(AttentionKind.DECODER_SELF, dtype, 32, 130, 129),
            _case(AttentionKind.CROSS, dtype, 64, 1, 200, empty_row=True, num_splits=3),  # padded splits merged
        ]
    for i, head_dim in enumerate(OTHER_HEAD_DIMS):
        for dtype in TOLERANCES:
            cases += [_case(AttentionKind.ENCODER_SELF, dtype, head_dim, 9, 9, empty_row=True, seed=i),
                      _case(AttentionKind.CROSS, dtype, head_dim, 5, 9, empty_row=True, seed=i),
                      _case(AttentionKind.CROSS, dtype, head_dim, 1, 70, empty_row=True, num_splits=2, seed=i),
                      _case(AttentionKind.DECODER_SELF, dtype, head_dim, 1, 40, num_splits=2, seed=i),
                      _case(AttentionKind.DECODER_SELF, dtype, head_dim, 6, 3, seed=i)]
    return cases


CASES = _cases()


def _case_id(c: dict) -> str:
    extra = ("-empty_row" if c["empty_row"] else "") + (f"-splits{c['num_splits']}" if c["num_splits"] else "")
    return f"{c['kind']}-{c['dtype']}-d{c['head_dim']}-t{c['tgt_len']}-kv{c['kv_len']}{extra}"


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, __file__], input=json.dumps(CASES), env=env, capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"interpreter sweep exited with {proc.returncode}:\n{proc.stderr[-4000:]}")
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    return {r["id"]: r for r in results}


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_kernel_matches_reference(case, interpreter_results):
    r = interpreter_results[_case_id(case)]
    assert r["error"] is None, r["error"]
    atol, rtol = TOLERANCES[case["dtype"]]
    assert r["output_excess"] <= 0.0, (f"output off by {r['output_max_abs']:.3g} "
                                       f"(allowed {atol} + {rtol} * |ref|)")
    assert r["present_exact"], "present K/V differ from past ++ new"


def _inputs(kind: AttentionKind, B=2, H=3, Dh=8, T=5, S=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    attrs = AttentionAttrs(kind, H, Dh, 1.0 / math.sqrt(Dh))
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    q = rand(B, T, H * Dh)
    if kind is AttentionKind.DECODER_SELF:
        return attrs, (q, rand(B, T, H * Dh), rand(B, T, H * Dh), rand(B, H, S, Dh), rand(B, H, S, Dh))
    L = T if kind is AttentionKind.ENCODER_SELF else S
    mask = (torch.arange(L)[None, :] < torch.tensor([L, max(1, L - 3)])[:B, None]).to(torch.int32)
    if kind is AttentionKind.ENCODER_SELF:
        return attrs, (q, rand(B, T, H * Dh), rand(B, T, H * Dh), mask)
    return attrs, (q, rand(B, H, S, Dh), rand(B, H, S, Dh), mask)


@pytest.mark.parametrize("kind", list(AttentionKind), ids=lambda k: k.name)
@pytest.mark.parametrize("past_len", [0, 6])
def test_reference_matches_model_attention_core(kind, past_len):
    attrs, inputs = _inputs(kind, S=past_len if kind is AttentionKind.DECODER_SELF else 6)
    expected = reference_attention(attrs, *inputs)
    q, k, v = inputs[:3]
    if kind is AttentionKind.DECODER_SELF:
        out, present = attention_core(attrs.kind, q, k, v, attrs.num_heads, attrs.scale, past=(inputs[3], inputs[4]))
        got = (out, *present)
    else:
        out, _ = attention_core(attrs.kind, q, k, v, attrs.num_heads, attrs.scale, key_padding_mask=inputs[3])
        got = (out,)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-12, rtol=1e-12)


def test_other_head_dims_reach_every_compiled_head_dim():
    assert {kernel_head_dim(d) for d in OTHER_HEAD_DIMS + (32, 64, 128)} == set(KERNEL_HEAD_DIMS)
    assert any(kernel_head_dim(d) != d for d in OTHER_HEAD_DIMS)


GPU_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_kernels.py"


def _gpu_script():
    spec = importlib.util.spec_from_file_location("gpu_kernels", GPU_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("kind", list(AttentionKind), ids=lambda k: k.name)
@pytest.mark.parametrize("tgt_len", [1, 5])
def test_gpu_script_baseline_computes_the_op(kind, tgt_len):
    """The benchmark's unfused PyTorch side (SDPA) must do the op's work, or its timings compare nothing."""
    attrs, inputs = _inputs(kind, T=tgt_len, S=6)
    got = _gpu_script().torch_attention(attrs, inputs)
    for g, e in zip(got, reference_attention(attrs, *inputs), strict=True):
        torch.testing.assert_close(g, e, atol=1e-12, rtol=1e-12)


def test_gpu_script_cases_cover_every_variant():
    cases = _gpu_script().correctness_cases(quick=False)
    head_dims = {c["head_dim"] for c in cases}
    assert {kernel_head_dim(h) for h in head_dims} == set(KERNEL_HEAD_DIMS)
    assert any(kernel_head_dim(h) != h for h in head_dims)  # some run a wider kernel, masked
    assert {(c["kind"], c["dtype"], c["head_dim"]) for c in cases if not c.get("empty_row")} == \
        {(k.name, d, h) for k in AttentionKind for d in TOLERANCES for h in head_dims}
    assert {(c["kind"], c["dtype"]) for c in cases if c.get("empty_row")} == \
        {(k, d) for k in ("ENCODER_SELF", "CROSS") for d in TOLERANCES}
    assert any(c.get("empty_row") and c["kv_len"] > 128 and c["tgt_len"] == 1 for c in cases)  # split-K
    decoder = [(c["tgt_len"], c["kv_len"]) for c in cases if c["kind"] == "DECODER_SELF"]
    assert {(1, 0), (1, 200), (7, 0)} <= set(decoder) and any(t > 64 and p > 0 for t, p in decoder)


def test_gpu_script_runs_on_cpu_in_the_interpreter(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)  # the script's --device cpu sets it before importing triton
    proc = subprocess.run([sys.executable, str(GPU_SCRIPT), str(tmp_path), "--device", "cpu", "--quick",
                           "--warmup", "1", "--iters", "1"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_kernels.json").read_text())
    assert report["ok"] and report["correctness"] and all(c["ok"] for c in report["correctness"])
    (bench,) = report["benchmarks"]
    assert bench["triton_ms"] > 0 and bench["torch_sdpa_ms"] > 0 and bench["max_abs_vs_sdpa"] < 1e-2


def _run_sweep(cases: list[dict]) -> list[dict]:
    """In the child: run each case through the kernels and measure it against the float64 reference."""
    from seq2trt.plugins.kernels.launch_plan import attention, random_inputs

    dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    results = []
    for c in cases:
        r = {"id": _case_id(c), "error": None, "output_excess": math.inf, "output_max_abs": math.inf,
             "present_exact": False}
        try:
            attrs, inputs = random_inputs(AttentionKind[c["kind"]], batch=2, heads=2, head_dim=c["head_dim"],
                                          tgt_len=c["tgt_len"], kv_len=c["kv_len"], dtype=dtypes[c["dtype"]],
                                          seed=c["seed"], empty_row=c["empty_row"])
            got = attention(attrs, *inputs, num_splits=c["num_splits"])
            ref = reference_attention(attrs, *(x.double() if x.is_floating_point() else x for x in inputs))
            atol, rtol = TOLERANCES[c["dtype"]]
            diff = (got[0].double() - ref[0]).abs()
            r["output_max_abs"] = diff.max().item()
            r["output_excess"] = (diff - atol - rtol * ref[0].abs()).max().item()
            r["present_exact"] = all(torch.equal(g, e.to(g.dtype)) for g, e in zip(got[1:], ref[1:]))
        except Exception as e:  # reported per case by the parent
            r["error"] = f"{type(e).__name__}: {e}"
        results.append(r)
    return results


def _patch_interpreter_bf16_dot() -> None:
    """The interpreter stores bf16 as uint16 and its tl.dot multiplies those bit patterns (triton-lang/triton#11584,
    unsupported upstream). Emulate the GPU instead: bf16 operands are exact in fp32, products accumulate in fp32."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    create_dot = interpreter.InterpreterBuilder.create_dot

    def to_fp32(x):
        if x.dtype.scalar != tl.bfloat16:
            return x
        data = interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    def patched(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, to_fp32(a), to_fp32(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = patched


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1" or "triton" in sys.modules:
        raise SystemExit("run with TRITON_INTERPRET=1 and triton not yet imported")
    torch.set_num_threads(1)
    _patch_interpreter_bf16_dot()
    print(json.dumps(_run_sweep(json.load(sys.stdin))))
