"""The GPU benchmarks' CPU plumbing modes (``--smoke``, Triton's interpreter): the GPU runs cannot be tested here,
but a script that fails on import or on its own bookkeeping would otherwise only be found on the GPU machine."""

import os
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
import triton

ROOT = Path(__file__).resolve().parents[2]


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


# Triton 3.6's interpreter converts one-element arrays to Python scalars, which NumPy 2.5 refuses ("only
# 0-dimensional arrays can be converted to Python scalars"): the GPU machine has both, CI's newer Triton has not.
OLD_INTERPRETER = _version(triton.__version__) < (3, 7) and _version(numpy.__version__) >= (2, 5)


interpreted = pytest.mark.skipif(OLD_INTERPRETER, reason="Triton < 3.7's interpreter fails under NumPy >= 2.5")


@pytest.mark.parametrize(
    "script,written",
    [
        pytest.param("bench_w4a16.py", "w4a16_smoke.json", marks=interpreted),
        pytest.param("bench_w8a8.py", "w8a8_results.json", marks=interpreted),
        ("bench_serve.py", "bench_serve_smoke.json"),
    ],
)
def test_smoke_mode_runs_and_writes_its_results(script, written, tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "OUT": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--smoke"], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "CORRECTNESS FAILURE" not in run.stdout
    assert (tmp_path / written).is_file()
