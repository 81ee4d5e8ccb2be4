"""The demo checkpoint's cache under concurrent use: two processes asking for the same uncached entry (two `seq2trt
demo` runs, two test workers) train it once; the second waits for the first one's checkpoint and reads it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = """
import json, sys
from pathlib import Path
from seq2trt.reference_model import train

calls = []
real = train.train
def counted(settings, progress=None):
    calls.append(1)
    return real(settings, progress)
train.train = counted
path = train.demo_checkpoint(Path(sys.argv[1]), train.TrainSettings(preset="tiny", steps=3, batch_size=8,
                                                                     warmup=1, eval_examples=20))
print(json.dumps({"path": str(path), "trained": len(calls)}))
"""


def test_two_processes_train_one_cache_entry_once(tmp_path):
    cache = tmp_path / "cache"
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(cache)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
             for _ in range(2)]
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-2000:]
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    assert results[0]["path"] == results[1]["path"]
    assert sorted(r["trained"] for r in results) == [0, 1]  # one trained, the other read its checkpoint
    entry = cache / results[0]["path"].rsplit("/", 1)[-1]
    assert json.loads((entry / "metrics.json").read_text())["settings"]["steps"] == 3
