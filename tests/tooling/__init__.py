"""The repository's tooling: docs, layout limits, op table and contract, benchmarks, build, install, GPU script."""
