#!/usr/bin/env bash
# Sets up .venv and runs every benchmark against the naive PyTorch path, writing JSON (and plots)
# into bench_results/ and printing each benchmark's summary table. Extra arguments (for example
# --quick or --device cpu) are passed to every benchmark.
source "$(dirname "$0")/setup_env.sh"
mkdir -p bench_results
cd benchmarks
for bench in bench_*.py; do
  name="${bench%.py}"
  echo "=== $name"
  python "$bench" --json "../bench_results/$name.json" "$@"
done
