"""The benchmarks are scripts, not a package: their folder goes on sys.path so that a test imports one as its
script does (``import bench_w4a16``, which imports ``common``)."""

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
