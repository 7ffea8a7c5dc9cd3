"""The GPU benchmark's timing loop, run on the CPU with tiny Llama shapes (the GPU run itself cannot be tested
here; this keeps its code paths from rotting)."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import bench_gptq
import bench_offload as bench
import common
import pytest
import torch

from quantkit.nn.factory import quantized_modules

TINY = dict(common.LLAMA3_8B, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=300)  # fmt: skip


def test_run_quantizes_every_layer_and_reports(tmp_path):
    model = common.random_llama(TINY, torch.device("cpu"), seed=0)
    args = argparse.Namespace(
        bits=4,
        group_size=32,
        asym=False,
        nsamples=4,
        seqlen=32,
        batch_size=2,
        act_order=True,
        mse=True,
        block_size=16,
        static_groups=False,
        resume_state=None,
    )
    calib = torch.randint(0, 300, (4, 32), generator=torch.Generator().manual_seed(0))
    info = bench_gptq.run(model, calib, args, torch.device("cpu"))
    assert "resume_state_seconds" not in info
    again = bench_gptq.run(common.random_llama(TINY, torch.device("cpu"), seed=0), calib,
                           argparse.Namespace(**{**vars(args), "resume_state": tmp_path / "state"}),
                           torch.device("cpu"))  # fmt: skip
    assert again["resume_state_bytes_per_layer"] > 0 and not (tmp_path / "state").exists()  # measured, then deleted
    assert info["layers"] == 2 and info["linears"] == 14
    assert len(quantized_modules(model)) == 14
    assert 0 < info["gptq_seconds"] <= info["quantize_seconds"] and info["quantize_cpu_seconds"] > 0
    assert info["peak_gpu_bytes"] is None
    assert "quantize wall" in bench_gptq.markdown(
        {
            **info,
            **{
                "mode": "t",
                "cpu_threads": 1,
                "torch": "x",
                "calibration": {"nsamples": 4, "seqlen": 32},
                "scheme": {"bits": 4, "group_size": 32, "sym": True},
                "act_order": True,
                "mse": True,
                "build_seconds": 0.0,
            },
        }
    )


def test_the_nproc_table_has_a_row_per_process_count():
    """bench_gptq --nproc: one row per count, its speedup and every rank's peak memory (the runs themselves need
    the real shapes and GPUs: see bench_gptq.scaling)."""
    base = {"mode": "m", "cpu_threads": 1, "torch": "x", "calibration": {"nsamples": 4, "seqlen": 32}, "layers": 2,
            "scheme": {"bits": 4, "group_size": 32, "sym": True}, "act_order": True, "build_seconds": 0.0,
            "linears": 14, "quantize_seconds": 2.0, "quantize_cpu_seconds": 1.0, "gptq_seconds": 1.0,
            "seconds_per_layer_median": 1.0, "seconds_per_layer_max": 1.0, "peak_gpu_bytes": 2**30}  # fmt: skip
    rows = [{"nproc": 1, "quantize_seconds": 2.0, "speedup": 1.0, "seconds_per_layer_median": 1.0,
             "peak_gpu_bytes_per_rank": [2**30]},
            {"nproc": 2, "quantize_seconds": 1.0, "speedup": 2.0, "seconds_per_layer_median": 0.5,
             "peak_gpu_bytes_per_rank": [2**30, 2**29]}]  # fmt: skip
    text = bench_gptq.markdown({**base, "scaling": rows})
    assert "| 1 | 2.0 | 1.0x | 1.0 | 1.00 |" in text and "| 2 | 1.0 | 2.0x | 0.5 | 1.00, 0.50 |" in text


# The offload benchmark end to end with tiny Llama shapes: both children run, the checkpoints match, the table is
# written (the figures themselves come from the real shapes, not from here).


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="samples memory from /proc")
@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_both_modes_run_and_agree(tmp_path, monkeypatch, method):
    tiny = dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    monkeypatch.setattr(bench, "LLAMA32_1B", {**bench.LLAMA32_1B, **tiny})  # the children only read the folder
    argv = ["bench_offload.py", "--layers", "2", "--method", method, "--nsamples", "2", "--seqlen", "16"]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(tmp_path)])
    bench.main()
    info = json.loads((tmp_path / "bench_offload.json").read_text())
    assert info["identical"] and [r["mode"] for r in info["runs"]] == ["whole", "offload"]
    assert all(r["peak_anon_bytes"] > 0 for r in info["runs"])
    assert "| offload |" in (tmp_path / "bench_offload.md").read_text()


# The AWQ benchmark's smoke mode (tiny Llama shapes on the CPU): the script runs end to end and records the
# search sample it used (the GPU and SmolLM2 timings themselves are not tests).


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
