"""The tests: unit, integration through the real CLI, and the benchmarks' own (tests/test_benchmarks.py)."""
