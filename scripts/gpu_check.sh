#!/usr/bin/env bash
# The first run on a GPU machine, one call of about 8 minutes (TOTAL_S, default 480) that yields
# every number, with the build scripts/build_for_gpu.sh made beforehand (gpu_build/, brought along):
# loaded where it matches the machine's torch and GPU, else built here. Needs Python 3.12 with
# torch, nvcc, ninja and pytest; no package registry:
# megatron-core, the benchmark peers and pytest-timeout come from wheelhouse/
# (scripts/fetch_peer_wheels.sh), installed into build/peers. The stages, in order:
#   peers (beside the build), the carried build or a build for the local GPU only, build_info;
#   tests: the CUDA tests only (-m per_device; every op's first file before any op's second), beside the three compute-sanitizer tools (memcheck
#     with PYTORCH_NO_CUDA_MEMORY_CACHING=1; racecheck and synccheck on the package's kernels only)
#     on scripts/sanitizer_cases.py;
#   the kernel benchmarks, in the op table's order (python -m tests.helpers.op_table
#     benchmark-runs): the headline, chosen_logprob's main shape, first; then REPORT.md.
# Each stage has a budget, cut to what is left before the deadline; a stage out of time gets SIGINT
# (pytest then writes its junit report and failure list; a benchmark has logged its rows so far)
# and SIGKILL GRACE_S later. A test that hangs where no signal is serviced (a CUDA synchronisation)
# still leaves its traceback (faulthandler) and the counts of the tests before it (pytest -v's
# lines, which the summary counts where no junit report was written). OUTDIR gets each stage's log,
# junit.xml, bench_<op>.jsonl (each row as it is measured), bench_<op>.json / .png, REPORT.md and
# summary.json, rewritten after every change: the run's facts and plan, each stage's status
# (running, passed, failed, cut, skipped), exit code, seconds and why it was skipped. The time plan
# is in docs/testing.md.
# REHEARSAL=1 runs the same stages on this machine's CPU against stand-ins: the carried build
# loaded where it matches this torch and imports, else the extension already built here (no build),
# the CPU as the device, the benchmarks' quick shapes, and scripts/rehearsal/compute-sanitizer,
# which runs the cases and checks nothing.
# Usage: scripts/gpu_check.sh OUTDIR
set -uo pipefail
OUT="${1:?usage: gpu_check.sh OUTDIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
rm -f "$OUT"/summary.json "$OUT"/junit.xml "$OUT"/*.log "$OUT"/bench_*.json* "$OUT"/REPORT.md
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
REHEARSAL="${REHEARSAL:-0}"
WHEELHOUSE="${WHEELHOUSE:-wheelhouse}"
PEERS="$(realpath -m "${PEERS_DIR:-build/peers}")"
TOTAL_S="${TOTAL_S:-480}"
# Budgets (seconds), each cut to what is left before the deadline less RESERVE_S (the report and
# the summary at the end) and GRACE_S (a stage out of its time gets SIGINT, then SIGKILL GRACE_S
# later); a stage with less than MIN_STAGE_S left is skipped. The benchmarks' budgets are the op
# table's; <STAGE>_S (e.g. BENCH_VALUE_HEAD_S) overrides one.
PEERS_S="${PEERS_S:-60}" BUILD_S="${BUILD_S:-200}" TESTS_S="${TESTS_S:-120}" SANITIZER_S="${SANITIZER_S:-120}"
REPORT_S=60 RESERVE_S=15 MIN_STAGE_S="${MIN_STAGE_S:-20}" GRACE_S="${GRACE_S:-15}"
TEST_TIMEOUT_S="${TEST_TIMEOUT_S:-60}"  # per test, with pytest-timeout
# faulthandler dumps the stacks of a test still running 10 s later, never while pytest-timeout's failure
# unwinds it: its dump reads a running thread's frames unlocked (3 crashes in 36 timed-out tests).
FAULTHANDLER_S=$((TEST_TIMEOUT_S + 10))
deadline=$((SECONDS + TOTAL_S))

summary() { "$PY" scripts/gpu_check_summary.py "$OUT" "$@"; }
left() { echo $((deadline - SECONDS - RESERVE_S - GRACE_S)); }  # the most a stage starting now may take

stage() {  # stage NAME BUDGET_S COMMAND...: runs COMMAND, output in OUT/NAME.log; status in summary.json;
  # returns 0 where it passed, 2 where it was skipped for lack of time, else 1
  local name=$1 limit=$2 start=$SECONDS status
  shift 2
  [ "$(left)" -lt "$limit" ] && limit=$(left)
  if [ "$limit" -lt "$MIN_STAGE_S" ]; then
    echo "=== $name: skipped, ${limit}s left for it"
    summary stage "$name" status=skipped reason="no time left: ${limit}s for it"
    return 2
  fi
  echo "=== $name (at most ${limit}s)"
  summary stage "$name" status=running limit_s="$limit"
  timeout -s INT -k "$GRACE_S" "$limit" "$@" >"$OUT/$name.log" 2>&1
  local code=$?
  case $code in
    0) status=passed ;;
    124 | 137) status=cut ;;  # out of time: SIGINT, or SIGKILL GRACE_S later
    *) status=failed ;;
  esac
  summary stage "$name" status=$status exit=$code seconds=$((SECONDS - start))
  tail -n 15 "$OUT/$name.log"
  echo "=== $name: $status (exit $code) in $((SECONDS - start))s"
  [ "$status" = passed ]
}

# The build scripts/build_for_gpu.sh made beforehand (CARRIED_BUILD/fused_rl_ops/: the extension and
# its build info; CARRIED_BUILD/SOURCES: the digest of the sources it was built from), put in place
# where it was built from this checkout's sources, its info names the running torch (and on a GPU
# this GPU's architecture) and it then imports (on a GPU with its CUDA kernels); prints which build
# is loaded, or why none is.
CARRIED_BUILD="${CARRIED_BUILD:-gpu_build}"
load_carried_build() {
  local info="$CARRIED_BUILD/fused_rl_ops/_build_info.py"
  local files=("$CARRIED_BUILD"/fused_rl_ops/_C*.so "$info")  # an extension per Python it was built for
  local name placed=() loaded
  if [ ! -f "${files[0]}" ] || [ ! -f "$info" ]; then
    echo "no carried build in $CARRIED_BUILD/"
    return 1
  fi
  if [ "$(cat "$CARRIED_BUILD/SOURCES" 2>/dev/null)" != "$(bash scripts/sources_digest.sh)" ]; then
    echo "the carried build was made from other sources than this checkout's (csrc/, setup.py)"
    return 1
  fi
  "$PY" - "$info" "$DEVICE" <<'EOF' || return 1
import runpy, sys, torch
info, device = runpy.run_path(sys.argv[1]), sys.argv[2]
if info["TORCH"] != torch.__version__:
    print(f"the carried build is for torch {info['TORCH']}, here torch {torch.__version__}")
    sys.exit(1)
if device == "cuda":
    arch = "%d.%d" % torch.cuda.get_device_capability()
    if arch not in (info["CUDA_ARCHS"] or "").replace("+PTX", "").replace(";", " ").split():
        print(f"the carried build is for CUDA architectures {info['CUDA_ARCHS']}, here {arch}")
        sys.exit(1)
EOF
  # Renamed into place, never copied onto a file a process may have loaded (cp truncates it under
  # that process); what it replaces is renamed aside, and put back where the carried build does not load.
  for name in "${files[@]##*/}"; do
    cmp -s "$CARRIED_BUILD/fused_rl_ops/$name" "fused_rl_ops/$name" && continue
    cp "$CARRIED_BUILD/fused_rl_ops/$name" "fused_rl_ops/.carried.$name"
    if [ -e "fused_rl_ops/$name" ]; then mv "fused_rl_ops/$name" "fused_rl_ops/.replaced.$name"; fi
    mv "fused_rl_ops/.carried.$name" "fused_rl_ops/$name"
    placed+=("$name")
  done
  # Its last line: the build loaded, or why it does not load.
  if ! loaded="$("$PY" -c 'import sys, fused_rl_ops
