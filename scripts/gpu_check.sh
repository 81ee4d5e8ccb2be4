#!/usr/bin/env bash
# The one prepared command for the GPU test machine (docs/design.md, "The GPU check").
#
#   scripts/gpu_check.sh OUT_DIR
#
# Runs every GPU-only check of seq2trt and writes JSON results into OUT_DIR, within about 8 minutes (each step but
# kernels and gpu_tests is a subcommand of scripts/gpu_check.py):
#   env.json          the machine: GPU, driver, torch / triton / onnxruntime versions, providers, TensorRT flavours
#   kernels/          Triton attention kernels on the device vs the float64 reference, through triton's JIT and,
#                     when .gpu/kernels/index.json was carried, through the ahead-of-time cubins as the plugin
#                     launches them; timed against torch's scaled_dot_product_attention (scripts/gpu_kernels.py)
#   eager_cuda.json   the demo checkpoint on CUDA: held-out exact match, agreement with the CPU model (greedy and
#                     beam) and greedy tokens/s; again with every attention block computed by the plugin's kernels
#                     (triton's JIT, and the AOT cubins launched as the plugin launches them)
#   validate.json     `seq2trt validate` of the demo export (plain, fused-ort, fused-trt) with the CUDA provider
#                     when onnxruntime-gpu is present; without it a record that the step was skipped (CI covers
#                     the CPU provider)
#   bench.json/.md    `seq2trt bench` of the demo export: eager on the CPU and on CUDA, ONNX Runtime (plain and fused)
#                     and TensorRT where engines were built; tokens/s and ratios (latency.md as bench.md)
#   tensorrt.json     engines built and run where a TensorRT flavour loads, else why none could
#   gpu_tests.xml     the suite's `gpu`-marked tests (kernels JIT and AOT on the device, TensorRT runner)
#   summary.json      each step's exit status and seconds
#
# What it needs beside it (prepare on a CPU machine, then carry `.whl` and `.gpu`):
#   .whl/seq2trt-*.whl       pip wheel --no-deps -w .whl .          (plus any wheel missing there, see README)
#   .gpu/ckpt/               the demo checkpoint (seq2trt train -o .gpu/ckpt, or copy the cached one)
#   .gpu/kernels/            python -m seq2trt.plugins.kernels.aot --targets sm_90 --out .gpu/kernels
# Steps that lack their input say so in summary.json and the script goes on; it exits non-zero if any step failed.
# SEQ2TRT_GPU_STEPS=bench,gpu_tests (comma-separated step names) runs only those steps.
# Through the device tool, which returns at most 8 files from $OUT (carry [".whl", ".gpu"]):
#   bash scripts/gpu_check.sh /tmp/gc; rc=$?; tar czf $OUT/gpu_check.tgz -C /tmp/gc --exclude=./export .; exit $rc
set -uo pipefail

out="${1:?usage: scripts/gpu_check.sh OUT_DIR}"
root="$(cd "$(dirname "$0")/.." && pwd)"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
site="${SEQ2TRT_GPU_SITE:-/tmp/seq2trt-site}"
export PYTHONUNBUFFERED=1

if ls "$root"/.whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        "$root"/.whl/*.whl || exit 2
else  # no wheel carried: install seq2trt from this source tree, offline
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$site" "$root" || exit 2
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
cd "$out" || exit 2   # never import the source tree's folders as top-level modules

declare -A status seconds
only="${SEQ2TRT_GPU_STEPS:-}"  # e.g. "bench,gpu_tests": run only these steps (a rerun within the device time left)
step() {  # step NAME LIMIT_SECONDS COMMAND...
    local name=$1 limit=$2 start
    shift 2
    if [ -n "$only" ] && [[ ",$only," != *",$name,"* ]]; then
        status[$name]=skipped; return
    fi
    start=$(date +%s)
    echo "== $name"
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    status[$name]=$?
    seconds[$name]=$(( $(date +%s) - start ))
    tail -n 5 "$out/$name.log"
}

step env 60 python3 "$root/scripts/gpu_check.py" env "$out/env.json"

aot=()
[ -f "$root/.gpu/kernels/index.json" ] && aot=(--aot-index "$root/.gpu/kernels/index.json")
step kernels 240 python3 "$root/scripts/gpu_kernels.py" "$out/kernels" "${aot[@]}"

if [ -d "$root/.gpu/ckpt" ]; then
    step eager_cuda 180 python3 "$root/scripts/gpu_check.py" eager "$root/.gpu/ckpt" "$out/eager_cuda.json" \
        ${aot[1]:+"${aot[1]}"}
    step pipeline 180 python3 "$root/scripts/gpu_check.py" pipeline "$root/.gpu/ckpt" "$out/export" \
        "$out/validate.json"
    step bench 180 python3 "$root/scripts/gpu_check.py" bench "$root/.gpu/ckpt" "$out/export" "$out/bench.json"
else
    status[eager_cuda]=skipped; status[pipeline]=skipped; status[bench]=skipped
fi
step tensorrt 60 python3 "$root/scripts/gpu_check.py" tensorrt "$out/tensorrt.json"
# The suite's `gpu`-marked tests that can run here (rootdir and options from the source tree's pyproject.toml).
step gpu_tests 300 python3 -m pytest -q -rs -m gpu -p no:cacheprovider -p no:benchmark --junitxml="$out/gpu_tests.xml" \
    "$root/tests/plugins/test_kernels_gpu.py" "$root/tests/validation/test_trt_runner.py" \
    "$root/tests/validation/test_bench.py"

failed=0
{
    echo "{"
    first=1
    for name in "${!status[@]}"; do
        [ $first -eq 1 ] || echo ","
        first=0
        printf '  "%s": {"status": "%s", "seconds": "%s"}' "$name" "${status[$name]}" "${seconds[$name]:-0}"
        case "${status[$name]}" in 0|skipped) ;; *) failed=1 ;; esac
    done
    echo; echo "}"
} > "$out/summary.json"
cat "$out/summary.json"
exit $failed
