"""The tests. benchmarks/ goes on sys.path, as when `python benchmarks/x.py` runs: the tests run the benchmark
scripts, and build their tiny random-weight models with the benchmarks' builder (benchmarks/common.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
