"""T5's relative position bias through the attention kernels, the plugin graphs on CPU and the eager model.

The bias is the op's optional last input, an (H, 2M - 1) table by signed distance (`plugins.op`), which the kernels
read once per tile (HAS_BIAS: a tile's span of the table, gathered in registers, or one value where the span is uniform,
as T5's buckets are beyond max_distance: the bucketed cases cover both). Judged against `plugins.op.reference_attention` in float64 on the same rounded inputs,
within the kernels' tolerances (`launch_plan.TOLERANCES`): encoder self-attention with padded keys and an all-padding
row, decoder prefill and split-K steps over past lengths 0 and > 0, head dims that run their compiled HEAD_DIM exactly
and masked, fp32/fp16/bf16. Controls: the same kernels given the table flipped along the distance or with its heads
swapped must miss the reference, so the comparison can fail. Then the plugin graph on CPU (`plugin_cpu`) with a bias
input, and a config-built T5-style model decoding through the kernels as the eager model does.

The interpreter (TRITON_INTERPRET=1) must be on before triton is first imported, so the kernel cases and the model
run in one child process: this file run as a script, printing one JSON line.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from seq2trt.plugins.kernels.launch_plan import TOLERANCES, kernel_head_dim
from seq2trt.plugins.op import AttentionAttrs, AttentionKind, reference_attention

ENC, DEC = AttentionKind.ENCODER_SELF, AttentionKind.DECODER_SELF


def _case(kind, dtype, head_dim, tgt_len, kv_len, empty_row=False, num_splits=None, extra_positions=0, seed=0,
          control=None, table="random"):
    return {"kind": kind.name, "dtype": dtype, "head_dim": head_dim, "tgt_len": tgt_len, "kv_len": kv_len,
            "empty_row": empty_row, "num_splits": num_splits, "extra_positions": extra_positions, "seed": seed,
            "control": control, "table": table}


def _cases() -> list[dict]:
    cases = []
    for i, dtype in enumerate(TOLERANCES):
        for head_dim in (32, 64):
            cases += [_case(ENC, dtype, head_dim, 7, 7, empty_row=True, seed=i),  # prefill, one row all padding
                      _case(ENC, dtype, head_dim, 1, 1, seed=i),  # one token: split-K
                      _case(ENC, dtype, head_dim, 17, 17, extra_positions=5, seed=i),  # a table wider than the call
                      _case(DEC, dtype, head_dim, 5, 0, seed=i),  # prefill, past 0
                      _case(DEC, dtype, head_dim, 7, 9, seed=i),  # prefill over a past
                      _case(DEC, dtype, head_dim, 1, 0, seed=i),  # the first step
                      _case(DEC, dtype, head_dim, 1, 20, num_splits=3, extra_positions=4, seed=i)]  # split-K step
        cases += [_case(DEC, dtype, 64, 1, 150, num_splits=3, seed=i),  # 3 splits of 64 keys, past 150
                  _case(DEC, dtype, 32, 70, 3, seed=i)]  # two query blocks crossing the causal diagonal
    for i, head_dim in enumerate((8, 40, 128)):  # run HEAD_DIM 16 and 64 masked, and 128
        for dtype in TOLERANCES:
            cases += [_case(ENC, dtype, head_dim, 6, 6, empty_row=True, seed=i),
                      _case(DEC, dtype, head_dim, 4, 3, seed=i),
                      _case(DEC, dtype, head_dim, 1, 30, num_splits=2, seed=i)]
    for i, dtype in enumerate(TOLERANCES):  # T5's bucketed tables: tiles far from the diagonal see one value
        cases += [_case(ENC, dtype, 64, 150, 150, empty_row=True, table="t5", seed=i),
                  _case(DEC, dtype, 64, 130, 70, table="t5", seed=i),
                  _case(DEC, dtype, 128, 1, 40, num_splits=2, table="t5", seed=i)]
    cases += [_case(ENC, "fp32", 64, 150, 150, control="flipped", table="t5"),
              _case(DEC, "fp32", 64, 130, 70, control="heads_swapped", table="t5")]
    for control in ("flipped", "heads_swapped"):  # a misread table must be caught
        cases += [_case(ENC, "fp32", 32, 7, 7, control=control), _case(DEC, "fp32", 32, 5, 4, control=control),
                  _case(DEC, "fp32", 32, 1, 20, num_splits=2, control=control)]
    return cases


CASES = _cases()


def _case_id(c: dict) -> str:
    extra = ("-empty_row" if c["empty_row"] else "") + (f"-splits{c['num_splits']}" if c["num_splits"] else "") + \
        (f"-M+{c['extra_positions']}" if c["extra_positions"] else "") + \
        (f"-{c['control']}" if c["control"] else "") + ("-t5table" if c["table"] == "t5" else "")
    return f"{c['kind']}-{c['dtype']}-d{c['head_dim']}-t{c['tgt_len']}-kv{c['kv_len']}{extra}"


def t5_table(kind: AttentionKind, heads: int, positions: int, seed: int, num_buckets: int = 8,
             max_distance: int = 16) -> torch.Tensor:
    """A T5 table (H, 2M - 1): random per-bucket biases of T5's size gathered by T5's buckets (bidirectional for the
    encoder, causal for the decoder). Beyond max_distance every distance shares a bucket, so a 64 x 64 tile there
    reads one value throughout (the kernel's uniform-span path) and tiles nearer the diagonal gather."""
    from seq2trt.reference_model.model import relative_position_buckets

    g = torch.Generator().manual_seed(seed)
    per_bucket = torch.randn(num_buckets, heads, generator=g) * 2
    return per_bucket[relative_position_buckets(positions, kind is ENC, num_buckets, max_distance)].t().contiguous()


# --- in the child ------------------------------------------------------------------------------------------------

def _run_cases(cases: list[dict]) -> list[dict]:
    from seq2trt.plugins.kernels.launch_plan import attention, random_inputs

    dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    results = []
    for c in cases:
        r = {"id": _case_id(c), "error": None, "output_excess": math.inf, "present_exact": False,
             "bias_effect": 0.0}
        try:
            kind = AttentionKind[c["kind"]]
            positions = c["tgt_len"] + (c["kv_len"] if kind is DEC else 0) + c["extra_positions"]
            attrs, inputs = random_inputs(kind, batch=2, heads=2, head_dim=c["head_dim"], tgt_len=c["tgt_len"],
                                          kv_len=c["kv_len"], dtype=dtypes[c["dtype"]], seed=c["seed"],
                                          empty_row=c["empty_row"], bias_positions=positions)
            attrs = AttentionAttrs(kind, attrs.num_heads, attrs.head_dim, 1.0)  # T5 scales no scores
            bias = inputs[-1] * 2  # T5-sized biases, in the op's dtype (x2 is exact)
            if c["table"] == "t5":
                bias = t5_table(kind, 2, positions, c["seed"]).to(bias.dtype)
            inputs = inputs[:-1] + (bias,)
            given = {"flipped": bias.flip(-1), "heads_swapped": bias.flip(0), None: bias}[c["control"]]
            got = attention(attrs, *inputs[:-1], given, num_splits=c["num_splits"])
            exact = tuple(x.double() if x.is_floating_point() else x for x in inputs)
            ref = reference_attention(attrs, *exact)
            atol, rtol = TOLERANCES[c["dtype"]]
            diff = (got[0].double() - ref[0]).abs()
            r["output_excess"] = (diff - atol - rtol * ref[0].abs()).max().item()
            r["present_exact"] = all(torch.equal(g, e.to(g.dtype)) for g, e in zip(got[1:], ref[1:]))
            r["bias_effect"] = (reference_attention(attrs, *exact[:-1])[0] - ref[0]).abs().max().item()
        except Exception as e:  # reported per case by the parent
            r["error"] = f"{type(e).__name__}: {e}"
        results.append(r)
    return results


def _t5_decoding() -> dict:
    """A config-built T5-style model (relative bias shared from layer 0, no position table, RMSNorm, no score
    scaling) with padded sources: teacher-forced logits (a prefill, then cached steps) and greedy/beam tokens, eager
    against every attention block through the kernels."""
    from seq2trt.plugins.eager_kernels import kernel_attention
    from seq2trt.reference_model import Seq2SeqTransformer, preset
    from seq2trt.reference_model.decoding import DecodeSettings, beam_search, greedy_decode
    from seq2trt.reference_model.eager import EagerStepModel

    torch.manual_seed(0)
    cfg = preset("tiny", src_vocab_size=13, tgt_vocab_size=17, d_model=64, num_heads=2, tie_embeddings=False,
                 relative_bias="shared", positions="none", norm="rms", scale_attention=False, max_src_len=16,
                 max_tgt_len=16, relative_buckets=8, relative_max_distance=10)
    model = Seq2SeqTransformer(cfg).float().eval()
    tables = [m.relative_bias.weight for m in model.modules() if getattr(m, "relative_bias", None) is not None]
    with torch.no_grad():  # sharper logits (fewer near-ties) and biases of T5's size
        model.lm_head.weight.mul_(8)
        for w in tables:
            w.normal_(0.0, 2.0)
    rng = np.random.default_rng(0)
    ids, mask = np.zeros((3, 7), np.int64), np.zeros((3, 7), np.int64)
    for row, n in enumerate([7, 3, 5]):
        ids[row, :n], mask[row, :n] = rng.integers(3, 13, n), 1
    eager = EagerStepModel(model)
    settings = DecodeSettings(cfg.bos_id, cfg.eos_id, cfg.pad_id, 10)
    prefix = rng.integers(3, 17, (3, 4))

    def teacher_forced() -> list[np.ndarray]:
        state = eager.encode(ids, mask)
        logits, past = eager.step(prefix, mask, state, eager.empty_past(3))
        out = [logits]
        for t in range(3):
            logits, past = eager.step(prefix[:, t:t + 1], mask, state, past)
            out.append(logits)
        return out

    def without_bias() -> list[np.ndarray]:  # the control: the same model, the tables zeroed
        saved = [w.clone() for w in tables]
        with torch.no_grad():
            for w in tables:
                w.zero_()
        out = teacher_forced()
        with torch.no_grad():
            for w, s in zip(tables, saved):
                w.copy_(s)
        return out

    want = teacher_forced(), greedy_decode(eager, ids, mask, settings), beam_search(eager, ids, mask, settings, 3)
    unbiased = without_bias()
    with kernel_attention(model):
        got = teacher_forced(), greedy_decode(eager, ids, mask, settings), beam_search(eager, ids, mask, settings, 3)
    return {"logit_max_abs": [float(np.abs(g - w).max()) for g, w in zip(got[0], want[0])],
            "bias_effect": [float(np.abs(u - w).max()) for u, w in zip(unbiased, want[0])],
            "logit_scale": float(max(np.abs(w).max() for w in want[0])),
            "greedy": [got[1], want[1]], "beam": [got[2], want[2]]}


# --- in the parent -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def child() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, __file__], input=json.dumps(CASES), env=env, capture_output=True,
                          text=True, timeout=900)
    if proc.returncode != 0:
        pytest.fail(f"interpreter child exited with {proc.returncode}:\n{proc.stderr[-4000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"cases": {r["id"]: r for r in out["cases"]}, "t5": out["t5"]}


@pytest.mark.parametrize("case", [c for c in CASES if not c["control"]], ids=_case_id)
def test_bias_kernel_matches_reference(case, child):
    r = child["cases"][_case_id(case)]
    assert r["error"] is None, r["error"]
    assert r["output_excess"] <= 0.0, r
    assert r["present_exact"], "present K/V differ from past ++ new"
    keys = case["tgt_len"] + (case["kv_len"] if case["kind"] == "DECODER_SELF" else 0)
    if keys > 1 and not case["empty_row"]:  # one key (or a row with one kept) ignores any bias
        assert r["bias_effect"] > 10 * TOLERANCES[case["dtype"]][0], "the bias changes nothing: the test proves nothing"


@pytest.mark.parametrize("case", [c for c in CASES if c["control"]], ids=_case_id)
def test_a_misread_table_misses_the_reference(case, child):
    r = child["cases"][_case_id(case)]
    assert r["error"] is None, r["error"]
    assert r["output_excess"] > 0.0, "a flipped or head-swapped table passed: the comparison cannot fail"


def test_cases_cover_every_compiled_head_dim_and_both_paths():
    head_dims = {kernel_head_dim(c["head_dim"]) for c in CASES}
    assert head_dims >= {16, 32, 64, 128}
    assert any(c["kind"] == "DECODER_SELF" and c["tgt_len"] == 1 and c["kv_len"] > 128 for c in CASES)
    assert any(c["kind"] == "DECODER_SELF" and c["tgt_len"] > 64 for c in CASES)
    # a T5 table over more than two 64-query blocks: some tiles' spans are uniform, others gather
    assert any(c["table"] == "t5" and c["kind"] == "ENCODER_SELF" and c["tgt_len"] > 128 for c in CASES)


def test_t5_table_has_uniform_and_varying_tile_spans():
    """The premise of the bucketed cases: a 64 x 64 tile's 127-entry span is one value far from the diagonal and
    varies near it (else they would exercise one path of the kernel only)."""
    table = t5_table(ENC, 2, 150, 0)[0]
    # the kernel's span of tile (queries 64 m.., keys 64 n..) at T = L = M = 150: entries 149 + 64 (n - m)
    # + (-63 .. 63), clamped to the table
    spans = [table[(149 + 64 * d + torch.arange(-63, 64)).clamp(0, 298)] for d in (-2, 0, 2)]
    assert [bool((s == s[0]).all()) for s in spans] == [True, False, True]


def test_t5_model_decodes_through_the_kernels_as_eager(child):
    r = child["t5"]
    assert len(r["logit_max_abs"]) == 4
    assert max(r["bias_effect"]) > 1e-2 * max(1.0, r["logit_scale"]), "the bias changes no logit"
    assert max(r["logit_max_abs"]) <= 1e-4 * max(1.0, r["logit_scale"]), r
    got, want = r["greedy"]
    assert got == want and any(want)
    got, want = r["beam"]
    assert got == want


def test_launch_plan_refuses_a_table_too_short_and_a_bias_on_cross():
    from seq2trt.plugins.kernels.launch_plan import plan
    from seq2trt.core.errors import InputError

    dec = AttentionAttrs(DEC, 2, 64, 1.0)
    shapes = [(1, 1, 128)] * 3 + [(1, 2, 9, 64)] * 2
    ptrs = [4096 * (i + 1) for i in range(6)]
    with pytest.raises(InputError, match="M >= 10"):
        plan(dec, "fp16", shapes + [(2, 17)], ptrs, ptrs[:3], 1 << 20)  # M = 9 < past 9 + 1
    with pytest.raises(InputError, match="heads=2"):
        plan(dec, "fp16", shapes + [(3, 19)], ptrs, ptrs[:3], 1 << 20)
    launches = plan(dec, "fp16", shapes + [(2, 19)], ptrs, ptrs[:3], 1 << 20)
    split = launches[0]
    assert split.constexprs["HAS_BIAS"] == 1 and split.args["Bias"] == ptrs[5] and split.args["bias_off"] == 0
    assert split.args["stride_bh"] == 19
    cross = AttentionAttrs(AttentionKind.CROSS, 2, 64, 1.0)
    with pytest.raises(InputError, match="CROSS"):
        plan(cross, "fp16", [(1, 1, 128), (1, 2, 9, 64), (1, 2, 9, 64), (1, 9), (2, 19)], ptrs, ptrs[:1], 1 << 20)


# --- on a CUDA device (scripts/gpu_check.sh-style runs; skipped without one) ------------------------------------------

GPU_CHILD = """
import json, sys, torch
from seq2trt.plugins.cuda_launcher import CudaDriverLauncher
from seq2trt.plugins.eager_kernels import prepare_cubin
from seq2trt.plugins.kernels.launch_plan import TOLERANCES, attention, random_inputs
from seq2trt.plugins.op import AttentionAttrs, AttentionKind, reference_attention
index, cc, cases = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
launcher = CudaDriverLauncher(index, cc)
dtypes = {'fp32': torch.float32, 'fp16': torch.float16, 'bf16': torch.bfloat16}
out = []
for kind, dtype, t, kv, head_dim in cases:
    k = AttentionKind[kind]
    attrs, inputs = random_inputs(k, batch=2, heads=4, head_dim=head_dim, tgt_len=t, kv_len=kv, dtype=dtypes[dtype],
                                  seed=0, device='cuda', empty_row=k is AttentionKind.ENCODER_SELF,
                                  bias_positions=t + (kv if k is AttentionKind.DECODER_SELF else 0) + 3)
    attrs = AttentionAttrs(k, 4, head_dim, 1.0)
    ref = reference_attention(attrs, *(x.double() if x.is_floating_point() else x for x in inputs))[0]
    atol, rtol = TOLERANCES[dtype]
    for route, got in (('jit', attention(attrs, *inputs)[0]), ('aot', prepare_cubin(launcher, attrs, inputs)()[0])):
        torch.cuda.synchronize()
        excess = ((got.double() - ref).abs() - atol - rtol * ref.abs()).max().item()
        out.append({'case': [kind, dtype, t, kv, head_dim], 'route': route, 'excess': excess})
print(json.dumps(out))
"""
GPU_CASES = [[kind, dtype, t, kv, head_dim] for dtype in TOLERANCES
             for kind, t, kv, head_dim in (("ENCODER_SELF", 40, 40, 64), ("ENCODER_SELF", 1, 1, 64),
                                           ("DECODER_SELF", 9, 0, 64), ("DECODER_SELF", 70, 5, 64),
                                           ("DECODER_SELF", 1, 300, 64), ("ENCODER_SELF", 200, 200, 128),
                                           ("DECODER_SELF", 70, 5, 128), ("DECODER_SELF", 1, 1023, 64),
                                           ("DECODER_SELF", 1, 1023, 128))]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bias_kernels_on_the_device_jit_and_aot(tmp_path):
    """Triton's JIT and the AOT cubins (HEAD_DIM 64, T5's head_dim, and 128, compiled for this GPU and launched as
    the plugin's enqueue launches them) against the float64 reference, with the bias; pasts up to 1,023."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    major, minor = torch.cuda.get_device_capability()
    cc = 10 * major + minor
    compiled = subprocess.run([sys.executable, "-m", "seq2trt.plugins.kernels.aot", "--out", str(tmp_path),
                               "--targets", f"sm_{cc}", "--head-dims", "64,128"], env=env, capture_output=True,
                              text=True, timeout=900)
    assert compiled.returncode == 0, compiled.stderr[-4000:]
    run = subprocess.run([sys.executable, "-c", GPU_CHILD, str(tmp_path / "index.json"), str(cc),
                          json.dumps(GPU_CASES)], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(results) == 2 * len(GPU_CASES)
    assert not [r for r in results if not r["excess"] <= 0.0]


# --- plugin graphs on CPU (ONNX Runtime with the op's reference) ------------------------------------------------------

def _bias_inputs(kind: AttentionKind, seed: int = 0):
    from seq2trt.plugins.kernels.launch_plan import random_inputs

    attrs, inputs = random_inputs(kind, batch=2, heads=2, head_dim=8, tgt_len=5 if kind is ENC else 3, kv_len=4,
                                  dtype=torch.float64, seed=seed, empty_row=kind is ENC, bias_positions=9)
    return AttentionAttrs(kind, 2, 8, 1.0), inputs[:-1] + (inputs[-1] * 2,)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("kind", [ENC, DEC], ids=lambda k: k.name)
def test_plugin_graph_on_cpu_takes_the_bias(kind, dtype):
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from seq2trt.plugins.op import DOMAIN, OUTPUTS, PLUGIN_NAME, input_names
    from seq2trt.plugins.plugin_cpu import for_cpu, register_reference_ops

    attrs, inputs = _bias_inputs(kind)
    names = input_names(kind, position_bias=True)
    np_type, onnx_type = {"fp32": (np.float32, TensorProto.FLOAT), "fp16": (np.float16, TensorProto.FLOAT16)}[dtype]
    values = [helper.make_tensor_value_info(n, TensorProto.INT32 if n == "key_padding_mask" else onnx_type,
                                            list(x.shape)) for n, x in zip(names, inputs)]
    outputs = [helper.make_tensor_value_info(n, onnx_type, None) for n in OUTPUTS[kind]]
    node = helper.make_node(PLUGIN_NAME, list(names), list(OUTPUTS[kind]), name="block", domain=DOMAIN,
                            **attrs.onnx_attributes())
    model = helper.make_model(helper.make_graph([node], "block", values, outputs),
                              opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)])
    model.ir_version = 10
    options = ort.SessionOptions()
    options.register_custom_ops_library(register_reference_ops())
    session = ort.InferenceSession(for_cpu(model.SerializeToString(), dtype), options,
                                   providers=["CPUExecutionProvider"])
    feed = {n: x.numpy() if n == "key_padding_mask" else x.numpy().astype(np_type) for n, x in zip(names, inputs)}
    got = session.run(None, feed)
    rounded = tuple(x.to(torch.float16).double() if dtype == "fp16" and x.is_floating_point() else x for x in inputs)
    want = reference_attention(attrs, *rounded)
    unbiased = reference_attention(attrs, *rounded[:-1])
    atol = {"fp32": 1e-5, "fp16": 4e-3}[dtype]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.astype(np.float64), w.numpy(), atol=atol, rtol=atol)
    assert np.abs(got[0].astype(np.float64) - unbiased[0].numpy()).max() > 10 * atol  # the bias was applied


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1" or "triton" in sys.modules:
        raise SystemExit("run with TRITON_INTERPRET=1 and triton not yet imported")
    torch.set_num_threads(1)
    sys.path.insert(0, os.path.dirname(__file__))
    from test_kernels_interpret import _patch_interpreter_bf16_dot

    _patch_interpreter_bf16_dot()
    cases = _run_cases(json.load(sys.stdin))
    print(json.dumps({"cases": cases, "t5": _t5_decoding()}))
