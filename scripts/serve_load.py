"""Load a running `seq2trt serve` (model `generate`) with N concurrent clients; print tokens/s, latency p50/p99 and
the server's batch-size histogram (from Triton's statistics) per concurrency, as JSON lines.

    python scripts/serve_load.py --url 127.0.0.1:8000 --concurrency 1,8,64 --requests 20 --task numbers
    python scripts/serve_load.py --offline OUT --batch 32     # the same sources decoded in-process, no server

Sources: the task's held-out pairs (source ids + eos), the same for every run. Tokens: generated ids + eos.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def sources(task_name: str, n: int) -> list[list[int]]:
    from seq2trt.reference_model.tasks import get_task
    from seq2trt.reference_model.vocab import EOS_ID

    task = get_task(task_name)
    return [task.source_vocab.encode(s) + [EOS_ID] for s, _ in task.heldout(n)]


def batch_stats(url: str) -> dict[int, int]:
    stats = json.loads(urllib.request.urlopen(f"http://{url}/v2/models/generate/stats", timeout=10).read())
    return {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in stats["model_stats"][0]["batch_stats"]}


def run(url: str, srcs: list[list[int]], clients: int, per_client: int, beam: int) -> dict:
    import tritonclient.http as http

    latencies, tokens, lock = [], [0], threading.Lock()

    def one(k: int) -> None:
        c = http.InferenceServerClient(url, network_timeout=300)
        for r in range(per_client):
            ids = np.array([srcs[(k * per_client + r) % len(srcs)]], dtype=np.int64)
            inputs = [http.InferInput("input_ids", list(ids.shape), "INT64"),
                      http.InferInput("beam_size", [1, 1], "INT32")]
            inputs[0].set_data_from_numpy(ids)
            inputs[1].set_data_from_numpy(np.array([[beam]], dtype=np.int32))
            start = time.perf_counter()
            out = c.infer("generate", inputs).as_numpy("output_ids")
            with lock:
                latencies.append(time.perf_counter() - start)
                tokens[0] += out.shape[1] + 1
        c.close()

    before = batch_stats(url)
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, range(clients)))
    wall = time.perf_counter() - start
    after = batch_stats(url)
    histogram = {size: after.get(size, 0) - before.get(size, 0) for size in sorted(after)}
    return {"clients": clients, "requests": len(latencies), "beam": beam, "seconds": round(wall, 3),
            "tokens_per_s": round(tokens[0] / wall, 1), "requests_per_s": round(len(latencies) / wall, 1),
            "p50_ms": round(1000 * float(np.percentile(latencies, 50)), 2),
            "p99_ms": round(1000 * float(np.percentile(latencies, 99)), 2),
            "batches": {k: v for k, v in histogram.items() if v}}


def offline(out: str, srcs: list[list[int]], batch: int, beam: int, threads: int, repeats: int) -> dict:
    from pathlib import Path

    from seq2trt.serving.decode_service import DecodeService, Job

    service = DecodeService(Path(out), "ort-fused", threads=threads)
    jobs = [Job(tuple(s), beam_size=beam) for s in srcs]
    best = None
    for _ in range(repeats):
        start, tokens = time.perf_counter(), 0
        for i in range(0, len(jobs), batch):
            tokens += sum(len(r) + 1 for r in service.run(jobs[i: i + batch]))
        wall = time.perf_counter() - start
        best = max(best or 0, tokens / wall)
    service.close()
    return {"offline_batch": batch, "beam": beam, "tokens_per_s": round(best, 1), "sources": len(srcs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="127.0.0.1:8000")
    parser.add_argument("--concurrency", default="1,8,64")
    parser.add_argument("--requests", type=int, default=20, help="per client")
    parser.add_argument("--beam-size", "--beam", dest="beam", type=int, default=1)  # --beam: the old spelling
    parser.add_argument("--task", default="numbers")
    parser.add_argument("--sources", type=int, default=256)
    parser.add_argument("--offline", help="export directory: decode in-process instead (no server)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    srcs = sources(args.task, args.sources)
    if args.offline:
        print(json.dumps(offline(args.offline, srcs, args.batch, args.beam, args.threads, args.repeats)))
        return
    run(args.url, srcs, 8, 4, args.beam)  # warm-up
    for clients in (int(c) for c in args.concurrency.split(",")):
        print(json.dumps(run(args.url, srcs, clients, args.requests, args.beam)), flush=True)


if __name__ == "__main__":
    main()
