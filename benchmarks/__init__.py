"""Benchmark scripts (not shipped): each runs from the repo root as `PYTHONPATH=$PWD python benchmarks/NAME.py`
and answers `--help` without a GPU; what they share is benchmarks/common.py. Raw results: benchmarks/results/;
the current figures: docs/benchmarks.md."""
