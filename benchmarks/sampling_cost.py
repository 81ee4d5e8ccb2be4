"""Sampling's extra cost over greedy per decoding step, transformers' exact stream against --fast-sampling, measured
side by side (interleaved repetitions, paired ratios) through `seq2trt.Translator` on an export.

    python benchmarks/sampling_cost.py OUT [--backend ort-fused] [--batch-sizes 1,32] [--repeats 5] [--new-tokens 32]

Every decode runs exactly --new-tokens tokens (min_new_tokens; one more allowed for a forced eos) on seeded random
sources of 31 ids + eos; top-k 50 (Hugging Face's default). Besides the end-to-end ratio (which a loaded machine's
noise in the model's own step moves by several percent), the time spent inside the sampler (`decoding._Sampler`: the
warpers and the draw, everything sampling adds to a greedy step) is measured in the same runs and given per step and
as a fraction of the greedy step."""

from __future__ import annotations

import argparse
import time

import numpy as np

import seq2trt
from seq2trt.reference_model import decoding


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--backend", default="ort-fused")
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    n = args.new_tokens
    inside = {"seconds": 0.0}
    draw = decoding._Sampler.__call__

    def timed(self, *a, **k):  # the sampler's own time: what sampling adds to a greedy step
        start = time.perf_counter()
        try:
            return draw(self, *a, **k)
        finally:
            inside["seconds"] += time.perf_counter() - start

    decoding._Sampler.__call__ = timed
    modes = {"greedy": {}, "sample": dict(sample=True, seed=1), "sample --fast-sampling":
             dict(sample=True, seed=1, fast_sampling=True)}
    with seq2trt.Translator(args.out, backend=args.backend, threads=1) as translator:
        vocab = translator.config.src_vocab_size
        rng = np.random.default_rng(0)
        batches = [int(b) for b in args.batch_sizes.split(",")]
        sources = [[int(i) for i in rng.integers(3, vocab - 1, 31)] + [translator.config.eos_id]
                   for _ in range(max(batches))]
        for b in batches:
            batch, seconds, sampler = sources[:b], {m: [] for m in modes}, {m: [] for m in modes}
            for rep in range(args.repeats + 1):  # the first round warms up
                for mode, options in modes.items():
                    start, inside["seconds"] = time.perf_counter(), 0.0
                    out = translator.generate(batch, beam_size=1, max_new_tokens=n + 1, min_new_tokens=n, batch_size=b,
                                              **options)
                    if rep:
                        seconds[mode].append(time.perf_counter() - start)
                        sampler[mode].append(inside["seconds"])
                    assert all(len(h.ids) == n for h in out), "a decode did not run exactly --new-tokens steps"
            greedy = np.asarray(seconds["greedy"])
            for mode in modes:
                x = np.asarray(seconds[mode])
                own = np.asarray(sampler[mode])
                print(f"B={b:<3} {mode:24s} step p50 {np.median(x) / n * 1e3:8.2f} ms   extra over greedy "
                      f"{np.median(x / greedy - 1) * 100:+6.1f}% (median of paired repetitions)   inside the sampler "
                      f"{np.median(own) / n * 1e3:6.2f} ms a step, {np.median(own / greedy) * 100:5.1f}% of greedy's")


if __name__ == "__main__":
    main()
