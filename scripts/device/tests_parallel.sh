#!/usr/bin/env bash
# The GPU test suite as concurrent pytest processes on one GPU (the tests are small;
# peak-memory tests read their own process's allocator), each with a time limit:
#   bash scripts/device/tests_parallel.sh OUTDIR [SECONDS]
set -uo pipefail
out=${1:?usage: tests_parallel.sh OUTDIR [SECONDS]}
limit=${2:-280}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 FLCE_GPU_FUZZ_EXAMPLES=${FLCE_GPU_FUZZ_EXAMPLES:-200}
run() {  # run NAME PYTEST-ARGS...
  local name=$1; shift
  ( timeout "$limit" python3 -m pytest -q -p no:cacheprovider -rfE --durations=15 "$@" > "$out/$name.log" 2>&1
    echo "$name rc=$?" >> "$out/steps.txt" ) &
}
run tests_gpu_parity tests/gpu --deselect tests/gpu/test_gpu_fuzz.py
run tests_backends tests/backends
run tests_reliability_compile tests/test_reliability.py tests/test_compile.py
run tests_fuzz tests/gpu/test_gpu_fuzz.py
wait
for f in "$out"/tests_*.log; do echo "$(basename "$f"): $(grep -E '[0-9]+ (passed|failed)' "$f" | tail -1)"; done
