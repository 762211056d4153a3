#!/usr/bin/env bash
# Vocab-parallel FLCE over NCCL on a machine with several GPUs (one device call):
#   source .device/activate.sh && export PYTHONPATH=$PWD/src:$PYTHONPATH && bash scripts/device/multi_gpu.sh OUTDIR
# Leaves the machine's NCCL variables (NVLink multicast off) as they are.
set -uo pipefail
out=${1:?usage: multi_gpu.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,driver_version --format=csv > "$out/gpu.txt" 2>&1
env | grep -E '^(NCCL|TORCH_SYMM|NVSHMEM)' | sort > "$out/nccl_env.txt"
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
for world in 2 4 8; do
  [ "$world" -le "$gpus" ] || continue
  timeout 240 python3 -m flce.cli bench --tp "$world" --out "$out/tp$world" > "$out/tp$world.log" 2>&1
  echo "tp$world rc=$?" >> "$out/steps.txt"
done
timeout 120 python3 -m pytest tests/gpu/test_gpu_vocab_parallel.py tests/parallel -q -p no:cacheprovider -rfE \
  > "$out/tests.log" 2>&1
echo "tests rc=$?" >> "$out/steps.txt"
cat "$out/steps.txt"
