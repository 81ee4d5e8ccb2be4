"""The position-bias kernels against PyTorch SDPA with a dense additive bias (issue 46's speed target: >= 1.0x), timed
interleaved. Used by scripts/gpu_kernels.py (`--bias-speed-only` runs just this, a minute on a GPU).

Each case is T5-shaped: a T5 table (32 buckets, max distance 128; bidirectional for the encoder, causal for the
decoder) with scale 1. Ours: `launch_plan.attention` with the (H, 2M - 1) table. SDPA: what transformers' T5 runs,
the (B, H, T, L) position bias plus padding mask built once outside the timing (T5 builds it once per forward for all
layers), the head transposes and, for a decoder step, `torch.cat` of the past. Both also without any bias, so the
bias's own cost shows. Decoder steps are also timed at fixed flash-decoding split counts (the plan picks one from
`launch_plan.TARGET_PROGRAMS`), so one run says whether that choice is the fastest.

Timing: every route is captured in a CUDA graph (device time, no Python launch overhead), then the routes are
replayed in turn, round after round, each round a block of replays timed with CUDA events, the route order rotated
each round; the figure is each route's median over rounds. Interleaving spreads clock and thermal drift over all
routes alike. On a CPU (--device cpu, the interpreter) the same code runs with perf_counter and no graphs.
"""

from __future__ import annotations

import statistics
import time

# (name, kind, batch, heads, head_dim, tgt_len, kv_len): flan-t5-base (12 heads of 64) and a 128-wide head.
CASES = [
    ("encoder-self bias B8 S512 d64", "ENCODER_SELF", 8, 12, 64, 512, 512),
    ("encoder-self bias B8 S512 d128", "ENCODER_SELF", 8, 8, 128, 512, 512),
    ("decoder step bias B8 P1023 d64", "DECODER_SELF", 8, 12, 64, 1, 1023),
    ("decoder step bias B8 P1023 d128", "DECODER_SELF", 8, 8, 128, 1, 1023),
]
QUICK_CASES = [("encoder-self bias B1 S40 d32", "ENCODER_SELF", 1, 2, 32, 40, 40),
               ("decoder step bias B1 P33 d32", "DECODER_SELF", 1, 2, 32, 1, 33)]
DTYPES = ("fp32", "fp16", "bf16")
SPLITS = (4, 8, 16, 32, 64)  # fixed flash-decoding split counts timed beside the plan's own
BUCKETS, MAX_DISTANCE = 32, 128


def t5_inputs(case: tuple, dtype: str, device: str):
    """(attrs with scale 1, op inputs ending with a T5 table, the dense SDPA mask (B|1, H, T, L) in the op dtype)."""
    import torch

    from seq2trt.plugins.kernels.launch_plan import random_inputs
    from seq2trt.plugins.op import AttentionAttrs, AttentionKind
    from seq2trt.reference_model.model import relative_position_buckets

    name, kind, batch, heads, head_dim, t, s = case
    kind = AttentionKind[kind]
    encoder = kind is AttentionKind.ENCODER_SELF
    positions = t if encoder else s + t
    torch_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    attrs, inputs = random_inputs(kind, batch=batch, heads=heads, head_dim=head_dim, tgt_len=t, kv_len=s,
                                  dtype=torch_dtype, seed=0, device=device)
    g = torch.Generator().manual_seed(1)
    per_bucket = torch.randn(BUCKETS, heads, generator=g) * 2
    table = per_bucket[relative_position_buckets(positions, encoder, BUCKETS, MAX_DISTANCE)].t()  # (H, 2M - 1)
    table = table.to(torch_dtype).to(device).contiguous()
    first = positions - 1 - (0 if encoder else s)  # the table's column of key 0 for query 0
    keys = torch.arange(t if encoder else s + t, device=device)
    queries = torch.arange(t, device=device)
    dense = table[:, first + keys[None, :] - queries[:, None]][None]  # (1, H, T, L)
    if encoder:  # the padding mask folded in, as transformers' T5 adds its extended mask to the position bias
        hidden = inputs[3][:, None, None, :] == 0
        dense = dense.masked_fill(hidden, torch.finfo(torch_dtype).min)
    return AttentionAttrs(kind, heads, head_dim, 1.0), inputs + (table,), dense.contiguous()


