#!/usr/bin/env bash
# Sets up .venv and runs every benchmark against the naive PyTorch path and the peers that are
# installed, writing JSON and a plot per benchmark into bench_results/, then a summary table of
# headline figures and bench_results/REPORT.md. Extra arguments (for example --quick or
# --device cpu) are passed to every benchmark.
source "$(dirname "$0")/setup_env.sh"
mkdir -p bench_results
cd benchmarks
for bench in bench_*.py; do
  name="${bench%.py}"
  echo "=== $name"
  python "$bench" --json "../bench_results/$name.json" "$@"
done
python report.py ../bench_results
