#!/usr/bin/env bash
# The one prepared command for a lent GPU machine (docs/gpu-check.md says how to run it, call by call).
#
#   scripts/gpu_check.sh OUT_DIR             run every GPU-only check, JSON results and logs in OUT_DIR
#   scripts/gpu_check.sh --stage-ort PART    keep one carried onnxruntime-gpu part (.gpu/ort/part-K) in /tmp
#   scripts/gpu_check.sh --dry-run           on any CPU: resolve every path, script, test, verb, flag and step
#   scripts/gpu_check.sh --calls             the device calls, in order, with what each carries
#
# The steps are declared once, in scripts/gpu_check_plan.py (STEPS): env, kernels (scripts/gpu_kernels.py: the
# kernels against the float64 reference, JIT and AOT, and timed against SDPA, the position-bias cases against SDPA
# with a dense bias), eager_cuda, pipeline, bench, families (T5 and Whisper end to end on CUDA against
# transformers), tensorrt, gpu_tests (the suite's gpu-marked tests). SEQ2TRT_GPU_STEPS=a,b runs only those.
# Before running, it installs what scripts/prepare_gpu_check.sh made and the device calls carried: seq2trt's wheel
# (.whl), and onnxruntime-gpu joined from its staged parts when they are all there (else the run says which part
# is missing, and the steps run on the machine's own onnxruntime). Exit status: non-zero if any step failed.
set -uo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
py="${SEQ2TRT_PYTHON:-python3}"
export PYTHONUNBUFFERED=1
case "${1:-}" in
    --dry-run) exec "$py" "$root/scripts/gpu_check_plan.py" dry-run ;;
    --calls) exec "$py" "$root/scripts/gpu_check_plan.py" calls ;;
    --stage-ort) exec "$py" "$root/scripts/gpu_check_ort.py" stage "${2:?usage: gpu_check.sh --stage-ort PART_DIR}" ;;
    ""|-*) echo "usage: scripts/gpu_check.sh OUT_DIR | --stage-ort PART_DIR | --dry-run | --calls" >&2; exit 2 ;;
esac

out="$1"
mkdir -p "$out" && out="$(cd "$out" && pwd)" || exit 2
site="${SEQ2TRT_GPU_SITE:-/tmp/seq2trt-site}"

install() {  # install WHEEL_OR_TREE...: into the site folder, offline, on the machine's own packages
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$@"
}
if ls "$root"/.whl/*.whl >/dev/null 2>&1; then
    install "$root"/.whl/*.whl || exit 2
else  # no wheel carried: seq2trt from this source tree
    "$py" -m pip install -q --no-index --no-deps --no-build-isolation --target "$site" "$root" || exit 2
fi
# onnxruntime-gpu: stage the parts this call carried, join all staged parts (sha256-checked), install; without it
# the steps run on the machine's own onnxruntime, and ort_wheel.log says why
for part in "$root"/.gpu/ort/part-*; do
    [ -d "$part" ] && "$py" "$root/scripts/gpu_check_ort.py" stage "$part"
done
if ort_wheel="$("$py" "$root/scripts/gpu_check_ort.py" assemble 2> "$out/ort_wheel.log")"; then
    install "$ort_wheel" >> "$out/ort_wheel.log" 2>&1 && echo "installed $ort_wheel" >> "$out/ort_wheel.log"
fi
cat "$out/ort_wheel.log"
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
cd "$out" || exit 2   # never import the source tree's folders as top-level modules
exec "$py" "$root/scripts/gpu_check_plan.py" run "$out"
