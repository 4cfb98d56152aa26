# Sourced by test.sh and bench.sh: finds Python >= 3.12, makes .venv, installs the pinned
# dependencies and builds the extension (with nvcc when a CUDA toolkit is present).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

find_python() {
  local candidates=("${PYTHON:-}" python3.12 python3)
  candidates+=(/root/.pyenv/versions/3.12.*/bin/python3)
  for py in "${candidates[@]}"; do
    [ -n "$py" ] || continue
    if "$py" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$py"
      return 0
    fi
  done
  echo "no Python >= 3.12 found; set PYTHON=/path/to/python3.12" >&2
  return 1
}

if [ ! -x .venv/bin/python ]; then
  "$(find_python)" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.14.1 "megatron-core==0.19.2" xxhash pytest numpy matplotlib ninja setuptools wheel

if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda
fi
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
python -m pip install -q --no-build-isolation -e ".[megatron,test,bench]"
