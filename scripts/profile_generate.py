"""Profile OUT/generate/ort/generate.onnx with ONNX Runtime's profiler (benchmarks/README.md).

usage: python scripts/profile_generate.py OUT BATCH [BEAMS]
Runs beam search (default 4 beams, length penalty 0.6, at most 63 new tokens) 3 times on the first BATCH held-out
sources of the checkpoint's task (random ids without one), 1 thread, with the ort-generate backend's session settings
(generate_backend.session_options), and prints the BeamSearch node's time per run, the time of the subgraphs' kernels
by op type, and what is left outside them (search, feeds, KV reorder).
"""
import json, sys, glob, os, collections
import numpy as np, onnxruntime as ort
from pathlib import Path
from seq2trt.exporters.manifest import verify
from seq2trt.runtime.reference_loader import e2e_sources
from seq2trt.reference_model.vocab import pad_batch
from seq2trt.runtime.ort_search import session_options
out, B = Path(sys.argv[1]), int(sys.argv[2])
K = int(sys.argv[3]) if len(sys.argv) > 3 else 4
import tempfile
prefix = tempfile.mkdtemp() + "/generate"
m = verify(out)
o, disabled = session_options(ort, 1, int8=False)  # the ort-generate backend's session settings
o.enable_profiling = True; o.profile_file_prefix = prefix
s = ort.InferenceSession(str(out / "generate/ort/generate.onnx"), o, providers=["CPUExecutionProvider"],
                         disabled_optimizers=disabled)
task = (m.data.get("source") or {}).get("task")
src, _ = e2e_sources(m.config, task, B, 0)
ids, mask = pad_batch(src, m.config.pad_id)
feed = {"input_ids": ids.astype(np.int32), "attention_mask": mask.astype(np.int32), "max_length": np.array([min(64, m.limits.max_tgt_len)], np.int32),
        "min_length": np.array([0], np.int32), "num_beams": np.array([K], np.int32), "length_penalty": np.array([0.6], np.float32)}
if "repetition_penalty" in [i.name for i in s.get_inputs()]:  # an input of generate.onnx since 2026-12-02
    feed["repetition_penalty"] = np.array([1.0], np.float32)
if "num_return_sequences" in [i.name for i in s.get_inputs()]:  # an input since 2026-12-03
    feed["num_return_sequences"] = np.array([1], np.int32)
for _ in range(3):
    seq = s.run(None, feed)[0]
path = s.end_profiling()
ev = json.load(open(path))
nodes = [e for e in ev if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
top = [e for e in nodes if e["args"].get("op_name") == "BeamSearch"]
total = sum(e["dur"] for e in top) / len(top)
by = collections.Counter()
for e in nodes:
    if e["args"].get("op_name") != "BeamSearch":
        by[e["args"].get("op_name")] += e["dur"]
runs = len(top)
steps = int((seq[:, 0] != m.config.eos_id).sum(1).max())
sub = sum(by.values()) / runs
print(f"B={B} beam {K}: BeamSearch node {total/1e3:.2f} ms per run, subgraph kernels {sub/1e3:.2f} ms, "
      f"outside the kernels (search, feeds, KV reorder) {(total-sub)/1e3:.2f} ms; ~{steps} decoder steps")
for op, d in by.most_common(10):
    print(f"  {op:28s} {d/runs/1e3:7.3f} ms/run  {100*d/runs/total:5.1f}%")
os.remove(path)
