"""Probe: the activation quantizer with each row split across programs (``_quantize_row_parts_kernel``) against one
program per row, alone and end to end (quantizer + GEMM under PDL, as ``w8a8_linear`` runs them).

    python benchmarks/probes/probe_quant_parts.py [--out DIR] [--ms 1,16,64,256]

Why: with one program per row, M <= 64 rows occupy at most 64 of the 132 SMs and a row of K = 28672 takes 5.8 us
(int8) to 7.8 us (fp8) on its SM (results/w8a8-quant-h200-2026-12-02.md); under PDL the GEMM waits for all of it.
Each point times, in one run: the quantizer with ``chunk=K`` (one program per row, the path until this probe) and
with the rule ``row_parts_chunk``; then the end-to-end product with each, and bf16 cuBLAS. Codes, scales and outputs
are compared bit for bit between the two.
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


def linear(x, wq, ws, fmt, chunk):
    """w8a8_linear's steps with the quantizer's chunk chosen (None: the rule)."""
    pdl = W.use_pdl(x)
    qa, sa = W.quantize_activations(x, fmt, pdl=pdl, chunk=chunk)
    return W.w8a8_matmul(qa, sa, wq, ws, out_dtype=x.dtype, pdl=pdl, prefetch_k=W.PDL_PREFETCH_K if pdl else 0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    ap.add_argument("--ms", default="1,16,64,256")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "probe_quant_parts.json"
    timer, rows = B8.Timer(False, 10, 40), []
    for n, k in B8.SHAPES:
        for m in map(int, args.ms.split(",")):
            p = B8.Problem(n, k, m, "cuda", seed=0)
            bf16 = timer.per_call([(lambda i=i, p=p: F.linear(p.x[i], p.w16[i])) for i in range(p.r)]) * 1e6
            chunk = W.row_parts_chunk(m, k, W.num_sms(p.x[0].device))
            for fmt in ("int8", "fp8"):
                row = {"n": n, "k": k, "m": m, "fmt": fmt, "chunk": chunk, "bf16_us": bf16}
                wq, ws, x = p.wq[fmt], p.w_scale[fmt], p.x
                one, parts = W.quantize_activations(x[0], fmt, chunk=k), W.quantize_activations(x[0], fmt)
                codes = torch.equal(one[0].view(torch.uint8), parts[0].view(torch.uint8))
                codes = codes and torch.equal(one[1], parts[1])
                outs = torch.equal(linear(x[0], wq[0], ws[0], fmt, k), linear(x[0], wq[0], ws[0], fmt, None))
                row["exact"] = bool(codes and outs)
                for name, c in (("one", k), ("parts", None)):
                    quant = [partial(W.quantize_activations, x[i], fmt, chunk=c) for i in range(p.r)]
                    e2e = [partial(linear, x[i], wq[i], ws[i], fmt, c) for i in range(p.r)]
                    row[f"quant_{name}_us"] = timer.per_call(quant) * 1e6
                    row[f"e2e_{name}_us"] = timer.per_call(e2e) * 1e6
                q1, q2, e1, e2 = (row[f"{a}_{b}_us"] for a in ("quant", "e2e") for b in ("one", "parts"))
                print(
                    f"{fmt} {n}x{k} M={m} chunk {chunk}: quant {q1:.2f} -> {q2:.2f} us | e2e {bf16 / e1:.3f}x -> "
                    f"{bf16 / e2:.3f}x" + ("" if row["exact"] else " MISMATCH"),
                    flush=True,
                )
                rows.append(row)
                out.write_text(json.dumps(rows, indent=1))
            del p
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
