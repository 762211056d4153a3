#!/usr/bin/env bash
# The benchmark sweeps of the README and the results folder in one device call (under
# 10 minutes on an H200); each step has its own time limit and log under OUTDIR:
#   source .device/activate.sh && export PYTHONPATH=$PWD/src:$PYTHONPATH && bash scripts/device/sweeps.sh OUTDIR
set -uo pipefail
out=${1:?usage: sweeps.sh OUTDIR}
mkdir -p "$out"
source "$(dirname "$0")/common.sh"
export PYTHONUNBUFFERED=1
record_gpu "$out"
step bench_vocab 150 python3 -m flce.cli bench --sweep vocab --rounds 3 --warmup 1 \
  --methods flce:triton,flce:cutedsl,torch:eager,liger,cce --out "$out/vocab"
step bench_tokens 130 python3 -m flce.cli bench --sweep tokens --rounds 3 --warmup 1 \
  --methods flce:triton,flce:cutedsl,liger,cce --out "$out/tokens"
step bench_chunks 70 python3 -m flce.cli bench --methods flce:cutedsl \
  --chunk-size 2048,4096,auto --rounds 3 --out "$out/chunks"
step bench_fwd 60 python3 -m flce.cli bench --mode fwd --rounds 5 --warmup 2 \
  --methods flce:triton,flce:cutedsl,torch:eager,liger,cce --out "$out/fwd"
cat "$out/steps.txt"
