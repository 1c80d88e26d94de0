#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py): Triton kernels compiled for real, decode attention against copy
# bandwidth, the decode step against weight-read time, CUDA graphs against eager, fp8 KV, a worker process, P/D
# on one device, parity with transformers.
# Runs from the source tree against the machine's own torch/triton (no install), within 5 minutes (a lent
# machine has 15 in all, its start included, and a rerun must fit): sections are written to the JSON as each
# ends, so a run stopped at the bound keeps what it measured. Parity runs last, on five shapes by default
# (its 14 took ~350 s alone on an H200). The time of the whole has not been measured on a GPU yet.
#   bench/gpu_check.sh [RESULT_DIR [gpu_check.py flags, e.g. --sections worker_process]]
#   (on the device tool: `make gpu-wheels` here first, then run it with carry ["bench/gpu-wheels"])
#   (RESULT_DIR default: $OUT, else ./gpu-results)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu-results}}
[ $# -gt 0 ] && shift
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python=${PYTHON:-python3}
# pdserve's dependencies the machine's image lacks, from the folder `make gpu-wheels` prepares (carried with the
# tree): installed beside it, first on the path. NIXL is never carried: the P/D section moves KV over TCP.
if compgen -G "bench/gpu-wheels/*.whl" > /dev/null; then
  site="$(mktemp -d)/site-packages"  # not under $out: the results go back, these need not
  "$python" -m pip install --quiet --no-deps --no-index --target "$site" bench/gpu-wheels/*.whl \
    && export PYTHONPATH="$site:$PYTHONPATH" \
    && echo "gpu_check: installed $(ls bench/gpu-wheels | wc -l) carried wheels into $site"
else
  echo "gpu_check: no bench/gpu-wheels (make gpu-wheels, then carry it): sections needing missing modules are skipped"
fi
echo "gpu_check: NIXL is not carried; the pd section uses --kv-transfer tcp"
limit=${GPU_CHECK_LIMIT_S:-290}  # the tests shorten it to see a run stopped at its bound
timeout "$limit" "$python" bench/gpu_check.py --out "$out/gpu_check.json" "$@" 2>&1 | tee "$out/gpu_check.log"
status=${PIPESTATUS[0]}
[ "$status" = 124 ] && echo "gpu_check: stopped at the $limit s limit; partial results in $out/gpu_check.json"
exit "$status"
