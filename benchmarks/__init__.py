"""The benchmarks: one module per op (python -m benchmarks.bench_<op>), the shared timing, load,
table, result and plot helpers, and report (python -m benchmarks.report DIR) that gathers their
JSON into DIR/REPORT.md."""
