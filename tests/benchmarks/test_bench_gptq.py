"""The GPU benchmark's model builder and timing loop, run on the CPU with tiny Llama shapes (the GPU run itself
cannot be tested here; this keeps its code paths from rotting)."""

import argparse
import importlib.util
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from quantkit.nn.factory import quantized_modules

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gptq.py"
TINY = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_gptq", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_random_llama_is_fully_materialised_and_runs():
    bench = load_bench()
    model = bench.random_llama(TINY, torch.device("cpu"), seed=0)
    assert all(p.dtype == torch.bfloat16 and not p.is_meta for p in model.parameters())
    w = model.model.layers[0].mlp.down_proj.weight.float()
    assert 0.015 < w.std() < 0.025 and abs(w.mean()) < 0.005
    assert torch.equal(model.model.norm.weight, torch.ones(64, dtype=torch.bfloat16))
    reference = LlamaForCausalLM(LlamaConfig(**TINY)).model.rotary_emb.inv_freq
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, reference, rtol=0, atol=0)
    with torch.no_grad():
        logits = model(torch.randint(0, 300, (1, 16))).logits
    assert torch.isfinite(logits).all()


def test_run_quantizes_every_layer_and_reports():
    bench = load_bench()
    model = bench.random_llama(TINY, torch.device("cpu"), seed=0)
    args = argparse.Namespace(
        bits=4, group_size=32, asym=False, nsamples=4, seqlen=32, batch_size=2, act_order=True, mse=True, block_size=16
    )
    calib = torch.randint(0, 300, (4, 32), generator=torch.Generator().manual_seed(0))
    info = bench.run(model, calib, args, torch.device("cpu"))
    assert info["layers"] == 2 and info["linears"] == 14
    assert len(quantized_modules(model)) == 14
    assert 0 < info["gptq_seconds"] <= info["quantize_seconds"] and info["quantize_cpu_seconds"] > 0
    assert info["peak_gpu_bytes"] is None
    assert "quantize wall" in bench.markdown(
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
