#!/usr/bin/env bash
# Vocab-parallel FLCE over NCCL on a machine with several GPUs (one device call):
#   source .device/activate.sh && export PYTHONPATH=$PWD/src:$PYTHONPATH && bash scripts/device/multi_gpu.sh OUTDIR
# World size 1 (one GPU) checks the NCCL path with a group of size 1.
# Leaves the machine's NCCL variables (NVLink multicast off) as they are. Per world size:
# the reference shape through `flce bench --tp`, the same with the cutedsl split-row
# kernels, with label smoothing, z-loss and softcap, then V=262144 (where splitting the
# vocabulary saves the most). FLCE_TP_WORLDS="2 4" picks the world sizes.
set -uo pipefail
out=${1:?usage: multi_gpu.sh OUTDIR}
mkdir -p "$out"
source "$(dirname "$0")/common.sh"
export PYTHONUNBUFFERED=1
record_gpu "$out"
nvidia-smi --query-gpu=index,name,driver_version --format=csv >> "$out/gpu.txt" 2>&1
nvidia-smi topo -m > "$out/topology.txt" 2>&1
env | grep -E '^(NCCL|TORCH_SYMM|NVSHMEM)' | sort > "$out/nccl_env.txt"
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
tp_run() {  # tp_run WORLD NAME ARGS...: flce.bench.tensor_parallel under torchrun
  local world=$1 name=$2; shift 2
  step "$name" 180 python3 -m torch.distributed.run --standalone --nproc-per-node="$world" \
    -m flce.bench.tensor_parallel --out "$out/$name.json" "$@"
}
worlds=${FLCE_TP_WORLDS:-1 2 4 8}  # 1: a process group of size 1 over NCCL
for world in $worlds; do
  [ "$world" -le "$gpus" ] || continue
  step "tp$world" 180 python3 -m flce.cli bench --tp "$world" --out "$out/tp$world"
  tp_run "$world" "tp$world-cutedsl" --backend cutedsl
  tp_run "$world" "tp$world-features" --label-smoothing 0.1 --lse-square-scale 1e-4 --softcap 30
  [ "$world" -gt 1 ] && tp_run "$world" "tp$world-v262144" --vocab 262144
done
step tests 150 python3 -m pytest tests/gpu/test_gpu_vocab_parallel.py tests/parallel -q -p no:cacheprovider -rfE
cat "$out/steps.txt"
