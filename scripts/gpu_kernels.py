"""GPU check of the attention kernels: correctness against the float64 reference, then timing against PyTorch.

    python scripts/gpu_kernels.py OUT_DIR [--aot-index INDEX.json] [--quick]
    python scripts/gpu_kernels.py OUT_DIR --bias-speed-only             # T5 bias vs SDPA + dense bias, ~1 minute
    python scripts/gpu_kernels.py OUT_DIR --device cpu --quick     # the same code on CPU, in triton's interpreter

Writes OUT_DIR/gpu_kernels.json and exits non-zero when a check fails:
- "correctness": every kind x dtype x head_dim (each compiled HEAD_DIM, and head dims padded up to one) over awkward
  lengths (1, 7, 65, 200; past 0 and > 0) and all-padding source rows (which return the mean of V), run through
  `kernels.launch_plan.attention` (triton's JIT on the device) against `plugins.op.reference_attention` in float64,
  within `kernels.launch_plan.TOLERANCES`; present K/V must equal past ++ new exactly;
- "aot" (with --aot-index): the same cases through the ahead-of-time cubins, loaded and launched as the TensorRT
  plugin does (`plugins.cuda_launcher.CudaDriverLauncher`, cuda-python), no triton JIT involved;
- "bias_speed" (scripts/gpu_kernels_bias.py): T5's position-bias kernels against SDPA with a dense additive bias,
  timed interleaved from CUDA graphs, SDPA / ours per case (the target is >= 1.0: "bias_speed_target_met"), with and
  without the bias, and decoder steps at fixed split counts; `--bias-speed-only` runs just these;
- "benchmarks": median milliseconds (CUDA events, warmup) of the op through our kernels (triton's JIT launcher, and
  with --aot-index the AOT cubins launched as the plugin's enqueue launches them) and through the unfused
  PyTorch equivalent: head transposes, torch.cat of the past for decoder self-attention, and
  torch.nn.functional.scaled_dot_product_attention with the boolean mask; plus the ratio. Each is timed called
  from Python ("*_ms", launch overhead included) and replayed from a CUDA graph ("*_graph_ms", device time).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

LENGTHS = {  # (tgt_len, kv_len): kv_len is the source length (CROSS) or the past length (DECODER_SELF)
    "ENCODER_SELF": [(1, 1), (7, 7), (65, 65), (200, 200)],
    "CROSS": [(1, 200), (7, 65), (65, 7), (200, 1)],
    "DECODER_SELF": [(1, 0), (1, 200), (7, 0), (65, 17), (200, 65)],
}
QUICK_LENGTHS = {"ENCODER_SELF": [(7, 7)], "CROSS": [(1, 65)], "DECODER_SELF": [(1, 9), (17, 5)]}
# (name, kind, batch, heads, head_dim, tgt_len, kv_len): a d512/8-head model's shapes, and a long past.
BENCHMARKS = [
    ("encoder-self B8 S128", "ENCODER_SELF", 8, 8, 64, 128, 128),
    ("encoder-self B8 S512", "ENCODER_SELF", 8, 8, 64, 512, 512),
    ("cross step B8 S512", "CROSS", 8, 8, 64, 1, 512),
    ("cross prefill B8 T64 S512", "CROSS", 8, 8, 64, 64, 512),
    ("decoder step B8 P127", "DECODER_SELF", 8, 8, 64, 1, 127),
    ("decoder step B32 P511", "DECODER_SELF", 32, 8, 64, 1, 511),
    ("decoder step B1 H8 d128 P4095", "DECODER_SELF", 1, 8, 128, 1, 4095),
    ("decoder prefill B8 T128 P0", "DECODER_SELF", 8, 8, 64, 128, 0),
]
QUICK_BENCHMARKS = [("decoder step B2 P33", "DECODER_SELF", 2, 2, 32, 1, 33)]


HEAD_DIMS = (8, 32, 40, 64, 96, 128, 256)  # every compiled HEAD_DIM (8 runs 16's), 40 and 96 masked within 64 and 128


def correctness_cases(quick: bool, dtypes=("fp32", "fp16", "bf16")) -> list[dict]:
    lengths = QUICK_LENGTHS if quick else LENGTHS
    head_dims = (64,) if quick else HEAD_DIMS
    cases = [{"kind": kind, "dtype": dtype, "head_dim": hd, "tgt_len": t, "kv_len": s, "batch": 2, "heads": 4,
              "seed": seed}
             for seed, (kind, dtype, hd) in enumerate((k, d, h) for k in lengths for d in dtypes for h in head_dims)
             for t, s in lengths[kind]]
    empty_rows = [("CROSS", 1, 65)] if quick else \
        [("ENCODER_SELF", 65, 65), ("CROSS", 1, 200), ("CROSS", 7, 65)]
    return cases + [{"kind": kind, "dtype": dtype, "head_dim": 64, "tgt_len": t, "kv_len": s, "batch": 2,
                     "heads": 4, "seed": 1000 + i, "empty_row": True}
                    for i, (dtype, (kind, t, s)) in enumerate((d, e) for d in dtypes for e in empty_rows)]


def compare(got, ref, dtype: str) -> dict:
    """Errors of the kernel's outputs against the float64 reference's; passes within launch.TOLERANCES."""
    from seq2trt.plugins.kernels.launch_plan import TOLERANCES

    atol, rtol = TOLERANCES[dtype]
    diff = (got[0].double() - ref[0]).abs()
    excess = (diff - atol - rtol * ref[0].abs()).max().item()
    present_exact = all(bool((g == e.to(g.dtype)).all()) for g, e in zip(got[1:], ref[1:]))
    return {"max_abs": diff.max().item(), "excess": excess, "present_exact": present_exact,
            "ok": excess <= 0.0 and present_exact}


def _inputs(case: dict, device: str):
    import torch

    from seq2trt.plugins.kernels.launch_plan import random_inputs
    from seq2trt.plugins.op import AttentionKind

    dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    return random_inputs(AttentionKind[case["kind"]], batch=case["batch"], heads=case["heads"],
                         head_dim=case["head_dim"], tgt_len=case["tgt_len"], kv_len=case["kv_len"],
                         dtype=dtypes[case["dtype"]], seed=case["seed"], device=device,
                         empty_row=case.get("empty_row", False))


def _reference(attrs, inputs):
    from seq2trt.plugins.op import reference_attention

    return reference_attention(attrs, *(x.double() if x.is_floating_point() else x for x in inputs))


def run_correctness(cases: list[dict], device: str, run) -> list[dict]:
    """run(attrs, inputs) -> outputs; each case's errors, or the exception it raised."""
    results = []
    for case in cases:
        try:
            attrs, inputs = _inputs(case, device)
            results.append({**case, **compare(run(attrs, inputs), _reference(attrs, inputs), case["dtype"])})
        except Exception as exc:  # one broken variant must not hide the others
            results.append({**case, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                            "traceback": traceback.format_exc(limit=4)})
    return results