from fused_rl_ops import _build_info as b
if sys.argv[1] == "cuda" and not fused_rl_ops.has_cuda_kernels():
    sys.exit("it has no CUDA kernels")
print(f"torch {b.TORCH}, CUDA {b.CUDA}, architectures {b.CUDA_ARCHS}")' "$DEVICE" 2>&1)"; then
    for name in "${placed[@]}"; do
      if [ -e "fused_rl_ops/.replaced.$name" ]; then
        mv "fused_rl_ops/.replaced.$name" "fused_rl_ops/$name"
      else
        rm -f "fused_rl_ops/$name"
      fi
    done
    echo "the carried build does not load: ${loaded##*$'\n'}"
    return 1
  fi
  for name in "${placed[@]}"; do rm -f "fused_rl_ops/.replaced.$name"; done
  echo "carried build loaded from $CARRIED_BUILD/: ${loaded##*$'\n'}"
}

skip() {  # skip NAME REASON
  echo "=== $1: skipped, $2"
  summary stage "$1" status=skipped reason="$2"
}

if CUDA_HOME="$("$PY" fused_rl_ops/_cuda_home.py)"; then  # compute-sanitizer is in its bin/
  export CUDA_HOME PATH="$CUDA_HOME/bin:$PATH"
else
  unset CUDA_HOME
