"""The GPU benchmark's timing loop, run on the CPU with tiny Llama shapes (the GPU run itself cannot be tested
here; this keeps its code paths from rotting)."""

import argparse

import bench_gptq
import common
import torch

from quantkit.nn.factory import quantized_modules

TINY = dict(common.LLAMA3_8B, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=300)  # fmt: skip


def test_run_quantizes_every_layer_and_reports():
    model = common.random_llama(TINY, torch.device("cpu"), seed=0)
    args = argparse.Namespace(
        bits=4, group_size=32, asym=False, nsamples=4, seqlen=32, batch_size=2, act_order=True, mse=True, block_size=16
    )
    calib = torch.randint(0, 300, (4, 32), generator=torch.Generator().manual_seed(0))
    info = bench_gptq.run(model, calib, args, torch.device("cpu"))
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
