#!/usr/bin/env bash
# Kernel-change validation, then the benchmark sweeps, in one device call (under 10
# minutes on an H200). Phase 1 runs the GPU tests that cover the CE kernels as
# concurrent pytest processes; phase 2 benchmarks alone on the GPU.
#   source .device/activate.sh && export PYTHONPATH=$PWD/src:$PYTHONPATH && bash scripts/device/final_check.sh OUTDIR
set -uo pipefail
out=${1:?usage: final_check.sh OUTDIR}
mkdir -p "$out"
source "$(dirname "$0")/common.sh"
export PYTHONUNBUFFERED=1 FLCE_GPU_FUZZ_EXAMPLES=${FLCE_GPU_FUZZ_EXAMPLES:-150}
record_gpu "$out"
python3 -m flce.cli info > "$out/info.txt" 2>&1
pytest_in_background t_cutedsl_ce 150 tests/backends/test_cutedsl_ce.py
pytest_in_background t_fuzz 150 tests/gpu/test_gpu_fuzz.py
pytest_in_background t_reliability_fused 150 tests/test_reliability.py tests/backends/test_cutedsl_fused_forward.py \
  tests/backends/test_cutedsl_loss_only.py tests/gpu/test_gpu_vocab_parallel.py
pytest_in_background t_parity_cutedsl 150 tests/gpu/test_gpu_parity.py -k "cutedsl"
wait
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
