#!/usr/bin/env bash
# The benchmark sweeps of the README and the results folder in one device call (under
# 10 minutes on an H200); each step has its own time limit and log under OUTDIR:
#   source .device/activate.sh && export PYTHONPATH=$PWD/src:$PYTHONPATH && bash scripts/device/sweeps.sh OUTDIR
set -uo pipefail
out=${1:?usage: sweeps.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "$name rc=$? ${SECONDS}s-${start}s" >> "$out/steps.txt"
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > "$out/gpu.txt" 2>&1
date -u +%Y-%m-%dT%H:%M:%SZ >> "$out/gpu.txt"
step bench_vocab 150 python3 -m flce.cli bench --sweep vocab --rounds 3 --warmup 1 \
  --methods flce:triton,flce:cutedsl,torch:eager,liger,cce --out "$out/vocab"
step bench_tokens 130 python3 -m flce.cli bench --sweep tokens --rounds 3 --warmup 1 \
  --methods flce:triton,flce:cutedsl,liger,cce --out "$out/tokens"
step bench_chunks 70 python3 -m flce.cli bench --methods flce:cutedsl \
  --chunk-size 2048,4096,auto --rounds 3 --out "$out/chunks"
step bench_fwd 60 python3 -m flce.cli bench --mode fwd --rounds 5 --warmup 2 \
  --methods flce:triton,flce:cutedsl,torch:eager,liger,cce --out "$out/fwd"
cat "$out/steps.txt"