def aot_launcher(index: Path):
    """prepare(attrs, inputs) -> launch(): the AOT cubins loaded and launched as the TensorRT plugin's enqueue does
    (`plugins.cuda_launcher.CudaDriverLauncher`, cuda-python; `plugins.eager_kernels.prepare_cubin`), into outputs
    allocated once; launch() returns them without synchronizing, like an enqueue."""
    import torch

    from seq2trt.plugins.cuda_launcher import CudaDriverLauncher
    from seq2trt.plugins.eager_kernels import prepare_cubin

    major, minor = torch.cuda.get_device_capability()
    launcher = CudaDriverLauncher(index, 10 * major + minor)
    return lambda attrs, inputs: prepare_cubin(launcher, attrs, inputs)


def aot_runner(prepare):
    """run(attrs, inputs) through the AOT cubins (`aot_launcher`'s prepare), synchronized."""
    import torch

    def run(attrs, inputs):
        outputs = prepare(attrs, inputs)()
        torch.cuda.synchronize()
        return outputs

    return run


def torch_attention(attrs, inputs, attn_mask=None):
    """The op unfused in PyTorch: head transposes, the past concatenated, scaled_dot_product_attention. `attn_mask`
    (broadcastable to (B, H, T, L)) replaces the op's own mask and must contain it (a dense additive bias does)."""
    import torch
    import torch.nn.functional as F

    from seq2trt.plugins.op import AttentionKind

    query = inputs[0]
    B, T, D = query.shape
    H, Dh = attrs.num_heads, attrs.head_dim
    heads = lambda x: x.view(B, -1, H, Dh).transpose(1, 2)  # noqa: E731  (B, H, L, Dh)
    q = heads(query)
    if attrs.kind is AttentionKind.DECODER_SELF:
        k = torch.cat([inputs[3], heads(inputs[1])], dim=2)  # (B, H, P + T, Dh)
        v = torch.cat([inputs[4], heads(inputs[2])], dim=2)
        P = inputs[3].shape[2]
        mask = torch.ones(T, P + T, dtype=torch.bool, device=query.device).tril(P) if T > 1 else None
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask if attn_mask is None else attn_mask,
                                             scale=attrs.scale)
        return out.transpose(1, 2).reshape(B, T, D), k, v
    k, v = (heads(inputs[1]), heads(inputs[2])) if attrs.kind is AttentionKind.ENCODER_SELF else inputs[1:3]
    mask = (inputs[3] != 0)[:, None, None, :] if attn_mask is None else attn_mask  # (B, 1, 1, S)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attrs.scale)
    return (out.transpose(1, 2).reshape(B, T, D),)


