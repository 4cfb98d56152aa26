#!/usr/bin/env bash
# Builds the extension for the GPU machine on a machine without a GPU, so that scripts/gpu_check.sh
# spends none of its call compiling: against that machine's torch (2.11.0+cu130 on Python 3.12:
# PYTHON names a python with that torch), for its architecture (TORCH_CUDA_ARCH_LIST, default 9.0),
# in a copy of the checkout (build/gpu-build/, so the in-place build here is left alone); then the
# two files the package loads, the extension and its build info, go into gpu_build/fused_rl_ops/
# (git-ignored, about 3 MB) with the digest of the sources (gpu_build/SOURCES): the folder to bring
# along to the GPU machine's checkout. gpu_check.sh loads them where the checkout's sources are
# those and their build info names that machine's torch and GPU architecture, and builds there
# where they differ or do not load.
# Usage: PYTHON=/path/to/python3.12 scripts/build_for_gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
COPY=build/gpu-build CARRIED=gpu_build
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
if ! "$PY" -c 'import sys, torch; sys.exit(torch.version.cuda is None)'; then
  echo "build_for_gpu: $PY's torch has no CUDA support" >&2
  exit 1
fi
if ! CUDA_HOME="$("$PY" fused_rl_ops/_cuda_home.py)"; then
  echo "build_for_gpu: no CUDA toolkit found (set CUDA_HOME)" >&2
  exit 1
fi
export CUDA_HOME
mkdir -p "$COPY"
"$PY" scripts/copy_checkout.py "$COPY"
echo "build_for_gpu: torch $("$PY" -c 'import torch; print(torch.__version__)'), sm ${TORCH_CUDA_ARCH_LIST}," \
  "in $COPY (log: $COPY/build.log)"
start=$SECONDS
if ! (cd "$COPY" && "$PY" setup.py build_ext --inplace >build.log 2>&1); then
  tail -n 30 "$COPY/build.log" >&2
  exit 1
fi
rm -rf "$CARRIED"
mkdir -p "$CARRIED/fused_rl_ops"
cp "$COPY"/fused_rl_ops/_C*.so "$COPY/fused_rl_ops/_build_info.py" "$CARRIED/fused_rl_ops/"
# What it was built from: gpu_check.sh builds anew where the checkout's sources differ.
bash scripts/sources_digest.sh "$COPY" >"$CARRIED/SOURCES"
echo "build_for_gpu: built in $((SECONDS - start))s; $CARRIED/: $(du -sh "$CARRIED" | cut -f1)"
cat "$CARRIED/fused_rl_ops/_build_info.py"
