#!/usr/bin/env bash
# Sets up .venv (torch, megatron-core, the nvcc build) and runs the whole test suite.
source "$(dirname "$0")/setup_env.sh"
python -m pytest -q "$@"
