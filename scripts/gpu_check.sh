#!/usr/bin/env bash
# One run on a GPU machine (Python 3.12 with torch, nvcc, pytest; no package registry needed):
# builds for the local GPU only, runs the test suite with the op tests on CUDA, compute-sanitizer
# (memcheck, racecheck, synccheck) on small calls of every CUDA kernel, and the kernel benchmarks on CUDA
# against the peers (installed from wheelhouse/, made by scripts/fetch_peer_wheels.sh, when present).
# Every stage's time limit is cut to what is left of TOTAL_S (default 480 s), so the whole run
# fits in 8 minutes.
# Usage: scripts/gpu_check.sh OUTDIR   -> OUTDIR/summary.json plus logs, junit.xml, bench_*.json / .png
set -uo pipefail
OUT="${1:?usage: gpu_check.sh OUTDIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
if CUDA_HOME="$($PY fused_rl_ops/_cuda_home.py)"; then  # compute-sanitizer is in its bin/
  export CUDA_HOME PATH="$CUDA_HOME/bin:$PATH"
else
  unset CUDA_HOME
  echo "=== no CUDA toolkit found (fused_rl_ops/_cuda_home.py): the build has no CUDA kernels"
fi
export TORCH_CUDA_ARCH_LIST="$($PY -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')"
export MAX_JOBS="$(nproc)"

deadline=$((SECONDS + ${TOTAL_S:-480}))
declare -A status seconds
step() {  # step NAME TIMEOUT_S COMMAND...: runs one stage (at most until the deadline), logging to OUT/NAME.log
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  if [ $((deadline - SECONDS)) -lt "$limit" ]; then limit=$((deadline - SECONDS)); fi
  if [ "$limit" -le 0 ]; then
    echo "=== $name: skipped, no time left"
    status[$name]=124 seconds[$name]=0
    return
  fi
  echo "=== $name"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  status[$name]=$?
  seconds[$name]=$((SECONDS - start))
  tail -n 25 "$OUT/$name.log"
  echo "=== $name: exit ${status[$name]} in ${seconds[$name]}s"
}

step build 240 $PY setup.py build_ext --inplace
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G "wheelhouse/*.whl" >/dev/null; then  # the peers, into build/peers (nothing installed system-wide)
  for wheel in wheelhouse/*.whl; do
    peer="peer_$(basename "$wheel" | cut -d- -f1)"
    step "$peer" 60 $PY -m pip install --no-index --no-deps --target build/peers "$wheel"
    [ "${status[$peer]}" = 0 ] || echo "=== could not install $(basename "$wheel"): its benchmarks list it as missing"
  done
  export PYTHONPATH="$PYTHONPATH:$PWD/build/peers"
else
  echo "=== no wheelhouse/: benchmarking only the peers already installed (see scripts/fetch_peer_wheels.sh)"
fi
# The op tests on CUDA only, without the kernels-on-CPU harness: CI runs every CPU test; the GPU's
# minutes go to what only it can run. Not -x: a first GPU run should report every failure at once.
FUSED_RL_OPS_TEST_DEVICES=cuda step tests 200 $PY -m pytest -q --maxfail=30 --durations=10 -m "not kernels_on_cpu" \
  --junitxml="$OUT/junit.xml" tests
for tool in memcheck racecheck synccheck; do
  step "sanitizer_$tool" 90 compute-sanitizer --tool "$tool" --error-exitcode 1 $PY scripts/sanitizer_cases.py
done
for name in bench_chosen_logprob bench_clamped_swiglu bench_value_head; do  # the kernel benchmarks
  step "$name" 150 $PY -m "benchmarks.$name" --device cuda --json "$OUT/$name.json"
  grep '^peer ' "$OUT/$name.log" || true  # which peers ran, which are missing and why
done
step report 30 $PY -m benchmarks.report "$OUT"

{
  echo "{"
  first=1
  for name in "${!status[@]}"; do
    [ $first = 1 ] || echo ","
    first=0
    printf '  "%s": {"exit": %d, "seconds": %d}' "$name" "${status[$name]}" "${seconds[$name]}"
  done
  echo
  echo "}"
} >"$OUT/summary.json"
cat "$OUT/summary.json"
