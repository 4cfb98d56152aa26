#!/usr/bin/env bash
# On a machine with a package registry: downloads into wheelhouse/ (git-ignored) the wheels that
# scripts/gpu_check.sh installs on a GPU machine that reaches no registry (CPython 3.12, x86-64
# Linux): megatron-core (pyproject.toml's [megatron] pin) and the packaging it needs (>= 24.2), the
# benchmark peers Cut Cross-Entropy and Liger-Kernel (pure Python; they use the machine's torch and
# triton), and pytest-timeout (the per-test timeout of the test stage; where the machine has it
# already, this copy comes first on the path and the machine's is left alone), about 3.4 MB in all.
# Send wheelhouse/ along with the checkout (docs/testing.md).
# Transformer Engine is no such wheel: it is benchmarked only where the GPU machine has it already.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
megatron="$("$python" -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["megatron"])')"
WHEELS=("$megatron" "packaging>=24.2" liger-kernel==0.8.5 cut-cross-entropy==25.1.1 pytest-timeout==2.4.0)
# megatron-core's wheel is tagged manylinux_2_28 (compiled parts); the others are py3-none-any.
"$python" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d wheelhouse "${WHEELS[@]}"
ls -l wheelhouse
