"""Length-sorted batching (`decode_jobs.decode_batches`, windows of SORT_WINDOW batches) against batches in input
order, measured side by side (interleaved repetitions) through `seq2trt.Translator` on a numbers-task export:

    python benchmarks/length_sorting.py OUT [--backend ort-fused] [--sources 1024] [--batch-size 32] [--repeats 3]

Sources are random digit strings of 1-23 digits (the demo task's inputs); the outputs must be identical both ways.
SORT_WINDOW = 1 sorts inside each batch only, which is the input-order batching."""

from __future__ import annotations

import argparse
import time

import numpy as np

import seq2trt
from seq2trt.runtime import decode_jobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--backend", default="ort-fused")
    parser.add_argument("--sources", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    texts = ["".join(map(str, rng.integers(0, 10, rng.integers(1, 24)))) for _ in range(args.sources)]
    seconds, outputs = {}, {}
    sorted_window = decode_jobs.SORT_WINDOW
    with seq2trt.Translator(args.out, backend=args.backend, threads=1) as translator:
        translator.translate(texts[:64], batch_size=args.batch_size)  # warm-up
        for _ in range(args.repeats):
            for window in (1, sorted_window):
                decode_jobs.SORT_WINDOW = window
                start = time.perf_counter()
                out = translator.translate(texts, batch_size=args.batch_size)
                seconds.setdefault(window, []).append(time.perf_counter() - start)
                outputs[window] = [h.ids for h in out]
    decode_jobs.SORT_WINDOW = sorted_window
    assert outputs[1] == outputs[sorted_window], "length sorting changed an output"
    for window, label in ((1, "input order"), (sorted_window, f"sorted in windows of {sorted_window} batches")):
        print(f"{label:36s} " + " ".join(f"{s:.2f}" for s in seconds[window]) + " s")
    print(f"speedup (median): {np.median(seconds[1]) / np.median(seconds[sorted_window]):.2f}x; outputs identical")


if __name__ == "__main__":
    main()