def median_ms(fn, device: str, warmup: int, iters: int) -> float:
    """Median wall time of fn() in milliseconds: CUDA events on a GPU, perf_counter on CPU."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def graph_ms(fn, warmup: int, iters: int) -> float:
    """Median milliseconds of fn replayed from a CUDA graph: device time without Python's launch overhead,
    closer to what a TensorRT engine pays per plugin call."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (and JIT-compile) outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay, "cuda", warmup, iters)


def run_benchmarks(specs, dtypes, device: str, warmup: int, iters: int, aot_prepare=None) -> list[dict]:
    """Per spec and dtype: our kernels through triton's JIT launcher and (with aot_prepare) through the AOT cubins as
    the plugin launches them, against the unfused PyTorch op; called from Python ("*_ms") and on a GPU also
    replayed from a CUDA graph ("*_graph_ms": device time alone)."""
    from seq2trt.plugins.kernels.launch_plan import attention

    results = []
    for name, kind, batch, heads, head_dim, t, s in specs:
        for dtype in dtypes:
            case = {"name": name, "kind": kind, "dtype": dtype, "batch": batch, "heads": heads, "head_dim": head_dim,
                    "tgt_len": t, "kv_len": s, "seed": 0}
            try:
                attrs, inputs = _inputs(case, device)
                ours = median_ms(lambda: attention(attrs, *inputs), device, warmup, iters)
                sdpa = median_ms(lambda: torch_attention(attrs, inputs), device, warmup, iters)
                same = compare(attention(attrs, *inputs), [x.double() for x in torch_attention(attrs, inputs)], dtype)
                results.append({**case, "triton_ms": ours, "torch_sdpa_ms": sdpa, "speedup": sdpa / ours,
                                "max_abs_vs_sdpa": same["max_abs"]})
                timed = {"triton": lambda: attention(attrs, *inputs),
                         "torch_sdpa": lambda: torch_attention(attrs, inputs)}
                if aot_prepare is not None:
                    launch = aot_prepare(attrs, inputs)
                    results[-1]["aot_ms"] = median_ms(launch, device, warmup, iters)
                    results[-1]["aot_speedup"] = sdpa / results[-1]["aot_ms"]
                    timed["aot"] = launch
                if device == "cuda":
                    try:
                        for label, fn in timed.items():
                            results[-1][f"{label}_graph_ms"] = graph_ms(fn, warmup, iters)
                        r = results[-1]
                        r["graph_speedup"] = r["torch_sdpa_graph_ms"] / r["triton_graph_ms"]
                    except Exception as exc:  # the eager figures stand on their own
                        results[-1]["graph_error"] = f"{type(exc).__name__}: {exc}"
            except Exception as exc:
                results.append({**case, "error": f"{type(exc).__name__}: {exc}"})
    return results


