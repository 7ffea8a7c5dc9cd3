"""The GPU benchmarks' CPU plumbing modes (``--smoke``, Triton's interpreter): the GPU runs cannot be tested here,
but a script that fails on import or on its own bookkeeping would otherwise only be found on the GPU machine."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "script,written",
    [
        ("bench_w4a16.py", "w4a16_smoke.json"),
        ("bench_w8a8.py", "w8a8_results.json"),
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
