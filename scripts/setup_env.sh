# Sourced by test.sh and bench.sh: makes the venv of a stack, installs its pinned dependencies
# (again only when their list or the Python changes) and builds the extension in place with ninja
# (with nvcc when a CUDA toolkit is present), which recompiles only what changed. The first run
# takes minutes and says so; a re-run with nothing changed takes seconds.
#
# STACK picks the pins, each the end of pyproject.toml's ranges that one kind of user runs:
#   newest (default): Python 3.13, torch 2.15.0, megatron-core 0.19.2, transformers 5.23.0; in .venv,
#     built in the checkout.
#   verl: verl 0.9.1's stack: Python 3.12, torch 2.11.0, megatron-core 0.18.0, transformers 5.10.4,
#     and verl itself without its inference extras (--no-deps, with the packages its Megatron path
#     imports). In .venv-verl; since an in-place build serves one torch, it builds and runs in its
#     own copy of the checkout, build/verl/ (scripts/copy_checkout.py brings it up to date on every
#     run), where the caller goes on: test.sh runs pytest there.
# PYTHON=/path/to/python picks the interpreter (default: the stack's version, found on PATH or
# under pyenv); VENV another venv. A venv whose Python is not the one wanted is refused, not remade.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

STACK="${STACK:-newest}"
NO_DEPS=()
case "$STACK" in
  newest)
    PYTHON_VERSION=3.13
    PINS=(torch==2.15.0 megatron-core==0.19.2 transformers==5.23.0)
    VENV="$(realpath -m "${VENV:-.venv}")"
    ;;
  verl)
    PYTHON_VERSION=3.12
    # verl's base dependencies (wandb, datasets, ray[default], ...) serve its trainer; its Megatron
    # path imports ray, tensordict, omegaconf (hydra-core) and codetiming.
    PINS=(torch==2.11.0 megatron-core==0.18.0 transformers==5.10.4 ray==2.60.0 tensordict==0.10.0 hydra-core==1.3.8
          codetiming==1.4.0)
    NO_DEPS=(verl==0.9.1)
    VENV="$(realpath -m "${VENV:-.venv-verl}")"
    ;;
  *)
    echo "setup: unknown STACK=$STACK: newest (the default) or verl" >&2
    exit 1
    ;;
esac
BUILD_TOOLS=(ninja setuptools wheel)

find_python() {  # the stack's Python: PYTHON, else python3.X on PATH, else pyenv's build (its shims need PYENV_VERSION)
  local candidates=("python$PYTHON_VERSION" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$PYTHON_VERSION".*/bin/python3)
  [ -z "${PYTHON:-}" ] || candidates=("$PYTHON")
  for py in "${candidates[@]}"; do
    if "$py" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$py"
      return 0
    fi
  done
  echo "setup: no Python $PYTHON_VERSION found for STACK=$STACK; set PYTHON=/path/to/python$PYTHON_VERSION" >&2
  return 1
}

python_version() {
  "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])'
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
# One set-up of a stack at a time: a second run started beside the first (.ci/run starts two on the
# newest stack) waits here for the first's set-up, then finds everything done.
exec {setup_lock}>"build/setup-$STACK.lock"
if ! flock -n "$setup_lock"; then
  echo "setup: waiting for the set-up of STACK=$STACK that another run is doing"
  flock "$setup_lock"
fi
python="$(find_python)"
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV with $python (Python $(python_version "$python"), first run only)"
  "$python" -m venv "$VENV"
elif [ "$(python_version "$VENV/bin/python")" != "$(python_version "$python")" ]; then
  echo "setup: $VENV has Python $(python_version "$VENV/bin/python"), STACK=$STACK wants" \
    "$(python_version "$python"): remove it (rm -r $VENV) or set VENV to another path" >&2
  exit 1
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"

# The dependencies: pyproject.toml's, with every extra, the stack's pins and the build tools;
# installed when the stamp (hash of that list and the Python version) changes.
read -ra DEPS < <(python -c 'import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
deps = project["dependencies"] + [d for extra in project["optional-dependencies"].values() for d in extra]
print(" ".join(dict.fromkeys(deps)))')
DEPS+=("${PINS[@]}" "${BUILD_TOOLS[@]}")
deps_stamp="$(printf '%s\n' "${DEPS[@]}" "${NO_DEPS[@]}" "$(python -VV)" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$VENV/deps.stamp" 2>/dev/null)" != "$deps_stamp" ]; then
  echo "setup: installing ${DEPS[*]} ${NO_DEPS[*]} into $VENV"
  echo "setup:   (first run: 2-4 minutes, mostly downloading torch; log: $PWD/build/pip-$STACK.log)"
  # A machine's global pip constraints (a cap on torch) would refuse the stack's pins: an empty
  # constraint file lifts them for these commands only. No wheel cache: a CUDA build of torch is
  # GBs, kept twice with one.
  : >build/no-constraints.txt
  pip=(env PIP_CONSTRAINT="$PWD/build/no-constraints.txt" python -m pip install --no-cache-dir)
  run_logged "build/pip-$STACK.log" "${pip[@]}" --upgrade pip "${DEPS[@]}"
  if [ ${#NO_DEPS[@]} -gt 0 ]; then
    run_logged "build/pip-$STACK-no-deps.log" "${pip[@]}" --no-deps "${NO_DEPS[@]}"
  fi
  # verl 0.9.1's wheel installs a top-level package named `tests`, which would shadow the checkout's
  # tests/ in the subprocesses that import tests.<module>: this venv's copy is removed.
  python -c 'import os, shutil, sysconfig; shutil.rmtree(os.path.join(sysconfig.get_paths()["purelib"], "tests"), ignore_errors=True)'
  echo "$deps_stamp" >"$VENV/deps.stamp"
fi
if [ "$STACK" != newest ]; then
  run_logged build/copy.log python scripts/copy_checkout.py "build/$STACK"
  cd "build/$STACK"
  mkdir -p build
  echo "setup: STACK=$STACK builds and runs in the copy $PWD"
fi
# The checkout on the venv's path, as an editable install would put it (the extension is built in place).
echo "$PWD" >"$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/fused_rl_ops_checkout.pth"

# setup.py finds the CUDA toolkit itself (fused_rl_ops/_cuda_home.py).
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
# What the build depends on: the sources, pyproject.toml, the Python, torch, the toolkit and
# setup.py's knobs; the stamp also names the extension it made (time and size: one built otherwise
# since is built again). When none changed, the build is not run: setup.py would relink the
# extension and copy it in place, under another run of this checkout that may be importing it.
build_inputs="$(printf '%s\n' "$(bash scripts/sources_digest.sh .)" "$(sha256sum pyproject.toml)" "$(python -VV)" \
  "$(python -c 'import importlib.metadata; print(importlib.metadata.version("torch"))')" \
  "$(python fused_rl_ops/_cuda_home.py || true)" "${FUSED_RL_OPS_CPU_ONLY:-}" "${TORCH_CUDA_ARCH_LIST:-}" \
  | sha256sum | cut -d' ' -f1)"
extension="fused_rl_ops/_C$(python -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
build_stamp() {  # the inputs, and the extension now in place
  echo "$build_inputs $(stat -c '%Y %s' "$extension" 2>/dev/null)"
}
if [ -f "$extension" ] && [ "$(cat build/build.stamp 2>/dev/null)" = "$(build_stamp)" ]; then
  echo "setup: done in $((SECONDS - setup_start))s (the extension is up to date)"
else
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
  build_stamp >build/build.stamp
  echo "setup: done in $((SECONDS - setup_start))s (build step $((SECONDS - build_start))s)"
fi
exec {setup_lock}>&-