def interleaved_ms(fns: dict, device: str, rounds: int, iters: int) -> dict:
    """{label: median ms per call} over `rounds` rounds of `iters` calls each, the labels' order rotated each round;
    on CUDA each fn is replayed from a CUDA graph captured once."""
    import torch

    if device == "cuda":
        graphs = {}
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up (and JIT-compile) outside the capture
            for fn in fns.values():
                for _ in range(3):
                    fn()
        torch.cuda.current_stream().wait_stream(stream)
        for label, fn in fns.items():
            graphs[label] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[label]):
                fn()
        fns = {label: g.replay for label, g in graphs.items()}
    else:
        for fn in fns.values():
            fn()
    times = {label: [] for label in fns}
    labels = list(fns)
    for r in range(rounds):
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            fn = fns[label]
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(iters):
                    fn()
                end.record()
                end.synchronize()
                times[label].append(start.elapsed_time(end) / iters)
            else:
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                times[label].append(1000 * (time.perf_counter() - t0) / iters)
    return {label: statistics.median(v) for label, v in times.items()}


def run_bias_speed(cases, dtypes, device: str, rounds: int, iters: int, torch_attention, compare,
                   reference) -> list[dict]:
    """Per case and dtype: the timings, SDPA / ours (>= 1.0 is the target) with and without the bias, the decode
    split counts' timings, and both outputs against the float64 reference (`compare`: within the dtype's
    tolerance), so that the two sides are shown to compute the same op."""
    from seq2trt.plugins.kernels.launch_plan import attention

    results = []
    for case in cases:
        decode = case[1] == "DECODER_SELF" and case[5] == 1
        for dtype in dtypes:
            row = {"name": case[0], "dtype": dtype, "batch": case[2], "heads": case[3], "head_dim": case[4]}
            try:
                attrs, inputs, dense = t5_inputs(case, dtype, device)
                plain = inputs[:-1]
                fns = {"ours": lambda: attention(attrs, *inputs),
                       "sdpa_dense_bias": lambda: torch_attention(attrs, plain, attn_mask=dense),
                       "ours_no_bias": lambda: attention(attrs, *plain),
                       "sdpa_no_bias": lambda: torch_attention(attrs, plain)}
                if decode and device == "cuda":
                    fns |= {f"ours_splits{n}": (lambda n=n: attention(attrs, *inputs, num_splits=n)) for n in SPLITS}
                ms = interleaved_ms(fns, device, rounds, iters)
                ref = reference(attrs, inputs)
                ours, sdpa = attention(attrs, *inputs), torch_attention(attrs, plain, attn_mask=dense)
                row |= {f"{k}_ms": round(v, 5) for k, v in ms.items()}
                row |= {"ratio": ms["sdpa_dense_bias"] / ms["ours"],
                        "ratio_no_bias": ms["sdpa_no_bias"] / ms["ours_no_bias"],
                        "max_abs_vs_sdpa": (ours[0].double() - sdpa[0].double()).abs().max().item(),
                        "ours_ok": compare(ours, ref, dtype)["ok"], "sdpa_ok": compare(sdpa[:1], ref[:1], dtype)["ok"]}
                if decode and device == "cuda":
                    best = min(SPLITS, key=lambda n: ms[f"ours_splits{n}"])
                    row |= {"best_splits": best, "best_splits_ratio": ms["sdpa_dense_bias"] / ms[f"ours_splits{best}"]}
            except Exception as exc:  # noqa: BLE001  one case's failure is recorded; the others still run
                row["error"] = f"{type(exc).__name__}: {exc}"
            results.append(row)
    return results


def print_bias_speed(rows: list[dict]) -> None:
    print("position bias vs SDPA with a dense additive bias (CUDA graphs, interleaved; >= 1.00 is the target):")
    for r in rows:
        if "error" in r:
            print(f"  {r['name']:32s} {r['dtype']}  error: {r['error']}")
            continue
        splits = f"  best splits {r['best_splits']}: x{r['best_splits_ratio']:.2f}" if "best_splits" in r else ""
        print(f"  {r['name']:32s} {r['dtype']}  ours {r['ours_ms']:.4f} ms  sdpa+bias {r['sdpa_dense_bias_ms']:.4f} ms"
              f"  x{r['ratio']:.2f} {'MET' if r['ratio'] >= 1.0 else 'missed'}  | no bias x{r['ratio_no_bias']:.2f}"
              f"{splits}")
