"""Probe: software L2 prefetch of the weight tile a few K steps ahead in the skinny W8A8 GEMM.

    python benchmarks/probes/probe_l2_ahead.py [--out DIR] [--ms 1,16,64] [--ahead 0,1,2,4] [--narrow]

Why: the decode-sized products stream each weight byte once and are bound by how many bytes they keep in flight; a
layer with few output tiles (4096 x 14336 at M = 64: 64 programs of 64 x 64) leaves each program a long stream through
a 2-4 stage pipeline. ``kernels/l2_prefetch.py`` asks L2 for the tile ``l2_ahead`` steps ahead with one
``prefetch.global.L2`` per 128-byte line: no registers for the data, no shared memory, nothing waits on it.

Each point (int8 and fp8, end to end with the committed launch: quantizer, then the GEMM under programmatic dependent
launch for M <= 64): bf16 cuBLAS and the committed config with each ``l2_ahead`` of ``--ahead``; ``--narrow`` adds
the same with 32-wide N tiles (twice the programs). Outputs compared bit for bit with the first variant's.

The first run (commit da0e855) also tried the W4A16 gemv and tensor-core tiles (M = 1-64, with and without a register
cap): slower everywhere, dropped (results/l2-ahead-h200-2026-12-03.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_w8a8
import bench_w8a8 as B8
from quantkit.kernels import w8a8 as W


def w8a8_call(p: B8.Problem, fmt: str, i: int, ahead: int, narrow: bool):
    x, wq, ws = p.x[i], p.wq[fmt][i], p.w_scale[fmt][i]
    pdl = W.use_pdl(x)
    cfg = W.pick_config(p.m, fmt, n=p.n)
    if narrow:
        cfg = cfg | {"BLOCK_N": cfg["BLOCK_N"] // 2}

    def call():
        qa, sa = W.quantize_activations(x, fmt, pdl=pdl)
        return W.w8a8_matmul(qa, sa, wq, ws, out_dtype=x.dtype, config=cfg, pdl=pdl,
                             prefetch_k=W.PDL_PREFETCH_K if pdl else 0, l2_ahead=ahead)  # fmt: skip

    return call


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    ap.add_argument("--ms", default="1,16,64")
    ap.add_argument("--ahead", default="0,1,2,4")
    ap.add_argument("--narrow", action="store_true", help="also 32-wide N tiles")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "probe_l2_ahead.json"
    settings = [(d, False) for d in map(int, args.ahead.split(","))]
    settings += [(d, True) for d, _ in settings] if args.narrow else []
    timer, rows = B8.Timer(False, 10, 40), []
    for n, k, m, p, bf16 in B8.probe_points(args.ms, timer):
        for fmt in ("int8", "fp8"):
            row = {"n": n, "k": k, "m": m, "fmt": fmt, "bf16_us": bf16}
            variants = {
                f"l2_{d}" + ("_n" if narrow else ""): [w8a8_call(p, fmt, i, d, narrow) for i in range(p.r)]
                for d, narrow in settings
            }
            B8.probe_point(timer, f"{fmt} {n}x{k} M={m}", row, variants, rows, out)


if __name__ == "__main__":
    main()
