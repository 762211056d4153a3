#!/usr/bin/env bash
# The single-GPU validation in one device call (under 10 minutes on an H200), most
# important first (the sweeps are scripts/device/sweeps.sh); each step has its own time limit and log under OUTDIR:
#   source .device/activate.sh && export PYTHONPATH=$PWD/src:$PYTHONPATH && bash scripts/device/validate_all.sh OUTDIR
set -uo pipefail
out=${1:?usage: validate_all.sh OUTDIR}
mkdir -p "$out"
source "$(dirname "$0")/common.sh"
export PYTHONUNBUFFERED=1 FLCE_GPU_FUZZ_EXAMPLES=${FLCE_GPU_FUZZ_EXAMPLES:-200}
record_gpu "$out"
step info 20 python3 -m flce.cli info
step tests_gpu 210 python3 -m pytest tests/gpu tests/backends tests/test_reliability.py tests/test_compile.py \
  -q -p no:cacheprovider -rfE --deselect tests/gpu/test_gpu_fuzz.py
step bench_ref 110 python3 -m flce.cli bench --rounds 5 --warmup 2 --out "$out/ref"
step profile 80 python3 scripts/device/profile_breakdown.py "$out/profile"
step fuzz_gpu 80 python3 -m pytest tests/gpu/test_gpu_fuzz.py -q -p no:cacheprovider -rfE
step check 50 python3 -m flce.cli check
cat "$out/steps.txt"
grep -hE "passed|failed" "$out"/tests_gpu.log "$out"/fuzz_gpu.log | tail -2
