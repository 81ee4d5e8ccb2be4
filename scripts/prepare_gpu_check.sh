#!/usr/bin/env bash
# Prepare, on a CPU machine, what scripts/gpu_check.sh needs beside it (the steps are PREPARE in
# scripts/gpu_check_plan.py, which the dry run resolves):
#   .whl/seq2trt-*.whl   seq2trt itself (pure Python; the GPU machine has torch, onnx, triton, transformers, ...)
#   .gpu/ckpt/           the demo checkpoint (trained once and cached by `seq2trt demo` / `seq2trt train`)
#   .gpu/kernels/        the attention kernels compiled ahead of time for sm_90 (150 variants, about 25 MB)
#   .gpu/ort/part-K/     onnxruntime-gpu's wheel (~256 MB) in parts of <= 56 MiB, each with the sha256 manifest
# All git-ignored. Then follow docs/gpu-check.md: `scripts/gpu_check.sh --calls` prints the device calls in order.
# SEQ2TRT_ORT_GPU_VERSION (default 1.31.1, the CUDA 13 build that ran on the H200); SEQ2TRT_ORT_GPU=0 skips it.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${SEQ2TRT_PYTHON:-python3}"
rm -rf .whl .gpu
mkdir -p .whl .gpu
"$py" -m pip wheel -q --no-deps -w .whl .
"$py" scripts/gpu_check.py checkpoint .gpu/ckpt
"$py" -m seq2trt.plugins.kernels.aot --targets sm_90 --out .gpu/kernels
if [ "${SEQ2TRT_ORT_GPU:-1}" != 0 ]; then
    # the GPU machine's Python (3.12, x86-64 manylinux), whatever this machine runs
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .gpu/download "onnxruntime-gpu==${SEQ2TRT_ORT_GPU_VERSION:-1.31.1}"
    "$py" scripts/gpu_check_ort.py split .gpu/download/onnxruntime_gpu-*.whl .gpu/ort
    rm -rf .gpu/download
fi
du -sh .whl .gpu/ckpt .gpu/kernels .gpu/ort 2>/dev/null || true
"$py" scripts/gpu_check_plan.py calls
