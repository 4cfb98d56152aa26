#!/usr/bin/env bash
# The digest of the sources the extension is built from (csrc/, setup.py) in the checkout DIR
# (default: this script's): scripts/build_for_gpu.sh writes it beside the build it carries, and
# scripts/gpu_check.sh loads that build only where its checkout's digest is the same.
# Usage: scripts/sources_digest.sh [DIR]
set -euo pipefail
cd "${1:-$(dirname "$0")/..}"
# The C locale's order of the files, so that the digest of the same sources is the same on every machine.
find csrc setup.py -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1
