"""Probe: fp8 GEMM with accumulation promoted every 256 K elements instead of 128 (M >= 1024).

    python benchmarks/probes/probe_fp8_promote.py [--out DIR] [--ms 1024,4096,16384]

Why: the promoted fp8 path (``tl.dot(..., max_num_imprecise_acc=BLOCK_K)``: each BLOCK_K-long partial sum leaves
Hopper's reduced-precision tensor-core adder and is added to an fp32 accumulator) runs 1.31-1.35x bf16 against
1.53-1.67x for fast accumulation, because every promotion waits for the tile's MMAs (ptxas C7514). The committed
tiles are 128 deep, DeepSeek-V3's interval. Tiles 256 deep promote half as often (half the waits) at twice the
interval; the sweep never offered them (results/w8a8-h200-2026-12-02.md).

Each point: bf16 cuBLAS, the committed promoted config, 256-deep promoted candidates and the committed fast
accumulation config, end to end (quantizer + GEMM, ``w8a8_linear``), bench_w8a8.py's method (CUDA graphs over
rotated operands, medians). Accuracy of every variant on the first rotation, fp32 output against the float64
product of the same quantized operands (up to 1024 rows): max |error| / max |exact| and RMS error / RMS exact.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_w8a8
import bench_w8a8 as B8
from quantkit.kernels import w8a8 as W

# name -> (CONFIG_KEYS values, fast accumulation); None: the committed config of that mode
VARIANTS = {
    "promoted": (None, False),
    "p256_128x128": ((128, 128, 256, 8, 1, 8, 3), False),
    "p256_256x128": ((256, 128, 256, 8, 1, 8, 2), False),
    "p256_128x256": ((128, 256, 256, 8, 1, 8, 2), False),
    "p256_128x128_persistent": ((128, 128, 256, 8, 2, 8, 3), False),
    "p256_256x128_persistent": ((256, 128, 256, 8, 2, 8, 2), False),
    "fast": (None, True),
}


def config(m: int, n: int, values, fast: bool) -> dict:
    if values is None:
        return W.pick_config(m, "fp8", fast, n)
    return dict(zip(W.CONFIG_KEYS, values, strict=True))


def linear_call(p: B8.Problem, i: int, cfg: dict, fast: bool):
    x, wq, ws = p.x[i], p.wq["fp8"][i], p.w_scale["fp8"][i]
    return lambda: W.w8a8_linear(x, wq, ws, config=cfg, fp8_fast_accum=fast)


def errors(p: B8.Problem, cfg: dict, fast: bool) -> dict[str, float]:
    """Relative errors of the fp32 output (first 1024 rows): against the float64 product of the same quantized
    operands (the accumulation alone: max and RMS) and against the float64 product of the unquantized bf16 operands
    (what a user sees: quantization and accumulation together, RMS)."""
    rows = min(p.m, 1024)
    qa, sa = p.qa["fp8"][0][:rows], p.a_scale["fp8"][0][:rows].contiguous()
    wq, ws = p.wq["fp8"][0], p.w_scale["fp8"][0]
    y = W.w8a8_matmul(qa, sa, wq, ws, out_dtype=torch.float32, config=cfg, fp8_fast_accum=fast).double()
    exact = (qa.double() @ wq.double().t()) * sa.double()[:, None] * ws.double()[None, :]
    true = p.x[0][:rows].double() @ p.w16[0].double().t()

    def rms(e, ref):
        return (e.square().mean() / ref.square().mean()).sqrt().item()

    err = y - exact
    return {
        "max_err": (err.abs().max() / exact.abs().max()).item(),
        "rms_err": rms(err, exact),
        "rms_err_vs_unquantized": rms(y - true, true),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    ap.add_argument("--ms", default="1024,4096,16384")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"subset of {','.join(VARIANTS)}")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "probe_fp8_promote.json"
    timer, rows = B8.Timer(False, 10, 40), []
    for n, k, m, p, bf16 in B8.probe_points(args.ms, timer):
        row = {"n": n, "k": k, "m": m, "bf16_us": bf16}
        line = f"fp8 {n}x{k} M={m}: bf16 {bf16:.1f}"
        for name in args.variants.split(","):
            values, fast = VARIANTS[name]
            cfg = config(m, n, values, fast)
            calls = [linear_call(p, i, cfg, fast) for i in range(p.r)]
            try:
                err = errors(p, cfg, fast)
                us = timer.per_call(calls) * 1e6
            except Exception as e:  # a variant that fails to compile must not end the probe
                print(f"  {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                err, us = (
                    dict.fromkeys(("max_err", "rms_err", "rms_err_vs_unquantized"), float("nan")),
                    float("nan"),
                )
            row[name] = {"us": us, **err}
            line += (
                f" | {name} {bf16 / us:.2f}x acc {err['max_err']:.1e}/{err['rms_err']:.1e}"
                f" total {err['rms_err_vs_unquantized']:.4e}"
            )
        print(line, flush=True)
        rows.append(row)
        out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
