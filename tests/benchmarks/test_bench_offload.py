"""The offload benchmark end to end with tiny Llama shapes: both children run, the checkpoints match, the table is
written (the figures themselves come from the real shapes, not from here)."""

import json
import sys
from pathlib import Path

import bench_offload as bench
import pytest


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
