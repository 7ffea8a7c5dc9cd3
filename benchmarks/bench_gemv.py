"""Float decode GEMV (``kernels/gemv.py``) against cuBLAS (``F.linear``) at one row of x, on one GPU.

    python benchmarks/bench_gemv.py [--out DIR]

Shapes (N x K): the Llama-3-8B decoder's fused qkv, o, fused gate/up and down projections, two more Llama shapes,
and the 128256-row lm_head; bf16 and fp16. Timing: a CUDA graph of R calls over R rotated copies of the operands
(spanning more than 2x the L2), replayed under ``triton.testing.do_bench`` (median), per call = replay / R; cuBLAS
measured the same way in the same run. Each kernel output is checked against float64 (no worse than 2x cuBLAS's
own error plus one output ulp). Writes gemv.json and gemv.md under --out (default $OUT or ./bench_out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from quantkit.kernels import gemv as G

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (14336, 4096), (8192, 8192), (128256, 4096)]
ROTATE_SPAN = 150e6  # bytes of weights cycled through per replay: > 2x the H200's 60 MB L2


def per_call_us(calls: list) -> float:
    for c in calls:  # compile and warm up outside the capture
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=50, return_mode="median")
    return ms * 1e3 / len(calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench_out"))
    args = ap.parse_args()
    dev = "cuda"
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        for n, k in SHAPES:
            r = max(1, min(16, math.ceil(ROTATE_SPAN / (2 * n * k))))
            g = torch.Generator(device=dev).manual_seed(n + k)
            ws = [(torch.randn(n, k, device=dev, generator=g) * 0.02).to(dtype) for _ in range(r)]
            xs = [torch.randn(1, k, device=dev, generator=g).to(dtype) for _ in range(r)]
            outs = [torch.empty(1, n, device=dev, dtype=dtype) for _ in range(r)]
            exact = xs[0].double() @ ws[0].double().t()
            torch_err = (F.linear(xs[0], ws[0]).double() - exact).abs().max().item()
            err = (G.gemv(xs[0], ws[0]).double() - exact).abs().max().item()
            ok = err <= 2 * torch_err + torch.finfo(dtype).eps * exact.abs().max().item()
            cublas = per_call_us([(lambda x=x, w=w: F.linear(x, w)) for x, w in zip(xs, ws, strict=True)])
            ours = per_call_us(
                [(lambda x=x, w=w, o=o: G.gemv(x, w, out=o)) for x, w, o in zip(xs, ws, outs, strict=True)]
            )
            row = {"dtype": str(dtype).removeprefix("torch."), "n": n, "k": k, "cublas_us": cublas, "gemv_us": ours,
                   "speedup": cublas / ours, "gemv_tbs": 2 * n * k / ours / 1e6, "cublas_tbs": 2 * n * k / cublas / 1e6,
                   "ok": ok, "err": err, "torch_err": torch_err, "used_by_runtime": n <= G.MAX_ROWS}  # fmt: skip
            rows.append(row)
            tag = "" if ok else " WRONG"
            print(f"{row['dtype']} {n}x{k}: cuBLAS {cublas:.1f} us ({row['cublas_tbs']:.2f} TB/s), gemv {ours:.1f} "
                  f"us ({row['gemv_tbs']:.2f} TB/s) {row['speedup']:.2f}x{tag}", flush=True)  # fmt: skip
            del ws, xs, outs
    args.out.mkdir(parents=True, exist_ok=True)
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    (args.out / "gemv.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    lines = [
        f"# Float GEMV vs cuBLAS at M = 1 -- {env['gpu']}, torch {env['torch']}, triton {env['triton']}",
        "",
        "| dtype | N x K | cuBLAS us | gemv us | speedup | gemv TB/s | runtime uses it |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        used = "yes" if r["used_by_runtime"] else "no"
        lines.append(f"| {r['dtype']} | {r['n']}x{r['k']} | {r['cublas_us']:.1f} | {r['gemv_us']:.1f} | "
                     f"{r['speedup']:.2f}x | {r['gemv_tbs']:.2f} | {used} |")  # fmt: skip
    (args.out / "gemv.md").write_text("\n".join(lines) + "\n")
    print(f"{sum(r['ok'] for r in rows)}/{len(rows)} correct; wrote {args.out}/gemv.json and gemv.md")


if __name__ == "__main__":
    main()
