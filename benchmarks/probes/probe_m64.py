"""Probe: tile configs of the W8A8 m64 regime (M 17-64), end to end (quantizer + GEMM under PDL, L2 prefetch rule).

    python benchmarks/probes/probe_m64.py [--out DIR] [--ms 32,64] [--fmts int8,fp8] [--cands "64,64,256,1,1,4,4;..."]

Why: int8 at M = 64 runs its GEMM at ~1.53x bf16 (geomean, GEMM alone) against ~1.67x at M = 16, where the wide
layers take two persistent TMA programs per SM (``INT8_WIDE_SKINNY``); the m64 config (64 x 64 x 256, pointer loads,
4 stages, 128 KB of shared memory: one CTA per SM) was tuned on 2026-11-29, before the TMA, persistent and L2
prefetch paths existed. Each candidate runs through ``w8a8_linear(config=...)`` so PDL and the prefetch rule apply as
in production; outputs are compared bit for bit with the committed config's (int8 exactly; fp8 sums in another
order may differ in the last bit, reported as such).
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_w8a8
import bench_w8a8 as B8
from quantkit.kernels import w8a8 as W

CANDIDATES = [  # CONFIG_KEYS: BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, USE_TMA, num_warps, num_stages
    (64, 64, 256, 1, 0, 4, 4),  # committed (int8 and fp8)
    (64, 64, 256, 1, 1, 4, 4),
    (64, 64, 256, 1, 2, 4, 4),
    (64, 64, 256, 1, 3, 4, 3),
    (64, 64, 128, 1, 3, 4, 6),
    (64, 128, 256, 1, 0, 4, 3),
    (64, 128, 128, 1, 3, 4, 4),
    (64, 32, 256, 1, 0, 4, 6),
    (64, 32, 256, 1, 3, 4, 6),
    (64, 64, 512, 1, 0, 4, 2),
    (64, 64, 128, 1, 0, 4, 8),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    ap.add_argument("--ms", default="32,64")
    ap.add_argument("--fmts", default="int8,fp8")
    ap.add_argument("--cands", default=None, help="';'-separated CONFIG_KEYS tuples instead of CANDIDATES")
    args = ap.parse_args()
    cands = [tuple(map(int, c.split(","))) for c in args.cands.split(";")] if args.cands else CANDIDATES
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "probe_m64.json"
    timer, rows = B8.Timer(False, 10, 40), []
    for n, k in B8.SHAPES:
        for m in map(int, args.ms.split(",")):
            p = B8.Problem(n, k, m, "cuda", seed=0)
            bf16 = timer.per_call([(lambda i=i, p=p: F.linear(p.x[i], p.w16[i])) for i in range(p.r)]) * 1e6
            for fmt in args.fmts.split(","):
                row = {"n": n, "k": k, "m": m, "fmt": fmt, "bf16_us": bf16}
                line, want = f"{fmt} {n}x{k} M={m}: bf16 {bf16:.1f}", None
                for cand in cands:
                    cfg = dict(zip(W.CONFIG_KEYS, cand, strict=True))
                    wq, ws = p.wq[fmt], p.w_scale[fmt]
                    calls = [partial(W.w8a8_linear, p.x[i], wq[i], ws[i], config=cfg) for i in range(p.r)]
                    name = "_".join(map(str, cand))
                    try:
                        y = calls[0]()
                        want = y if want is None else want
                        exact = torch.equal(y, want)
                        us = timer.per_call(calls) * 1e6
                    except Exception as e:  # a candidate that fails to compile must not end the probe
                        print(f"  {name}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                        exact, us = False, float("nan")
                    row[name] = {"us": us, "exact": exact}
                    line += f" | {name} {bf16 / us:.2f}" + ("" if exact else "*")
                print(line, flush=True)
                rows.append(row)
                out.write_text(json.dumps(rows, indent=1))
            del p
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
