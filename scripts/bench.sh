#!/usr/bin/env bash
# Sets up .venv and runs every benchmark (python -m benchmarks.bench_<op>, from the repository root)
# against the naive PyTorch path and the peers that are installed, writing JSON and a plot per
# benchmark into bench_results/, then a summary table of headline figures and
# bench_results/REPORT.md. Extra arguments (for example --quick or --device cpu) are passed to
# every benchmark.
source "$(dirname "$0")/setup_env.sh"
mkdir -p bench_results
for bench in benchmarks/bench_*.py; do
  name="$(basename "$bench" .py)"
  echo "=== $name"
  python -m "benchmarks.$name" --json "bench_results/$name.json" "$@"
done
python -m benchmarks.report bench_results
