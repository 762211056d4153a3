#!/usr/bin/env bash
# The GPU test suite as concurrent pytest processes on one GPU (the tests are small;
# peak-memory tests read their own process's allocator), each with a time limit:
#   bash scripts/device/tests_parallel.sh OUTDIR [SECONDS]
set -uo pipefail
out=${1:?usage: tests_parallel.sh OUTDIR [SECONDS]}
limit=${2:-280}
mkdir -p "$out"
source "$(dirname "$0")/common.sh"
export PYTHONUNBUFFERED=1 FLCE_GPU_FUZZ_EXAMPLES=${FLCE_GPU_FUZZ_EXAMPLES:-200}
pytest_in_background tests_gpu_parity "$limit" tests/gpu --deselect tests/gpu/test_gpu_fuzz.py
pytest_in_background tests_backends "$limit" tests/backends
pytest_in_background tests_reliability_compile "$limit" tests/test_reliability.py tests/test_compile.py
pytest_in_background tests_fuzz "$limit" tests/gpu/test_gpu_fuzz.py
wait
for f in "$out"/tests_*.log; do echo "$(basename "$f"): $(grep -E '[0-9]+ (passed|failed)' "$f" | tail -1)"; done
