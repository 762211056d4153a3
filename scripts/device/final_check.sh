#!/usr/bin/env bash
# Kernel-change validation, then the benchmark sweeps, in one device call (under 10
# minutes on an H200). Phase 1 runs the GPU tests that cover the CE kernels as
# concurrent pytest processes; phase 2 benchmarks alone on the GPU.
#   source .device/activate.sh && export PYTHONPATH=$PWD/src:$PYTHONPATH && bash scripts/device/final_check.sh OUTDIR
set -uo pipefail
out=${1:?usage: final_check.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 FLCE_GPU_FUZZ_EXAMPLES=${FLCE_GPU_FUZZ_EXAMPLES:-150}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > "$out/gpu.txt" 2>&1
date -u +%Y-%m-%dT%H:%M:%SZ >> "$out/gpu.txt"
python3 -m flce.cli info > "$out/info.txt" 2>&1
tests() {  # tests NAME PYTEST-ARGS...  (in the background)
  local name=$1; shift
  ( timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE --durations=10 "$@" > "$out/$name.log" 2>&1
    echo "$name rc=$?" >> "$out/steps.txt" ) &
}
tests t_cutedsl_ce tests/backends/test_cutedsl_ce.py
tests t_fuzz tests/gpu/test_gpu_fuzz.py
tests t_reliability_fused tests/test_reliability.py tests/backends/test_cutedsl_fused_forward.py \
  tests/backends/test_cutedsl_loss_only.py tests/gpu/test_gpu_vocab_parallel.py
tests t_parity_cutedsl tests/gpu/test_gpu_parity.py -k "cutedsl"
wait
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - start))s" >> "$out/steps.txt"
}
step bench_ref 90 python3 -m flce.cli bench --rounds 5 --warmup 2 --out "$out/ref"
step bench_vocab 110 python3 -m flce.cli bench --sweep vocab --rounds 3 --warmup 1 \
  --methods flce:triton,flce:cutedsl,torch:eager,liger,cce --out "$out/vocab"
step bench_tokens 90 python3 -m flce.cli bench --sweep tokens --rounds 3 --warmup 1 \
  --methods flce:triton,flce:cutedsl,liger,cce --out "$out/tokens"
step bench_fwd 40 python3 -m flce.cli bench --mode fwd --rounds 5 --warmup 2 \
  --methods flce:triton,flce:cutedsl,torch:eager,liger,cce --out "$out/fwd"
step bench_chunks 40 python3 -m flce.cli bench --methods flce:cutedsl --chunk-size 2048,4096,auto \
  --rounds 3 --out "$out/chunks"
step profile 40 python3 scripts/device/profile_breakdown.py "$out/profile"
cat "$out/steps.txt"
for f in "$out"/t_*.log; do echo "$(basename "$f"): $(grep -E '[0-9]+ (passed|failed)' "$f" | tail -1)"; done
