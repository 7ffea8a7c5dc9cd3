"""Probe: W8A8 end to end with programmatic dependent launch (PDL) between the activation quantizer and the GEMM.

    python benchmarks/probes/probe_pdl.py [--out DIR] [--formats int8,fp8] [--ms 1,16,64,256,1024]

Each point times, in one run and under bench_w8a8.py's method (CUDA graphs over rotated operands, medians):
bf16 cuBLAS (``F.linear``), the plain launch (``w8a8_linear(pdl=False)``: quantize, then GEMM; the JSON calls it
"committed", the path before PDL), and the same two kernels with the
GEMM launched under PDL -- it may start while the quantizer runs and waits (griddepcontrol.wait) before reading the
codes -- without and with an L2 prefetch of the first ``prefetch_k`` bytes of each program's weight rows issued before
the wait. Every PDL output is compared bit for bit with the plain one. ``--reverse`` times the plain launch
last (the first H200 runs timed it first: an order effect would favour whatever runs later).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_w8a8
from bench_w8a8 import SHAPES, Problem, Timer
from quantkit.kernels import w8a8 as W

PREFETCH = (0, 1024, 4096)


def pdl_call(p: Problem, fmt: str, i: int, prefetch_k: int):
    x, wq, ws = p.x[i], p.wq[fmt][i], p.w_scale[fmt][i]

    def call():
        qa, sa = W.quantize_activations(x, fmt, pdl=True)
        return W.w8a8_matmul(qa, sa, wq, ws, out_dtype=x.dtype, pdl=True, prefetch_k=prefetch_k)

    return call


def measure(p: Problem, fmt: str, timer: Timer, bf16: float, reverse: bool) -> dict:
    base_calls = [(lambda i=i: W.w8a8_linear(p.x[i], p.wq[fmt][i], p.w_scale[fmt][i], pdl=False)) for i in range(p.r)]
    want = base_calls[0]()
    row = {"n": p.n, "k": p.k, "m": p.m, "fmt": fmt, "bf16_us": bf16}
    if not reverse:
        row["committed_us"] = timer.per_call(base_calls) * 1e6
    for pk in PREFETCH:
        calls = [pdl_call(p, fmt, i, pk) for i in range(p.r)]
        row[f"pdl{pk}_exact"] = torch.equal(calls[0](), want)
        row[f"pdl{pk}_us"] = timer.per_call(calls) * 1e6
    if reverse:
        row["committed_us"] = timer.per_call(base_calls) * 1e6
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--formats", default="int8,fp8")
    ap.add_argument("--ms", default="1,16,64,256,1024")
    ap.add_argument("--reverse", action="store_true", help="time the plain launch last instead of first (order check)")
    args = ap.parse_args()
    timer, rows = Timer(False, 10, 40), []
    for n, k in SHAPES:
        for m in [int(v) for v in args.ms.split(",")]:
            p = Problem(n, k, m, "cuda", seed=0)
            bf16 = timer.per_call([(lambda i=i, p=p: F.linear(p.x[i], p.w16[i])) for i in range(p.r)]) * 1e6
            for fmt in args.formats.split(","):
                row = measure(p, fmt, timer, bf16, args.reverse)
                rows.append(row)
                best = min(PREFETCH, key=lambda pk, row=row: row[f"pdl{pk}_us"])
                pdl = " ".join(
                    f"pdl{pk} {row[f'pdl{pk}_us']:.1f}{'' if row[f'pdl{pk}_exact'] else ' WRONG'}" for pk in PREFETCH
                )
                print(
                    f"{fmt} {n}x{k} M={m}: bf16 {bf16:.1f} plain {row['committed_us']:.1f} "
                    f"({bf16 / row['committed_us']:.2f}x) {pdl} | best pdl{best} {bf16 / row[f'pdl{best}_us']:.2f}x",
                    flush=True,
                )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe_pdl.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