def versions() -> dict:
    import torch
    import triton

    info = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__}
    if torch.cuda.is_available():
        info |= {"device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
                 "cuda": torch.version.cuda}
    return info


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu runs triton's interpreter (slow; use with --quick)")
    parser.add_argument("--aot-index", type=Path, help="index.json of `python -m seq2trt.plugins.kernels.aot`")
    parser.add_argument("--quick", action="store_true", help="a few cases and one small benchmark")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds of the position-bias timings")
    bias = parser.add_mutually_exclusive_group()
    bias.add_argument("--bias-speed-only", action="store_true",
                      help="only the position-bias kernels against SDPA with a dense bias (gpu_kernels_bias.py)")
    bias.add_argument("--no-bias-speed", action="store_true", help="everything but the position-bias timings")
    return parser


def _write_report(out_dir: Path, report: dict, ok: bool, start: float) -> int:
    report["ok"] = ok
    report["seconds"] = round(time.perf_counter() - start, 1)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_kernels.json").write_text(json.dumps(report, indent=1, default=str))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.device == "cpu":
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--device cpu needs TRITON_INTERPRET=1 before triton is imported")
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from seq2trt.plugins.kernels.launch_plan import attention

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device visible to torch; use --device cpu --quick for a CPU run")
    import gpu_kernels_bias

    start = time.perf_counter()
    report = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
              "versions": versions()}
    bias_cases = [] if args.no_bias_speed else gpu_kernels_bias.QUICK_CASES if args.quick else gpu_kernels_bias.CASES
    report["bias_speed"] = gpu_kernels_bias.run_bias_speed(
        bias_cases, ("fp32",) if args.device == "cpu" else gpu_kernels_bias.DTYPES, args.device,
        2 if args.quick else args.rounds, args.iters, torch_attention, compare, _reference)
    speeds = [r.get("ratio", 0.0) for r in report["bias_speed"]]
    report["bias_speed_target_met"] = bool(speeds) and min(speeds) >= 1.0
    if speeds:
        gpu_kernels_bias.print_bias_speed(report["bias_speed"])
    bias_ok = all("error" not in r and r["ours_ok"] for r in report["bias_speed"])
    if args.bias_speed_only:
        return _write_report(args.out_dir, report, bias_ok, start)
    # triton's interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584): no bf16 on CPU.
    dtypes = ("fp32", "fp16") if args.device == "cpu" else ("fp32", "fp16", "bf16")
    cases = correctness_cases(args.quick, dtypes)
    report["correctness"] = run_correctness(cases, args.device, lambda a, x: attention(a, *x))
    aot_prepare = None
    if args.aot_index is not None:
        try:
            aot_prepare = aot_launcher(args.aot_index)
            report["aot"] = run_correctness(cases, args.device, aot_runner(aot_prepare))
        except Exception as exc:
            report["aot"] = [{"ok": False, "error": f"{type(exc).__name__}: {exc}"}]
    specs = QUICK_BENCHMARKS if args.quick else BENCHMARKS
    report["benchmarks"] = run_benchmarks(specs, ("fp16",) if args.quick else ("fp16", "bf16"), args.device,
                                          args.warmup, args.iters, aot_prepare)
    checks = report["correctness"] + report.get("aot", [])
    report["failed"] = [{k: c.get(k) for k in ("kind", "dtype", "head_dim", "tgt_len", "kv_len", "max_abs", "error")}
                        for c in checks if not c["ok"]]
    report["ok"] = bias_ok and not report["failed"] and not any("error" in b for b in report["benchmarks"])
    _write_report(args.out_dir, report, report["ok"], start)
    print(f"kernels: {sum(c['ok'] for c in checks)}/{len(checks)} checks passed; "
          f"{len(report['benchmarks'])} benchmarks; {report['seconds']}s -> {args.out_dir / 'gpu_kernels.json'}")
    for b in report["benchmarks"]:
        if "error" not in b:
            aot = f"  aot {b['aot_ms']:.4f} ms" if "aot_ms" in b else ""
            graph = (f"  | graph: triton {b['triton_graph_ms']:.4f} ms  sdpa {b['torch_sdpa_graph_ms']:.4f} ms"
                     f"  x{b['graph_speedup']:.2f}") if "graph_speedup" in b else ""
            graph += f"  aot {b['aot_graph_ms']:.4f} ms" if "aot_graph_ms" in b else ""
            print(f"  {b['name']:30s} {b['dtype']}  triton {b['triton_ms']:.4f} ms{aot}"
                  f"  sdpa {b['torch_sdpa_ms']:.4f} ms  x{b['speedup']:.2f}{graph}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
