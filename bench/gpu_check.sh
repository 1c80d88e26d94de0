#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py): Triton kernels compiled for real, parity with transformers on
# the GPU, decode attention against copy bandwidth, decode step against weight-read time.
# Runs from the source tree against the machine's own torch/triton (no install), within 9 minutes (an H200
# took ~8: parity alone ~350 s), under the device tool's 10-minute bound on one command.
#   bench/gpu_check.sh [RESULT_DIR [gpu_check.py flags, e.g. --sections worker_process]]
#   (RESULT_DIR default: $OUT, else ./gpu-results)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu-results}}
[ $# -gt 0 ] && shift
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python=${PYTHON:-python3}
timeout 540 "$python" bench/gpu_check.py --out "$out/gpu_check.json" "$@" 2>&1 | tee "$out/gpu_check.log"
status=${PIPESTATUS[0]}
[ "$status" = 124 ] && echo "gpu_check: stopped at the 540 s limit; partial results in $out/gpu_check.json"
exit "$status"
