"""Probe: tile configs of the W8A8 m64 regime (M 17-64), end to end (quantizer + GEMM under PDL, L2 prefetch rule).

    python benchmarks/probes/probe_m64.py [--out DIR] [--ms 32,64] [--fmts int8,fp8] [--cands "64,64,256,1,1,4,4;..."]

Why: int8 at M = 64 ran its GEMM at ~1.53x bf16 (geomean, GEMM alone) against ~1.67x at M = 16, where the wide
layers take two persistent TMA programs per SM (``INT8_WIDE_SKINNY``); the m64 config then in use (64 x 64 x 256,
TMA, 4 stages: the second candidate below) was picked by the 2026-11-29 sweep at M = 64 only, before the persistent
and L2 prefetch paths existed. Each candidate runs through ``w8a8_linear(config=...)`` so PDL and the prefetch rule
apply as in production; outputs are compared bit for bit with the first candidate's and marked "WRONG" where they
differ (int8 must agree exactly; fp8 tiles of another BLOCK_K promote at other points, so their last bits may
differ). Outcome: results/w8a8-m64-h200-2026-12-03.md (M 17-32 now run the first candidate, M 33-64 the third).
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_w8a8
import bench_w8a8 as B8
from quantkit.kernels import w8a8 as W

CANDIDATES = [  # CONFIG_KEYS: BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, USE_TMA, num_warps, num_stages
    (64, 64, 256, 1, 0, 4, 4),  # pointer loads: committed for M 17-32 since this probe
    (64, 64, 256, 1, 1, 4, 4),  # TMA: committed for M 17-64 before it
    (64, 64, 256, 1, 2, 4, 4),  # persistent: UPPER_M64, M 33-64 since it
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
    for n, k, m, p, bf16 in B8.probe_points(args.ms, timer):
        for fmt in args.fmts.split(","):
            row = {"n": n, "k": k, "m": m, "fmt": fmt, "bf16_us": bf16}
            wq, ws = p.wq[fmt], p.w_scale[fmt]
            configs = {"_".join(map(str, c)): dict(zip(W.CONFIG_KEYS, c, strict=True)) for c in cands}
            variants = {
                name: [partial(W.w8a8_linear, p.x[i], wq[i], ws[i], config=cfg) for i in range(p.r)]
                for name, cfg in configs.items()
            }
            B8.probe_point(timer, f"{fmt} {n}x{k} M={m}", row, variants, rows, out)


if __name__ == "__main__":
    main()
