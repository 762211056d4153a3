#!/usr/bin/env bash
# A GPU session in one call: named steps, each command with its own time limit and its own
# log under OUTDIR, so a slow or failing step never costs the results of the others.
#
#   bash benchmarks/device_validate.sh OUTDIR [STEP ...]
#
# Run it from a checkout on the GPU machine, with flce's dependencies installed
# (pip install -e ".[test,bench,triton,cutedsl]", and liger-kernel, cut-cross-entropy for
# the peers); the checkout's src/ goes first on PYTHONPATH. Without STEPs it runs the
# validation, `info tests parity bench profile` (limits summing to under 10 minutes);
# the measurements of the published tables are steps of their own, for further calls:
#
#   info           GPU state, `flce info`, the commit and src/'s tree     -> gpu.txt, info.log
#   tests          the whole suite on the GPU machine: one background pytest process per
#                  backend (torch, triton, cutedsl), the GPU fuzz and the rest, on
#                  pytest-xdist workers where installed (TESTS_LIMIT: seconds, 300) -> tests-*.log
#   parity         benchmarks/parity_vs_liger.py                          -> parity/
#   bench          the reference shape, every peer interleaved with the floor -> bench/
#   profile        kernel time per call at the reference shape            -> profile/
#   profile-shapes the same, floor and flce:cutedsl, at the issue's six shapes -> profile-shapes/
#   changed        the test files of src/ and tests/ changed since GPU_BASE (a commit; the
#                  last one a GPU ran), whole, on the GPU                -> tests-changed.log
#   sweeps         fwd+bwd over the vocabulary and the token sweeps       -> fwd-bwd/
#   forward        forward only (no grad) over both sweeps                -> forward-only/
#   memory         the exact low-memory mode (16 vocabulary blocks)       -> memory-mode/
#   block-kernels  one vocabulary block's kernels alone at a range of widths
#                  (benchmarks/block_gemm_kernels.py), and the call at four widths -> block-kernels/
#   features       each loss feature alone, then all, then fp16           -> features/
#   features-shapes the same for the default at the issue's other five shapes
#                  (SHAPE_FEATURES: which, to split it over two calls)    -> features-shapes/
#   kernel         the CE kernel alone and the host overhead per call     -> ce-kernel/
#   fused-forward  the fused forward GEMM alone against torch.mm          -> fused-forward.log
#   autocast       fp32 weights under bf16 autocast against eager, then fp16 under a
#                  loss scaler with and without the prescale              -> autocast.log, autocast-fp16.log
#   tp             vocab-parallel over 2, 4, 8 GPUs (those present) + tests -> vocab-parallel/
#   heads          the logprobs and distillation heads: GPU tests, then
#                  `flce bench --loss logprobs|distill` at V=128256, 151936 -> heads-tests.log, heads/
#   frontier       the memory budget's schemes, predicted and measured, at
#                  V=128256 and 32000 (`flce bench --frontier`)           -> memory-budget/
#   liger-memory   the exact mode under the budget that keeps its peak within 1.1x
#                  Liger Triton's, at the six shapes (benchmarks/budget_vs_liger.py) -> liger-memory/
#   graph          fwd+bwd replayed from a CUDA graph, reference and small shapes -> training-loop/
#   overlap        the default's backward in vocabulary blocks, the CE pass on a second
#                  stream beside the GEMMs (benchmarks/overlap_probe.py): its check, then
#                  the reference shape and V=32000                        -> overlap/
#
# LIMIT_SCALE=2 doubles every time limit (a slower GPU). OUTDIR/steps.txt gets one line per
# command: its name, exit code (124: cut by its limit) and seconds; the last lines printed
# are that file and each test log's pytest summary. Exit code 0 when every command passed.
set -uo pipefail
out=${1:?usage: benchmarks/device_validate.sh OUTDIR [info tests parity bench profile profile-shapes changed sweeps forward memory block-kernels features features-shapes kernel fused-forward autocast tp heads frontier liger-memory graph overlap]}
shift
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(info tests parity bench profile)
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo" || exit 2
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
scale=${LIMIT_SCALE:-1}
failed=0
# The peers of the published tables; the floor always runs.
peers=flce:triton,flce:cutedsl,liger,cce

