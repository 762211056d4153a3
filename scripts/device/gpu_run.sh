#!/usr/bin/env bash
# One device call, most important first; every step writes under OUTDIR and has its own
# time limit, so a slow step cannot cost the results of the ones before it.
#   source .device/activate.sh && export PYTHONPATH=$PWD/src:$PYTHONPATH && bash scripts/device/gpu_run.sh OUTDIR
set -uo pipefail
out=${1:?usage: gpu_run.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > "$out/gpu.txt" 2>&1
date -u +%Y-%m-%dT%H:%M:%SZ >> "$out/gpu.txt"
python3 -m flce.cli info > "$out/info.txt" 2>&1
timeout 110 python3 -m flce.cli bench --rounds 5 --warmup 2 \
  --methods flce:triton,flce:cutedsl,torch:eager,liger,cce --out "$out/ref" > "$out/bench_ref.log" 2>&1
echo "bench ref rc=$?" >> "$out/steps.txt"
timeout 100 python3 -m pytest tests/gpu tests/backends/test_triton_ce.py -q -p no:cacheprovider -k "not cutedsl" \
  -rfE > "$out/gpu_tests_torch_triton.log" 2>&1
echo "gpu tests torch+triton rc=$?" >> "$out/steps.txt"
timeout 80 python3 -m pytest tests/gpu/test_gpu_parity.py tests/backends/test_cutedsl_ce.py -q -p no:cacheprovider \
  -k "cutedsl and (bfloat16 or real_vocab or 64bit or memory)" -rfE > "$out/gpu_tests_cutedsl.log" 2>&1
echo "gpu tests cutedsl rc=$?" >> "$out/steps.txt"
cat "$out/steps.txt"
tail -3 "$out/gpu_tests_torch_triton.log" "$out/gpu_tests_cutedsl.log"
tail -25 "$out/bench_ref.log"
