"""A CTranslate2 timing worker: one Translator in its own process, driven by JSON lines on stdin.

Run by file path (`python ct2_worker.py MODEL_DIR THREADS COMPUTE_TYPE`), never imported as part of seq2trt: it
imports only ctranslate2 and the standard library, so its peak RSS is CTranslate2's, not PyTorch's. One
Translator per process because two in one process slow each other 10x on our 2-core machines (docs/design.md). It
runs with CTranslate2's defaults and the parent's environment (see bench_backends.CT2_ENV_KEYS).

Requests (one JSON object per line) and replies:
- {"op": "decode", "sources": [[token, ...], ...], "new_tokens": N, "forced": bool, "step_times": bool,
   optional "beam_size" (1), "length_penalty" (1.0), "num_hypotheses" (1), "return_scores" (false),
   "sampling_topk" (1: none), "sampling_temperature" (1.0), "sampling_topp" (1.0), "seed" (set_random_seed first)}
  -> {"seconds": wall time of translate_batch, "step_s": [seconds between steps 1..N-1] or null,
      "tokens": [[token, ...], ...] (every hypothesis of every source, in order), "scores": [...] or null}.
  `forced` makes every source decode exactly N tokens (eos masked until N).
- {"op": "memory"} -> {"peak_rss_mb": ...};  {"op": "quit"} -> exit.
"""

from __future__ import annotations

import json
import sys
import time


OPTIONS = {"beam_size": 1, "length_penalty": 1.0, "num_hypotheses": 1, "return_scores": False, "sampling_topk": 1,
           "sampling_temperature": 1.0, "sampling_topp": 1.0}


def decode(translator, request: dict) -> dict:
    import ctranslate2

    n = request["new_tokens"]
    if request.get("seed") is not None:
        ctranslate2.set_random_seed(request["seed"])
    marks: dict[int, float] = {}

    def on_token(step_result) -> bool:
        marks.setdefault(step_result.step, time.perf_counter())  # first row of each step: the step is done
        return False

    start = time.perf_counter()
    results = translator.translate_batch(
        request["sources"], **{k: request.get(k, v) for k, v in OPTIONS.items()}, max_decoding_length=n,
        min_decoding_length=n if request["forced"] else 0, max_input_length=0, callback=on_token if request["step_times"] else None)
    seconds = time.perf_counter() - start
    steps = [marks[s] for s in sorted(marks)]
    step_s = [b - a for a, b in zip(steps, steps[1:])] if request["step_times"] else None
    return {"seconds": seconds, "step_s": step_s, "tokens": [h for r in results for h in r.hypotheses],
            "scores": [s for r in results for s in r.scores] if request.get("return_scores") else None}


def peak_rss_mb() -> float:
    """VmHWM: this process image's peak RSS (ru_maxrss would include the parent's, inherited through fork)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def main(argv: list[str]) -> None:
    model_dir, threads, compute_type = argv[0], int(argv[1]), argv[2]
    import ctranslate2

    start = time.perf_counter()
    translator = ctranslate2.Translator(model_dir, device="cpu", compute_type=compute_type, inter_threads=1,
                                        intra_threads=threads)
    print(json.dumps({"ready": True, "load_s": time.perf_counter() - start}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "quit":
            break
        if request["op"] == "memory":
            reply = {"peak_rss_mb": peak_rss_mb()}
        else:
            reply = decode(translator, request)
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