# run NAME SECONDS COMMAND...: one command, its output in OUTDIR/NAME.log.
run() {
  local name=$1 limit=$(($2 * scale)) start=$SECONDS rc
  shift 2
  echo "== $name (limit ${limit}s): $*"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $((SECONDS - start))s" >>"$out/steps.txt"
  [ "$rc" -eq 0 ] || failed=1
}

# pytest_in_background NAME SECONDS PYTEST-ARGS...: `wait` for them. The tests are small, so
# several processes share one GPU; with several GPUs (and CUDA_VISIBLE_DEVICES unset) the
# processes take them in turn. Peak-memory tests read their own process's allocator.
gpu_count=$(nvidia-smi -L 2>/dev/null | wc -l)
next_gpu=0
pytest_in_background() {
  local name=$1 limit=$2 visible=${CUDA_VISIBLE_DEVICES-}
  shift 2
  if [ -z "${CUDA_VISIBLE_DEVICES+set}" ] && [ "$gpu_count" -gt 1 ]; then
    visible=$((next_gpu % gpu_count))
    next_gpu=$((next_gpu + 1))
  fi
  (
    [ -n "$visible" ] && export CUDA_VISIBLE_DEVICES=$visible
    # shellcheck disable=SC2086
    run "$name" "$limit" "$python" -m pytest -q -p no:cacheprovider -rfE --durations=10 ${PYTEST_FLAGS-} "$@"
    exit "$failed"
  ) &
}

# The git tree hash of src/ as the files stand (through a throwaway index: the checkout's
# own index and metadata are left alone).
src_tree() {
  local index
  index=$(mktemp -u)
  (cd "$repo" && GIT_INDEX_FILE=$index git add -A src && GIT_INDEX_FILE=$index git write-tree --prefix=src/) 2>/dev/null
  rm -f "$index"
}

step_info() {
  {
    nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv
    nvidia-smi topo -m
    date -u +%Y-%m-%dT%H:%M:%SZ
    git -C "$repo" rev-parse HEAD 2>/dev/null
    # A copy of a checkout may carry older git metadata than its files: the tree of src/ as
    # it is on disk names the code run (equal to `git rev-parse COMMIT:src` of its commit).
    echo "src tree: $(src_tree)"
  } >"$out/gpu.txt" 2>&1
  run info 20 "$python" -m flce.cli info
}

step_tests() {
  local fuzz=tests/gpu/test_gpu_fuzz.py limit=${TESTS_LIMIT:-300}
  export FLCE_GPU_FUZZ_EXAMPLES=${FLCE_GPU_FUZZ_EXAMPLES:-150}
  # Several processes share the host: each torch would start a thread per core, and the
  # oversubscribed host ran them at a fraction of their speed (all five cut at 270 s).
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
  # Workers per process where pytest-xdist is installed, sized by the 2026-12-05 run on 16
  # cores (one process each: torch 89 s, triton 224 s, cutedsl over 510 s; the rest of the
  # suite 170 s on 6 workers, cutedsl 241 s on 6).
  local xdist=0
  "$python" -c "import xdist" 2>/dev/null && xdist=1
  workers() { [ "$xdist" -eq 1 ] && [ "$1" -gt 1 ] && echo "-n $1"; }
  pytest_in_background tests-torch "$limit" tests/gpu --deselect "$fuzz" -k "not triton and not cutedsl"
  # shellcheck disable=SC2046
  pytest_in_background tests-triton "$limit" $(workers 2) tests/gpu tests/backends --deselect "$fuzz" -k "triton and not cutedsl"
  # shellcheck disable=SC2046
  pytest_in_background tests-cutedsl "$limit" $(workers 5) tests/gpu tests/backends --deselect "$fuzz" -k cutedsl
  pytest_in_background tests-fuzz "$limit" "$fuzz"
  # The rest: the CPU suite and the marked GPU tests outside tests/gpu, the bench's included.
  # shellcheck disable=SC2046
  pytest_in_background tests-rest "$limit" $(workers "${REST_WORKERS:-4}") tests --ignore=tests/gpu --ignore=tests/backends
  local pid
  for pid in $(jobs -p); do wait "$pid" || failed=1; done
}

step_parity() {
  run parity 90 "$python" benchmarks/parity_vs_liger.py "$out/parity"
}

step_bench() {
  run bench 110 "$python" -m flce.cli bench --rounds 5 --warmup 2 \
    --methods "$peers,torch:eager,torch:compile" --out "$out/bench"
}

step_profile() {
  run profile 60 "$python" benchmarks/profile_breakdown.py "$out/profile"
}

