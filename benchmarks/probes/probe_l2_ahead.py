"""Probe: software L2 prefetch of the weight tile a few K steps ahead in the skinny W4A16 and W8A8 products.

    python benchmarks/probes/probe_l2_ahead.py [--out DIR] [--ms 1,4,16,2,64,32] [--w8a8-ms 1,16,64] [--skip-w4a16]

Why: the decode-sized products stream each weight byte once and are bound by how many bytes they keep in flight.
The W4A16 gemv issues each word row's load just before its use (a DRAM round trip exposed per row,
``w4a16_gemv.py``'s header: 2.3-2.5 TB/s on the largest layers against 4.25 TB/s of copy bandwidth); the tensor-core
tiles hold two K tiles in shared memory. ``kernels/l2_prefetch.py`` asks L2 for the tile ``l2_ahead`` steps ahead
with one ``prefetch.global.L2`` per 128-byte line: no registers for the data, no shared memory, nothing waits on it.

Candidates per M (group 128): the committed config, ``l2_ahead`` 1, 2 and 4, and 2 and 4 with the committed
config's register count as a cap (``max_registers``) where the prefetch's address arithmetic would otherwise cost a
CTA per SM (static compile for sm_90 with Triton 3.6: M = 1 on wide layers 64 -> 77 registers, M = 4 96 -> 127,
M = 16 72 -> 80). W4A16 cells: cuBLAS fp16 and every candidate in one run, each checked against float64 first
(``bench_w4a16.run_probe``). W8A8 (int8 and fp8, end to end with the committed launch: quantizer, then the GEMM
under programmatic dependent launch for M <= 64): bf16 cuBLAS, the committed path and ``l2_ahead`` 1, 2, 4, each
output compared bit for bit with the committed one.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_w4a16, bench_w8a8
import bench_w8a8 as B8
from bench_w4a16 import SHAPES, run_probe
from quantkit.kernels import w4a16_configs as C
from quantkit.kernels import w8a8 as W

RUNTIME_SHAPES = [(6144, 4096), (28672, 4096)]  # Llama-3-8B's fused qkv and gate_up projections
AHEAD = (1, 2, 4)
# registers of the committed configs where the prefetch raises them past an occupancy step (static sm_90 compile)
REG_CAPS = {C.WIDE_M1.name: 64, C.config_for(4).name: 96, C.WIDE_M4.name: 96, C.config_for(16).name: 72}


def candidates(m: int, n: int) -> list[C.KernelConfig]:
    base = C.config_for(m, n)
    cands = [base] + [replace(base, l2_ahead=d) for d in AHEAD]
    cap = REG_CAPS.get(base.name)
    if cap:
        cands += [replace(base, l2_ahead=d, max_registers=cap) for d in (2, 4)]
    return cands


def w8a8_call(p: B8.Problem, fmt: str, i: int, ahead: int):
    x, wq, ws = p.x[i], p.wq[fmt][i], p.w_scale[fmt][i]
    pdl = W.use_pdl(x)

    def call():
        qa, sa = W.quantize_activations(x, fmt, pdl=pdl)
        return W.w8a8_matmul(qa, sa, wq, ws, out_dtype=x.dtype, pdl=pdl,
                             prefetch_k=W.PDL_PREFETCH_K if pdl else 0, l2_ahead=ahead)  # fmt: skip

    return call


def run_w8a8(ms: list[int], out: Path) -> None:
    timer, rows = B8.Timer(False, 10, 40), []
    for n, k in B8.SHAPES:
        for m in ms:
            p = B8.Problem(n, k, m, "cuda", seed=0)
            bf16 = timer.per_call([(lambda i=i, p=p: F.linear(p.x[i], p.w16[i])) for i in range(p.r)]) * 1e6
            for fmt in ("int8", "fp8"):
                row = {"n": n, "k": k, "m": m, "fmt": fmt, "bf16_us": bf16}
                want = w8a8_call(p, fmt, 0, 0)()
                line = f"{fmt} {n}x{k} M={m}: bf16 {bf16:.1f}"
                for d in (0, *AHEAD):
                    calls = [w8a8_call(p, fmt, i, d) for i in range(p.r)]
                    try:
                        exact = torch.equal(calls[0](), want)
                        us = timer.per_call(calls) * 1e6
                    except Exception as e:  # a variant that fails to compile must not end the probe
                        print(f"  l2={d}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                        exact, us = False, float("nan")
                    row[f"l2_{d}"] = {"us": us, "exact": exact}
                    line += f" | l2={d} {us:.1f} us {bf16 / us:.2f}x" + ("" if exact else " WRONG")
                print(line, flush=True)
                rows.append(row)
                out.write_text(json.dumps(rows, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    ap.add_argument("--ms", default="1,4,16,2,64,32")
    ap.add_argument("--w8a8-ms", default="1,16,64")
    ap.add_argument("--skip-w4a16", action="store_true")
    ap.add_argument("--skip-w8a8", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.skip_w8a8:
        run_w8a8([int(v) for v in args.w8a8_ms.split(",")], args.out / "probe_l2_ahead_w8a8.json")
    if not args.skip_w4a16:
        ms = [int(v) for v in args.ms.split(",")]
        run_probe(SHAPES + RUNTIME_SHAPES, [128], ms, args.out / "probe_l2_ahead_w4a16.json", 4, candidates)


if __name__ == "__main__":
    main()
