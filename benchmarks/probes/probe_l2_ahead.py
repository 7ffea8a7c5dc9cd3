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
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

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
    variants = [(d, False) for d in map(int, args.ahead.split(","))]
    variants += [(d, True) for d, _ in variants] if args.narrow else []
    timer, rows = B8.Timer(False, 10, 40), []
    for n, k in B8.SHAPES:
        for m in map(int, args.ms.split(",")):
            p = B8.Problem(n, k, m, "cuda", seed=0)
            bf16 = timer.per_call([(lambda i=i, p=p: F.linear(p.x[i], p.w16[i])) for i in range(p.r)]) * 1e6
            for fmt in ("int8", "fp8"):
                row = {"n": n, "k": k, "m": m, "fmt": fmt, "bf16_us": bf16}
                want = None
                line = f"{fmt} {n}x{k} M={m}: bf16 {bf16:.1f}"
                for d, narrow in variants:
                    name = f"l2_{d}" + ("_n" if narrow else "")
                    calls = [w8a8_call(p, fmt, i, d, narrow) for i in range(p.r)]
                    try:
                        y = calls[0]()
                        want = y if want is None else want
                        exact = torch.equal(y, want)
                        us = timer.per_call(calls) * 1e6
                    except Exception as e:  # a variant that fails to compile must not end the probe
                        print(f"  {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                        exact, us = False, float("nan")
                    row[name] = {"us": us, "exact": exact}
                    line += f" | {name} {bf16 / us:.2f}x" + ("" if exact else " WRONG")
                print(line, flush=True)
                rows.append(row)
                out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