# The issue's six shapes: the default's kernel time against the floor's, per shape.
step_profile_shapes() {
  local shape
  for shape in 8192x32000 8192x128256 8192x151936 8192x262144 4096x128256 16384x128256; do
    run "profile-$shape" 60 "$python" benchmarks/profile_breakdown.py "$out/profile-shapes/$shape" \
      --n "${shape%x*}" --v "${shape#*x}" --methods floor:gemm,flce:cutedsl
  done
}

# The tests a GPU has not run since GPU_BASE: every test file changed since then, and the
# test files that import a changed module of src/ (by its dotted name).
step_changed() {
  local base=${GPU_BASE:?set GPU_BASE to the last commit a GPU ran} files module
  files=$(git -C "$repo" diff --name-only "$base" -- 'tests/*.py' | grep '/test_' || true)
  for module in $(git -C "$repo" diff --name-only "$base" -- 'src/flce/*.py' | sed 's|^src/||; s|\.py$||; s|/__init__$||; s|/|.|g'); do
    files+=" $(grep -rlE "(from|import) ${module//./\\.}( |$|,)" "$repo/tests" --include='test_*.py' | sed "s|^$repo/||" || true)"
  done
  files=$(printf '%s\n' $files | sort -u | while read -r f; do [ -e "$repo/$f" ] && echo "$f"; done)
  echo "changed since $base: $(echo "$files" | wc -w) test files" >>"$out/steps.txt"
  [ -n "$files" ] || return 0
  # shellcheck disable=SC2086
  run tests-changed 540 "$python" -m pytest -q -p no:cacheprovider -rfE --durations=10 $files
}

step_sweeps() {
  run fwd-bwd-vocab 150 "$python" -m flce.cli bench --sweep vocab --rounds 3 --warmup 1 \
    --methods "$peers" --out "$out/fwd-bwd"
  run fwd-bwd-tokens 130 "$python" -m flce.cli bench --sweep tokens --rounds 3 --warmup 1 \
    --methods "$peers" --out "$out/fwd-bwd"
}

step_forward() {
  run forward-vocab 80 "$python" -m flce.cli bench --mode fwd --sweep vocab --rounds 5 --warmup 2 \
    --methods "$peers,torch:eager" --out "$out/forward-only"
  run forward-tokens 70 "$python" -m flce.cli bench --mode fwd --sweep tokens --rounds 5 --warmup 2 \
    --methods "$peers" --out "$out/forward-only"
}

step_memory() {
  run memory-vocab 80 "$python" -m flce.cli bench --sweep vocab --rounds 2 --warmup 1 \
    --methods 'flce:triton[vblocks=16],flce:cutedsl[vblocks=16],liger:triton' --out "$out/memory-mode" --no-plots
}

step_features() {
  local feature
  for feature in none label_smoothing z_loss softcap weights bias token_scaling accuracy predicted all; do
    local features=()
    case $feature in
    none) ;;
    all) features=(--features label_smoothing,z_loss,softcap,weights,bias,token_scaling,accuracy,predicted) ;;
    *) features=(--features "$feature") ;;
    esac
    run "features-$feature" 40 "$python" -m flce.cli bench "${features[@]}" --rounds 5 --warmup 1 \
      --methods flce:cutedsl,flce:triton --out "$out/features/$feature" --no-plots
  done
  run features-fp16 50 "$python" -m flce.cli bench --dtype fp16 --rounds 3 --warmup 1 \
    --methods flce:cutedsl,flce:triton,liger:triton,cce --out "$out/features/fp16" --no-plots
}

# Target 5 at the issue's other five shapes: each feature against the featureless run, the
# default (cutedsl) with the floor, two runs per feature (V at N = 8192; N at V = 128256).
# SHAPE_FEATURES picks some (default: all ten and fp16) to split the step over two calls.
step_features_shapes() {
  local feature
  for feature in ${SHAPE_FEATURES:-none label_smoothing z_loss softcap weights bias token_scaling accuracy predicted all fp16}; do
    local features=()
    case $feature in
    none | fp16) ;;
    all) features=(--features label_smoothing,z_loss,softcap,weights,bias,token_scaling,accuracy,predicted) ;;
    *) features=(--features "$feature") ;;
    esac
    [ "$feature" = fp16 ] && features=(--dtype fp16)
    run "features-shapes-$feature-vocab" 40 "$python" -m flce.cli bench "${features[@]}" --tokens 8192 \
      --vocab 32000,151936,262144 --rounds 3 --warmup 1 --methods flce:cutedsl \
      --out "$out/features-shapes/$feature-vocab" --no-plots
    run "features-shapes-$feature-tokens" 40 "$python" -m flce.cli bench "${features[@]}" --tokens 4096,16384 \
      --vocab 128256 --rounds 3 --warmup 1 --methods flce:cutedsl \
      --out "$out/features-shapes/$feature-tokens" --no-plots
  done
}

