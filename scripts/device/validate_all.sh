#!/usr/bin/env bash
# The whole single-GPU validation in one device call (about 9 minutes on an H200), most
# important first; each step has its own time limit and log under OUTDIR:
#   source .device/activate.sh && export PYTHONPATH=$PWD/src:$PYTHONPATH && bash scripts/device/validate_all.sh $OUT
set -uo pipefail
out=${1:?usage: validate_all.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 FLCE_GPU_FUZZ_EXAMPLES=${FLCE_GPU_FUZZ_EXAMPLES:-200}
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "$name rc=$? ${SECONDS}s-${start}s" >> "$out/steps.txt"
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > "$out/gpu.txt" 2>&1
date -u +%Y-%m-%dT%H:%M:%SZ >> "$out/gpu.txt"
step info 30 python3 -m flce.cli info
step tests_gpu 200 python3 -m pytest tests/gpu tests/backends tests/test_reliability.py tests/test_compile.py \
  -q -p no:cacheprovider -rfE --deselect tests/gpu/test_gpu_fuzz.py
step bench_ref 120 python3 -m flce.cli bench --rounds 5 --warmup 2 --out "$out/ref"
step bench_vocab 150 python3 -m flce.cli bench --sweep vocab --rounds 3 --warmup 1 \
  --methods flce:triton,flce:cutedsl,torch:eager,liger,cce --out "$out/vocab"
step bench_tokens 120 python3 -m flce.cli bench --sweep tokens --rounds 3 --warmup 1 \
  --methods flce:triton,flce:cutedsl,liger,cce --out "$out/tokens"
step bench_chunks 60 python3 -m flce.cli bench --methods flce:cutedsl --chunk-size 1024,auto,4096,8192 \
  --rounds 3 --out "$out/chunks"
step fuzz_gpu 90 python3 -m pytest tests/gpu/test_gpu_fuzz.py -q -p no:cacheprovider -rfE
step check 60 python3 -m flce.cli check
cat "$out/steps.txt"
grep -hE "passed|failed" "$out"/tests_gpu.log "$out"/fuzz_gpu.log | tail -2
