"""The AWQ benchmark's smoke mode (tiny Llama shapes on the CPU): the script runs end to end and records the
search sample it used (the GPU and SmolLM2 timings themselves are not tests)."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_awq.py"


def run(tmp_path, *args):
    cmd = [sys.executable, str(BENCH), "--smoke", "--layers", "1", "--nsamples", "4", "--out", str(tmp_path), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads((tmp_path / "bench_awq.json").read_text())


def test_smoke_records_the_defaults(tmp_path):
    info = run(tmp_path)
    assert info["decoder_layers"] == 1 and info["search_samples"] == 16 and info["search_tokens"] == 4096
    assert info["refine_steps"] == 50 and info["linears_clipped_per_layer"] > 0


def test_smoke_all_windows(tmp_path):
    info = run(tmp_path, "--search-samples", "0", "--search-tokens", "64", "--refine-steps", "0")
    assert info["search_samples"] == "all" and info["search_tokens"] == 64 and info["refine_steps"] == 0
