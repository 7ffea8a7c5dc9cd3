"""The GPU benchmarks' CPU plumbing modes (``--smoke``, Triton's interpreter): the GPU runs cannot be tested here,
but a script that fails on import or on its own bookkeeping would otherwise only be found on the GPU machine."""

import json
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
    if script == "bench_serve.py":  # on the CPU in fp32 the runtime's greedy tokens are HF's, also teacher forced
        agree = json.loads((tmp_path / written).read_text())["results"]["agreement_bf16"]
        assert agree["positionwise"] == 1.0 and agree["teacher_forced"] == 1.0 and agree["gap_max"] == 0.0
        assert agree["fp32_ours"]["teacher_forced"] == agree["fp32_hf"]["teacher_forced"] == 1.0  # fp32 is the model
        assert "tokens" not in agree


def test_w4a16_summary_reprints_a_committed_tables_geomeans():
    """The per-M geomeans the README and closing notes quote come from this command on the committed JSON."""
    table = ROOT / "results" / "w4a16-h200-2026-12-04g.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_w4a16.py"), "--summary", str(table)],
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {" ".join(line.split()[:-11]): line.split()[-11:] for line in run.stdout.splitlines() if "geomean" in line}
    assert rows["geomean"][6] == "1.04" and rows["geomean g128"][6] == "1.23"  # M = 64 (columns: M = 1 ... 4096)
