"""Error of the W4A16 gemv's ``half_accum`` path against float64, as a multiple of PyTorch's same-dtype product's.

    TRITON_INTERPRET=1 python benchmarks/probes/half_error.py [--seed S]   (CPU, Triton's interpreter; ~2 min)

Random 4-bit layers (every code and zero point equally likely, fp16 scales 0.001-0.011) of several shapes, group
sizes and row counts, activations ~ N(0, 1) scaled by 1, 10 or 0.05; PyTorch's product dequantizes W to the
activations' dtype and accumulates in fp32 (what cuBLAS does). The interpreter runs the path's emulation (each
16-bit operation computed in fp32 and rounded to the 16-bit type), not its inline PTX. Prints the worst and mean
ratio per dtype; the tests assert <= 3x, the fp32 paths <= 2x (the issue's rule).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    raise SystemExit("set TRITON_INTERPRET=1: this runs the kernels in Triton's interpreter")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_w4a16
from bench_w4a16 import dequant64, random_weight
from quantkit.kernels import w4a16 as K
from quantkit.kernels.w4a16_gemv import w4a16_gemv

CASES = [
    (128, 512, 128, 1),
    (256, 1024, 64, 2),
    (64, 4096, 128, 1),
    (64, 2048, 32, 3),
    (96, 1024, 1024, 1),
    (64, 8192, 128, 1),
]
SCALES = (1.0, 10.0, 0.05)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=1)
    gen = torch.Generator().manual_seed(ap.parse_args().seed)
    half = dict(fold_zero=True, vector_x=True, half_accum=True)
    for dtype in (torch.float16, torch.bfloat16):
        ratios = []
        for n, k, group, m in CASES:
            w = random_weight(n, k, group, "cpu", gen)
            w64 = dequant64(w)
            cfg = K.KernelConfig("gemv", 4 if m > 1 else 1, 64, 64, 2, 1, split_waves=4, **half)
            for scale in SCALES:
                x = (torch.randn(m, k, generator=gen) * scale).to(dtype)
                ref = x.double() @ w64
                torch_err = ((x.float() @ w64.to(dtype).float()).to(dtype).double() - ref).abs().max().item()
                y, _ = w4a16_gemv(x, w, cfg)
                ratios.append((y.double() - ref).abs().max().item() / torch_err)
        mean = sum(ratios) / len(ratios)
        print(f"{dtype}: error / PyTorch's, worst {max(ratios):.2f}, mean {mean:.2f} over {len(ratios)} products")


if __name__ == "__main__":
    main()
