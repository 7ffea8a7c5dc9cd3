"""benchmarks/common.py: the shared shapes, the operand rotation, the table helpers, the output folder and the
random-weight model builder; and every benchmark script imports (the GPU runs themselves are not tests)."""

import argparse
import importlib
import math

import common
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

SCRIPTS = ["bench_w4a16", "bench_w4a8", "bench_w8a8", "bench_gemv", "bench_attention", "bench_serve", "bench_gptq",
           "bench_awq", "bench_offload", "accuracy", "versus"]  # fmt: skip


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_benchmark_imports(name):
    module = importlib.import_module(name)
    assert callable(module.main)


def test_w8a8_block_fused_variant_runs_only_where_fp8_block_linear_fuses():
    """bench_w8a8 --block's fp8_block_fused calls fuse_quant=True, which fp8_block_linear refuses from
    WS_ONE_WAVE_FROM_M rows (a ValueError the table does not catch)."""
    bench = importlib.import_module("bench_w8a8")
    lo, hi = bench.VARIANT_MS["fp8_block_fused"]
    ms = [m for m in bench.MS if lo <= m <= hi]
    assert ms and max(ms) < bench.KB.WS_ONE_WAVE_FROM_M


def test_llama3_8b_linears_are_the_published_projections():
    layers = common.decoder_linears(common.LLAMA3_8B)
    assert layers == {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                      "lm_head": (128256, 4096)}  # fmt: skip
    assert common.head_dim(common.LLAMA3_8B) == 128
    assert (4096, 4096) in common.LLAMA_SHAPES and (14336, 4096) in common.LLAMA_SHAPES  # 8B's q/o and gate


def test_rotations_span_past_l2_within_the_caps(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert common.rotations(common.L2_BYTES) == 2  # two copies of an L2-sized call span 2x L2
    assert common.rotations(common.L2_BYTES // 3 + 1) == 6
    assert common.rotations(100) == 32 and common.rotations(100, most=64) == 64
    assert common.rotations(10 * common.L2_BYTES) == 1
    assert common.rotations(common.L2_BYTES, span=3 * common.L2_BYTES) == 3
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert common.rotations(100) == 2  # the interpreter is slow


def test_kernel_device_refuses_a_mismatched_environment(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit, match="set TRITON_INTERPRET=1 with --smoke"):
        common.kernel_device(smoke=True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert common.kernel_device(smoke=True) == "cpu"
    with pytest.raises(SystemExit, match="--smoke runs in Triton's interpreter and only there"):
        common.kernel_device(smoke=False)


def test_smoke_timer_and_copy_bandwidth_run_on_the_cpu():
    calls = [lambda: torch.ones(4).sum()] * 3
    assert common.Timer(smoke=True).per_call(calls) > 0
    assert common.copy_bandwidth("cpu", smoke=True) > 0


def test_table_helpers():
    assert common.text_row(["N x K", "G", 1, 16], [7, 3, 6, 6]) == "  N x K   G      1     16"
    assert common.text_row(["M", "int8"], [-4, 6], sep="") == "M     int8"
    assert common.geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert math.isnan(common.geomean([]))


def test_out_argument_defaults_outside_the_tree(tmp_path):
    ap = argparse.ArgumentParser()
    common.add_out_argument(ap, "w4a16")
    assert str(ap.parse_args([]).out) == "out/w4a16"  # out/ is ignored by git
    folder = common.out_folder(ap.parse_args(["--out", str(tmp_path / "a" / "b")]).out)
    assert folder.is_dir()


TINY = dict(common.LLAMA3_8B, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=300)  # fmt: skip


@pytest.mark.parametrize("tied", [False, True])
def test_random_llama_is_fully_materialised_and_runs(tied):
    model = common.random_llama({**TINY, "tie_word_embeddings": tied}, torch.device("cpu"), seed=0)
    assert all(p.dtype == torch.bfloat16 and not p.is_meta for p in model.parameters())
    w = model.model.layers[0].mlp.down_proj.weight.float()
    assert 0.015 < w.std() < 0.025 and abs(w.mean()) < 0.005
    assert torch.equal(model.model.norm.weight, torch.ones(64, dtype=torch.bfloat16))
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) == tied
    reference = LlamaForCausalLM(LlamaConfig(**TINY)).model.rotary_emb.inv_freq
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, reference, rtol=0, atol=0)
    with torch.no_grad():
        logits = model(torch.randint(0, 300, (1, 16))).logits
    assert torch.isfinite(logits).all()
