# Shared by the device scripts (sourced, not run): `record_gpu OUTDIR` writes the GPU's
# state and the time to OUTDIR/gpu.txt; `step NAME SECONDS COMMAND...` runs one step with
# a time limit, its output in $out/NAME.log and its exit code and duration in
# $out/steps.txt, so a slow step cannot cost the results of the ones before it.
record_gpu() {
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > "$1/gpu.txt" 2>&1
  date -u +%Y-%m-%dT%H:%M:%SZ >> "$1/gpu.txt"
}
step() {
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - start))s" >> "$out/steps.txt"
}
# `pytest_in_background NAME SECONDS PYTEST-ARGS...`: one pytest process in the background
# (several share one GPU: the tests are small); `wait` for them.
# On a machine with several GPUs (and CUDA_VISIBLE_DEVICES unset) the processes take
# the GPUs in turn, so the suite finishes sooner.
_gpu_count=$(nvidia-smi -L 2>/dev/null | wc -l)
_next_gpu=0
pytest_in_background() {
  local name=$1 limit=$2; shift 2
  local visible=${CUDA_VISIBLE_DEVICES-}
  if [ -z "${CUDA_VISIBLE_DEVICES+set}" ] && [ "$_gpu_count" -gt 1 ]; then
    visible=$((_next_gpu % _gpu_count))
    _next_gpu=$((_next_gpu + 1))
  fi
  ( [ -n "$visible" ] && export CUDA_VISIBLE_DEVICES=$visible
    timeout "$limit" python3 -m pytest -q -p no:cacheprovider -rfE --durations=10 "$@" > "$out/$name.log" 2>&1
    echo "$name rc=$?" >> "$out/steps.txt" ) &
}