step_kernel() {
  run ce-kernel 120 "$python" -m flce.cli bench --kernel ce --out "$out/ce-kernel"
}

step_fused_forward() {
  run fused-forward 200 "$python" benchmarks/fused_forward_check.py --vocab 128256,32000
}

step_autocast() {
  run autocast 120 "$python" benchmarks/autocast_check.py --rounds 3
  # fp16 under a loss scaler's 2^16: the forward gradient prescale against none, with errors
  run autocast-fp16 120 "$python" benchmarks/autocast_check.py --dtype fp16 --upstream 65536 --prescale-ab \
    --shapes 8192,128256,4096 --rounds 5
}

step_tp() {
  local world
  for world in 2 4 8; do
    [ "$world" -le "$gpu_count" ] || continue
    run "tp$world" 180 "$python" -m flce.cli bench --tp "$world" --out "$out/vocab-parallel"
  done
  run tp-tests 150 "$python" -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_gpu_vocab_parallel.py tests/parallel
}

step_heads() {
  run heads-tests 240 "$python" -m pytest -q -p no:cacheprovider -rfE --durations=10 -m gpu tests/heads
  run heads-logprobs 200 "$python" -m flce.cli bench --loss logprobs --rounds 5 --warmup 2 \
    --methods flce,torch --out "$out/heads"
  run heads-distill 240 "$python" -m flce.cli bench --loss distill --rounds 5 --warmup 2 \
    --methods flce,torch,liger --out "$out/heads"
}

step_frontier() {
  run frontier 170 "$python" -m flce.cli bench --frontier --tokens 8192 --vocab 128256,32000 --hidden 4096 \
    --frontier-points 4 --rounds 3 --warmup 1 --out "$out/memory-budget"
}

step_liger_memory() {
  run liger-memory 300 "$python" benchmarks/budget_vs_liger.py "$out/liger-memory" --rounds 3
}

step_block_kernels() {
  run block-kernels 150 "$python" benchmarks/block_gemm_kernels.py "$out/block-kernels" --rounds 7 --reps 4
  run block-widths 120 "$python" benchmarks/block_width_sweep.py "$out/block-kernels" --shapes 8192x128256 \
    --widths 8016,8192,8448,7936 --rounds 5
}

step_graph() {
  run graph 100 "$python" -m flce.cli bench --graph --rounds 5 --warmup 2 \
    --methods flce,torch:eager,torch:compile,liger,cce --out "$out/training-loop" --no-plots
  run graph-small 60 "$python" -m flce.cli bench --graph --tokens 1024 --hidden 1024 --vocab 32000 \
    --rounds 10 --warmup 3 --methods flce,torch:eager,liger --out "$out/training-loop" --no-plots
}

step_overlap() {
  run overlap-check 60 "$python" benchmarks/overlap_probe.py --check
  run overlap-128256 150 "$python" benchmarks/overlap_probe.py "$out/overlap/8192x128256" --blocks 2,4,8 --rounds 5
  run overlap-32000 90 "$python" benchmarks/overlap_probe.py "$out/overlap/8192x32000" --vocab 32000 \
    --blocks 2,4 --rounds 7
}

for step in "${steps[@]}"; do
  if ! declare -F "step_${step//-/_}" >/dev/null; then
    echo "unknown step '$step'" >&2
    exit 2
  fi
done
for step in "${steps[@]}"; do
  "step_${step//-/_}"
done
echo "== steps"
cat "$out/steps.txt"
for log in "$out"/tests-*.log "$out"/tp-tests.log "$out"/heads-tests.log; do
  [ -e "$log" ] || continue
  summary=$(grep -E '[0-9]+ (passed|failed|errors?|deselected)|no tests ran' "$log" | tail -1)
  echo "$(basename "$log"): ${summary:-no pytest summary (cut by its time limit?)}"
done
exit "$failed"