fi
if [ "$REHEARSAL" = 1 ]; then
  DEVICE=cpu SANITIZER=scripts/rehearsal/compute-sanitizer BENCH_ARGS=(--device cpu --quick)
else
  DEVICE=cuda SANITIZER=compute-sanitizer BENCH_ARGS=(--device cuda)
  if arch="$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')"; then
    export TORCH_CUDA_ARCH_LIST="$arch"  # else setup.py's default architectures (and no GPU to run on)
  fi
  export MAX_JOBS="$(nproc)"
fi
mapfile -t facts < <("$PY" - <<'EOF'
import platform, sys, torch
print(f"python={platform.python_version()}")
print(f"torch={torch.__version__}")
print(f"gpu={torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
EOF
)
summary run rehearsal="$REHEARSAL" total_s="$TOTAL_S" device="$DEVICE" cpus="$(nproc)" "${facts[@]}" \
  cuda_home="${CUDA_HOME:-none}" cuda_archs="${TORCH_CUDA_ARCH_LIST:-none}"

# --- peers (megatron-core, packaging, Cut Cross-Entropy, Liger-Kernel, pytest-timeout) beside the build ---
if "$PY" -m pip --version >/dev/null 2>&1; then
  INSTALL_WHEELS=("$PY" -m pip install --no-index --no-deps --target "$PEERS")
else  # a wheel is a zip of the files to install
  INSTALL_WHEELS=("$PY" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' "$PEERS")
fi
if compgen -G "$WHEELHOUSE/*.whl" >/dev/null; then
  stage peers "$PEERS_S" "${INSTALL_WHEELS[@]}" "$WHEELHOUSE"/*.whl &
else
  skip peers "no wheels in $WHEELHOUSE/ (scripts/fetch_peer_wheels.sh): the peers and megatron-core already installed are used, if any"
fi
start=$SECONDS
carried="$(load_carried_build)"
loaded=$?
echo "=== $carried"
summary stage build carried_build_s=$((SECONDS - start))
if [ "$loaded" = 0 ]; then
  skip build "$carried"
elif [ "$REHEARSAL" = 1 ]; then
  skip build "rehearsal: $carried; uses the extension built here, no build (one with other settings would replace it)"
else
  stage build "$BUILD_S" "$PY" setup.py build_ext --inplace
fi
wait
export PYTHONPATH="$PWD:$PEERS${PYTHONPATH:+:$PYTHONPATH}"
# pytest-timeout: the machine's, or the wheelhouse's just installed.
TEST_TIMEOUT=()
if "$PY" -c 'import pytest_timeout' 2>/dev/null; then
  TEST_TIMEOUT=(--timeout "$TEST_TIMEOUT_S")
fi
stage build_info 60 "$PY" -m fused_rl_ops
case $? in
  0) ready=yes ;;
  2) ready="no time was left to import the extension (build_info)" ;;
  *) ready="the extension does not import (build_info.log)" ;;
esac
if [ "$ready" = yes ] && [ "$DEVICE" = cuda ] &&
    ! "$PY" -c 'import fused_rl_ops, sys; sys.exit(not fused_rl_ops.has_cuda_kernels())'; then
  ready="the build has no CUDA kernels (build.log, build_info.log)"
fi
# What the test stage runs: the CUDA tests (tests/tooling/test_gpu_check.py gives a stand-in), every op's
# first file before any op's second (the op table's order), so that a cut stage has checked every op.
if [ -n "${TEST_SELECTION:-}" ]; then
  read -ra TEST_SELECTION <<<"$TEST_SELECTION"
elif [ "$ready" = yes ] && test_files="$("$PY" -m tests.helpers.op_table test-files tests)"; then
  mapfile -t TEST_SELECTION <<<"$test_files"
  TEST_SELECTION=(-m per_device "${TEST_SELECTION[@]}")
else
  TEST_SELECTION=(-m per_device tests)
fi
# The benchmark stages, from the op table: STAGE BUDGET_S MODULE [ARGUMENT...] a line; a budget
# overridden by <STAGE>_S.
BENCH_RUNS=() bench_plan="" bench_ready=$ready
if [ "$ready" = yes ] && ! table="$("$PY" -m tests.helpers.op_table benchmark-runs)"; then
  bench_ready="the op table does not read (python -m tests.helpers.op_table benchmark-runs)"
fi
if [ "$bench_ready" = yes ]; then
  while read -r name budget rest; do
    override="${name^^}_S"
    BENCH_RUNS+=("$name ${!override:-$budget} $rest")
    bench_plan+="$name ${!override:-$budget}, "
  done <<<"$table"
fi
summary run per_test_timeout="${TEST_TIMEOUT[1]:-none: pytest-timeout is not installed}" \
  plan="peers ${PEERS_S} beside build ${BUILD_S}; tests ${TESTS_S} beside 3 sanitizers ${SANITIZER_S} each; ${bench_plan}report ${REPORT_S}; all within ${TOTAL_S}"

# --- the CUDA tests beside the sanitizers ---
SANITIZERS=(sanitizer_memcheck sanitizer_racecheck sanitizer_synccheck)
if [ "$ready" = yes ]; then
  # -v: each test's line as it ends, so a run killed before pytest writes its junit report still
  # has its counts, and names the test it was in; faulthandler prints every thread's stack of a
  # test still running 10 s past the timeout, where pytest-timeout's signal cannot interrupt it (a CUDA sync).
  stage tests "$TESTS_S" env FUSED_RL_OPS_TEST_DEVICES="$DEVICE" "$PY" -m pytest -v -p no:cacheprovider \
    --maxfail=50 --durations=15 -o faulthandler_timeout="$FAULTHANDLER_S" "${TEST_TIMEOUT[@]}" \
    --junitxml="$OUT/junit.xml" "${TEST_SELECTION[@]}" &
  # memcheck sees an overrun inside torch's cached blocks only when every tensor has its own allocation.
  stage sanitizer_memcheck "$SANITIZER_S" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
    "$SANITIZER" --tool memcheck --error-exitcode 1 "$PY" scripts/sanitizer_cases.py "$DEVICE" &
  # racecheck and synccheck on the package's kernels only (their mangled names hold its namespace,
  # fused_rl_ops): not cuBLAS's and ATen's, which they would slow down and whose reports would
  # fail the stage.
  for tool in racecheck synccheck; do
    stage "sanitizer_$tool" "$SANITIZER_S" "$SANITIZER" --tool "$tool" --kernel-name kns=fused_rl_ops \
      --error-exitcode 1 "$PY" scripts/sanitizer_cases.py "$DEVICE" &
  done
  wait
else
  for name in tests "${SANITIZERS[@]}"; do skip "$name" "$ready"; done
fi

# --- the kernel benchmarks, in the op table's order (the headline first), alone on the machine ---
[ "$bench_ready" = yes ] || skip benchmarks "$bench_ready"
for run in "${BENCH_RUNS[@]}"; do
  read -r name budget module args <<<"$run"
  read -ra args <<<"$args"
  if [ ! -f "benchmarks/$module.py" ]; then  # an op of the table whose benchmark is not written yet
    skip "$name" "benchmarks/$module.py does not exist"
    continue
  fi
  stage "$name" "$budget" "$PY" -m "benchmarks.$module" "${BENCH_ARGS[@]}" "${args[@]}" --json "$OUT/$name.json"
  grep '^peer ' "$OUT/$name.log" || true  # which peers ran, which are missing and why
done
if compgen -G "$OUT/bench_*.json" >/dev/null; then
  RESERVE_S=0 stage report "$REPORT_S" "$PY" -m benchmarks.report "$OUT"
else
  skip report "no benchmark wrote its JSON"
fi
summary run seconds=$SECONDS
cat "$OUT/summary.json"
