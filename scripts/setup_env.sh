# Sourced by test.sh and bench.sh: finds Python >= 3.12, makes .venv, installs the pinned
# dependencies (again only when their list or the Python changes) and builds the extension in place
# with ninja (with nvcc when a CUDA toolkit is present), which recompiles only what changed.
# The first run takes minutes and says so; a re-run with nothing changed takes seconds.
#
# TORCH_VERSION picks the torch: default the newest of pyproject.toml's range, which the tests are
# run with. Another version gets its own venv (VENV, default .venv-torch$TORCH_VERSION) and, since
# an in-place build serves one torch, its own copy of the checkout, build/torch$TORCH_VERSION/
# (scripts/copy_checkout.py brings it up to date on every run), where the extension is built and
# where the caller goes on: test.sh runs pytest there. The two builds never overwrite each other.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

NEWEST_TORCH=2.14.1
TORCH_VERSION="${TORCH_VERSION:-$NEWEST_TORCH}"
if [ "$TORCH_VERSION" = "$NEWEST_TORCH" ]; then
  VENV="$(realpath -m "${VENV:-.venv}")"
else
  VENV="$(realpath -m "${VENV:-.venv-torch$TORCH_VERSION}")"
fi
PINS=(torch=="$TORCH_VERSION")
BUILD_TOOLS=(ninja setuptools wheel)

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

run_logged() {  # run_logged LOG COMMAND...: output into LOG; on failure shows its tail and exits
  local log=$1
  shift
  if ! "$@" >"$log" 2>&1; then
    echo "setup: FAILED: $*" >&2
    echo "setup: last lines of $PWD/$log:" >&2
    tail -n 40 "$log" >&2
    exit 1
  fi
}

setup_start=$SECONDS
mkdir -p build
if [ ! -x "$VENV/bin/python" ]; then
  python="$(find_python)"
  echo "setup: creating $VENV with $python (first run only)"
  "$python" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"

# The dependencies: pyproject.toml's, with every extra, the pins and the build tools; installed
# when the stamp (hash of that list and the Python version) changes.
read -ra DEPS < <(python -c 'import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
deps = project["dependencies"] + [d for extra in project["optional-dependencies"].values() for d in extra]
print(" ".join(dict.fromkeys(deps)))')
DEPS+=("${PINS[@]}" "${BUILD_TOOLS[@]}")
deps_stamp="$(printf '%s\n' "${DEPS[@]}" "$(python -VV)" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$VENV/deps.stamp" 2>/dev/null)" != "$deps_stamp" ]; then
  echo "setup: installing ${DEPS[*]} into $VENV"
  echo "setup:   (first run: about 1-2 minutes, mostly downloading torch; log: $PWD/build/pip-torch$TORCH_VERSION.log)"
  # No wheel cache: a CUDA build of torch is GBs, kept twice with one.
  run_logged "build/pip-torch$TORCH_VERSION.log" python -m pip install --no-cache-dir --upgrade pip "${DEPS[@]}"
  echo "$deps_stamp" >"$VENV/deps.stamp"
fi
if [ "$TORCH_VERSION" != "$NEWEST_TORCH" ]; then
  run_logged build/copy.log python scripts/copy_checkout.py "build/torch$TORCH_VERSION"
  cd "build/torch$TORCH_VERSION"
  mkdir -p build
  echo "setup: torch $TORCH_VERSION builds and runs in the copy $PWD"
fi
# The checkout on the venv's path, as an editable install would put it (the extension is built in place).
echo "$PWD" >"$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/fused_rl_ops_checkout.pth"

# setup.py finds the CUDA toolkit itself (fused_rl_ops/_cuda_home.py).
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
if compgen -G "fused_rl_ops/_C*.so" >/dev/null; then
  echo "setup: updating the extension (recompiles only changed sources; log: $PWD/build/build.log)"
else
  echo "setup: building the extension, first time: CPU kernels about 2 minutes, with the CUDA kernels"
  echo "setup:   (nvcc) 5-10 minutes on 2 cores; log: $PWD/build/build.log"
fi
build_start=$SECONDS
# The whole output goes to the log; ninja's step lines ([k/n] ... -c SOURCE) show the progress.
if ! python setup.py build_ext --inplace 2>&1 | tee build/build.log \
    | sed -un 's|^\(\[[0-9]*/[0-9]*\]\) .* -c \([^- ][^ ]*\) .*|setup:   \1 \2|p'; then
  echo "setup: FAILED: python setup.py build_ext --inplace; last lines of $PWD/build/build.log:" >&2
  tail -n 40 build/build.log >&2
  exit 1
fi
echo "setup: done in $((SECONDS - setup_start))s (build step $((SECONDS - build_start))s)"
