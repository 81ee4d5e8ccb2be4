#!/usr/bin/env bash
# Prepare what scripts/gpu_check.sh needs beside it, on a CPU machine (no GPU needed):
#   .whl/seq2trt-*.whl   seq2trt itself (pure Python; the GPU machine has torch, onnx, onnxruntime, triton, ...)
#   .gpu/ckpt/           the demo checkpoint (trained once and cached by `seq2trt demo` / `seq2trt train`)
#   .gpu/kernels/        the attention kernels compiled ahead of time for sm_90 (about 7 MB)
# Both folders are git-ignored; carry them to the GPU machine (device tool: carry [".whl", ".gpu"]), then run
#   scripts/gpu_check.sh "$OUT"
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl .gpu
mkdir -p .whl .gpu
python3 -m pip wheel -q --no-deps -w .whl .
python3 - <<'PY'
import shutil
from seq2trt.reference_model.train import demo_checkpoint
shutil.copytree(demo_checkpoint(), ".gpu/ckpt")
PY
python3 -m seq2trt.plugins.kernels.aot --targets sm_90 --out .gpu/kernels
du -sh .whl .gpu
