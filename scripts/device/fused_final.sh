#!/usr/bin/env bash
# The final measurements of the fused Hopper work, in two device calls (each under 10
# minutes on an H200), every step with its own time limit and log under OUTDIR:
#   source .device/activate.sh && export PYTHONPATH=$PWD/src:$PYTHONPATH && bash scripts/device/fused_final.sh fwd OUTDIR
#   ... && bash scripts/device/fused_final.sh full OUTDIR
# fwd:  the fused forward's GPU tests; the forward without gradients on every sweep shape
#       against one logits GEMM and the peers; the kernel profile of that forward; the
#       cost of each loss feature (fwd+bwd, reference shape) and fp16.
# full: the fused forward's GPU tests (bf16) and its profile; fwd+bwd on every sweep shape,
#       all peers interleaved with the cuBLAS floor; the memory-budget mode over the
#       vocabulary sweep; the per-kernel profile of three shapes.
set -uo pipefail
phase=${1:?usage: fused_final.sh fwd|full OUTDIR}
out=${2:?usage: fused_final.sh fwd|full OUTDIR}
mkdir -p "$out"
source "$(dirname "$0")/common.sh"
export PYTHONUNBUFFERED=1
record_gpu "$out"
python3 -m flce.cli info > "$out/info.txt" 2>&1
peers=flce:triton,flce:cutedsl,liger,cce
case "$phase" in
fwd)
  pytest_in_background t_fused_forward 200 tests/backends/test_cutedsl_fused_forward.py tests/backends/test_cutedsl_loss_only.py
  wait
  step ff_check 60 python3 scripts/device/fused_forward_check.py --no-checks --vocab 128256,32000 \
    --configs 128x256_cluster2x1,128x256_cluster2x1_oneshot
  step fwd_vocab 80 python3 -m flce.cli bench --mode fwd --sweep vocab --rounds 5 --warmup 2 \
    --methods $peers,torch:eager --out "$out/fwd_vocab"
  step fwd_tokens 70 python3 -m flce.cli bench --mode fwd --sweep tokens --rounds 5 --warmup 2 \
    --methods $peers --out "$out/fwd_tokens"
  step profile_fwd 40 python3 scripts/device/profile_breakdown.py "$out/profile_fwd" --mode fwd \
    --methods floor:gemm,flce:cutedsl,flce:triton
  for f in none label_smoothing z_loss softcap weights bias token_scaling accuracy predicted \
           label_smoothing,z_loss,softcap,weights,bias,token_scaling,accuracy,predicted; do
    name=features_$f
    [[ "$f" == *,* ]] && name=features_all
    [ "$f" = none ] && feat=() || feat=(--features "$f")
    step "$name" 40 python3 -m flce.cli bench "${feat[@]}" --rounds 5 --warmup 1 \
      --methods flce:cutedsl,flce:triton --out "$out/$name" --no-plots
  done
  step fp16 50 python3 -m flce.cli bench --dtype fp16 --rounds 3 --warmup 1 \
    --methods flce:cutedsl,flce:triton,liger:triton,cce --out "$out/fp16" --no-plots
  ;;
full)
  pytest_in_background t_fused_forward 150 tests/backends/test_cutedsl_fused_forward.py \
    tests/backends/test_cutedsl_loss_only.py -k "not float16"
  wait
  step profile_fwd 40 python3 scripts/device/profile_breakdown.py "$out/profile_fwd" --mode fwd \
    --methods floor:gemm,flce:cutedsl
  step full_vocab 150 python3 -m flce.cli bench --sweep vocab --rounds 3 --warmup 1 \
    --methods $peers --out "$out/full_vocab"
  step full_tokens 130 python3 -m flce.cli bench --sweep tokens --rounds 3 --warmup 1 \
    --methods $peers --out "$out/full_tokens"
  step memory_vocab 80 python3 -m flce.cli bench --sweep vocab --rounds 2 --warmup 1 \
    --methods 'flce:cutedsl[vblocks=16],liger:triton' --out "$out/memory_vocab" --no-plots
  for shape in "8192 128256" "8192 32000" "8192 262144"; do
    set -- $shape
    step "profile_${1}x${2}" 30 python3 scripts/device/profile_breakdown.py "$out/profile_${1}x${2}" \
      --n "$1" --v "$2" --methods floor:gemm,flce:cutedsl,liger:cute-sm90
  done
  ;;
*) echo "phase must be fwd or full"; exit 2 ;;
esac
cat "$out/steps.txt"
for f in "$out"/t_*.log; do [ -e "$f" ] && echo "$(basename "$f"): $(grep -E '[0-9]+ (passed|failed)' "$f" | tail -1)"; done
exit 0
