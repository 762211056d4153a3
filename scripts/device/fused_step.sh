#!/usr/bin/env bash
# One step of the fused Hopper kernel work in one device call: its GPU tests, then the
# kernel alone against torch.mm per launch shape, then the forward's per-kernel profile.
#   source .device/activate.sh && export PYTHONPATH=$PWD/src:$PYTHONPATH && bash scripts/device/fused_step.sh OUTDIR
# FF_CONFIGS / FF_VOCAB narrow the timing step (names of fused_forward_check.py).
set -uo pipefail
out=${1:?usage: fused_step.sh OUTDIR}
mkdir -p "$out"
source "$(dirname "$0")/common.sh"
export PYTHONUNBUFFERED=1
record_gpu "$out"
pytest_in_background t_fused_forward 240 tests/backends/test_cutedsl_fused_forward.py tests/backends/test_cutedsl_loss_only.py
wait
step ff_check 200 python3 scripts/device/fused_forward_check.py \
  --configs "${FF_CONFIGS:-128x256_cluster2x1,128x256_cluster2x1_oneshot,128x256,128x256_oneshot}" \
  --vocab "${FF_VOCAB:-128256,32000,151936,262144}"
step profile_fwd 90 python3 scripts/device/profile_breakdown.py "$out/profile_fwd" --mode fwd \
  --methods floor:gemm,flce:cutedsl,flce:triton
cat "$out/steps.txt"
for f in "$out"/t_*.log; do echo "$(basename "$f"): $(grep -E '[0-9]+ (passed|failed)' "$f" | tail -1)"; done
grep -E "PASS|FAIL|\"op\"" "$out/ff_check.log" | cut -c1-220
grep -A3 "^flce:cutedsl\|^floor" "$out/profile_fwd.log" | cut -c1-160
