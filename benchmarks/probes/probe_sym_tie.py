"""Symmetric RTN: which way a group's extreme value rounds, and what that does to perplexity (SmolLM2-135M, CPU).

    python benchmarks/probes/probe_sym_tie.py [--windows 40]

Why: a symmetric grid of ``bits`` has scale 2 * absmax / (2**bits - 1), so the group's extreme weight sits exactly
half-way between two codes (+-7.5 steps at 4 bits). quantkit rounds the scale to fp16 (its stored precision) to the
nearest value, so which code that weight takes depends on the scale's fp16 rounding: in effect a coin per group.
compressed-tensors keeps fp32 scales, so its negative extremes round (half to even) to the bottom code, one step
beyond the weight, and its positive ones are clamped one step inside. This probe rounds quantkit's scale toward
zero instead, which reproduces that rule with fp16 scales, and evaluates RTN both ways (quantkit's protocol: Moby-Dick
windows of 512 tokens against the float model). Results: ``results/vs-llmcompressor-2026-12-05.md``.
"""

from __future__ import annotations

import argparse

import torch

import quantkit
import quantkit.algorithms.rtn as rtn_module
import quantkit.quant.tensor as tensor_module
from quantkit.calib.data import evaluation_windows
from quantkit.eval import evaluate_windows

NEAREST = tensor_module.compute_qparams


def toward_zero(w: torch.Tensor, bits: int, sym: bool):
    """``compute_qparams`` with a symmetric scale rounded to fp16 toward zero (asymmetric grids unchanged)."""
    if not sym:
        return NEAREST(w, bits, sym)
    w = w.float()
    absmax = torch.maximum(-w.amin(dim=-1).clamp(max=0), w.amax(dim=-1).clamp(min=0))
    exact = 2 * absmax / (2**bits - 1)
    half = exact.to(torch.float16)
    half = torch.where(half.float() > exact, torch.nextafter(half, torch.zeros_like(half)), half)
    scale = torch.where(half.float() > 0, half.float(), torch.ones_like(exact))
    return scale, torch.full_like(scale, 2 ** (bits - 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=40)
    args = ap.parse_args()
    float_model, tokenizer, _ = quantkit.load_model("smollm2-135m")
    windows, _ = evaluation_windows(tokenizer, "moby-dick", 512, args.windows)
    print("bits group rule perplexity KL top-1")
    for bits, group in [(4, 64), (4, 128), (4, -1), (3, 64)]:
        for name, rule in [("nearest", NEAREST), ("toward-zero", toward_zero)]:
            tensor_module.compute_qparams = rtn_module.compute_qparams = rule
            model, _, _ = quantkit.load_model("smollm2-135m")
            recipe = {"scheme": {"bits": bits, "group_size": group, "sym": True}, "stages": [{"method": "rtn"}]}
            quantkit.quantize(model, recipe)
            res = evaluate_windows(model, windows, baseline=float_model)
            print(bits, group, name, f"{res.perplexity:.3f} {res.kl:.4f} {res.top1_agreement:.3f}", flush=True)
    tensor_module.compute_qparams = rtn_module.compute_qparams = NEAREST


if __name__ == "__main__":
    main()
