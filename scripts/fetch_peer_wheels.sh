#!/usr/bin/env bash
# On a machine with a package registry: downloads the pure-Python wheels of the benchmark peers
# (Apple's Cut Cross-Entropy, Liger-Kernel) for Python 3.12 into wheelhouse/ (git-ignored), which
# scripts/gpu_check.sh installs from on a GPU machine that reaches no registry. Send wheelhouse/
# along with the checkout. Transformer Engine is no pure-Python wheel: it is benchmarked only where
# the GPU machine has it installed already.
set -euo pipefail
cd "$(dirname "$0")/.."
PEER_WHEELS=(cut-cross-entropy liger-kernel)
python="${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
"$python" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform any -d wheelhouse "${PEER_WHEELS[@]}"
ls -l wheelhouse
