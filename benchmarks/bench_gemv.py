"""Float decode GEMV (``kernels/gemv.py``) against cuBLAS (``F.linear``) at one row of x, on one GPU.

    python benchmarks/bench_gemv.py [--out DIR]     committed launch against cuBLAS
    python benchmarks/bench_gemv.py --sweep         also the launch shapes (BLOCK_N, BLOCK_K, warps, stages) below
    TRITON_INTERPRET=1 python benchmarks/bench_gemv.py --smoke    CPU plumbing check: tiny shapes, wall clock

Shapes (N x K): the Llama-3-8B decoder's fused qkv, o, fused gate/up and down projections, two more Llama shapes, and
the 128256-row lm_head; bf16 and fp16. Timing: common.Timer (a CUDA graph of R calls over R rotated copies of the
operands spanning more than 2x the L2, replayed under ``triton.testing.do_bench``, median, per call = replay / R);
cuBLAS measured the same way in the same run. Each kernel output is checked against float64 (no worse than 2x cuBLAS's
own error plus one output ulp). Writes gemv.json and gemv.md under --out (default out/gemv).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton
from common import (
    LLAMA3_8B,
    Timer,
    add_out_argument,
    decoder_linears,
    environment,
    kernel_device,
    out_folder,
    rotations,
)
from quantkit.kernels.dense import gemv as G

LAYERS = decoder_linears(LLAMA3_8B)
SHAPES = [LAYERS["qkv"], LAYERS["o"], LAYERS["gate_up"], LAYERS["down"], (14336, 4096), (8192, 8192), LAYERS["lm_head"]]
SMOKE_SHAPES = [(48, 96)]
# --sweep: (BLOCK_N, BLOCK_K, num_warps, num_stages); the first is the committed launch (gemv.BLOCK_N, ...)
SWEEP = [(4, 1024, 4, 1), (16, 512, 4, 1), (32, 256, 4, 1), (8, 1024, 4, 1), (16, 512, 4, 3), (64, 128, 4, 1),
         (16, 1024, 8, 1), (8, 512, 2, 1)]  # fmt: skip


def launch(x, w, out, bn: int, bk: int, warps: int, stages: int):
    n, k = w.shape
    G._gemv_kernel[(triton.cdiv(n, bn),)](x, w, out, out, n, k, w.stride(0), HAS_BIAS=False, EVEN_K=k % bk == 0,
                                          BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU plumbing check (needs TRITON_INTERPRET=1)")
    add_out_argument(ap, "gemv")
    args = ap.parse_args(argv)
    dev = kernel_device(args.smoke)
    timer = Timer(args.smoke, warmup_ms=10, rep_ms=50)
    rows, sweep = [], []
    for dtype in (torch.float16,) if args.smoke else (torch.bfloat16, torch.float16):
        for n, k in SMOKE_SHAPES if args.smoke else SHAPES:
            r = rotations(2 * n * k)
            g = torch.Generator(device=dev).manual_seed(n + k)
            ws = [(torch.randn(n, k, device=dev, generator=g) * 0.02).to(dtype) for _ in range(r)]
            xs = [torch.randn(1, k, device=dev, generator=g).to(dtype) for _ in range(r)]
            outs = [torch.empty(1, n, device=dev, dtype=dtype) for _ in range(r)]
            exact = xs[0].double() @ ws[0].double().t()
            torch_err = (F.linear(xs[0], ws[0]).double() - exact).abs().max().item()
            err = (G.gemv(xs[0], ws[0]).double() - exact).abs().max().item()
            ok = err <= 2 * torch_err + torch.finfo(dtype).eps * exact.abs().max().item()
            cublas = timer.per_call([(lambda x=x, w=w: F.linear(x, w)) for x, w in zip(xs, ws, strict=True)])
            ours = timer.per_call(
                [(lambda x=x, w=w, o=o: G.gemv(x, w, out=o)) for x, w, o in zip(xs, ws, outs, strict=True)]
            )
            row = {"dtype": str(dtype).removeprefix("torch."), "n": n, "k": k, "cublas_us": cublas, "gemv_us": ours,
                   "speedup": cublas / ours, "gemv_tbs": 2 * n * k / ours / 1e6, "cublas_tbs": 2 * n * k / cublas / 1e6,
                   "ok": ok, "err": err, "torch_err": torch_err, "used_by_runtime": n <= G.MAX_ROWS}  # fmt: skip
            rows.append(row)
            tag = "" if ok else " WRONG"
            print(f"{row['dtype']} {n}x{k}: cuBLAS {cublas:.1f} us ({row['cublas_tbs']:.2f} TB/s), gemv {ours:.1f} "
                  f"us ({row['gemv_tbs']:.2f} TB/s) {row['speedup']:.2f}x{tag}", flush=True)  # fmt: skip
            if args.sweep and dtype == torch.bfloat16:
                for cfg in SWEEP:
                    calls = [
                        (lambda x=x, w=w, o=o, c=cfg: launch(x, w, o, *c)) for x, w, o in zip(xs, ws, outs, strict=True)
                    ]
                    us = timer.per_call(calls)
                    sweep.append({"n": n, "k": k, "cfg": cfg, "us": us, "cublas_us": cublas})
                    print(f"    {cfg}: {us:.1f} us ({cublas / us:.2f}x cuBLAS)", flush=True)
            del ws, xs, outs
    out = out_folder(args.out)
    env = environment(dev)
    (out / "gemv.json").write_text(json.dumps({"env": env, "rows": rows, "sweep": sweep}, indent=1))
    lines = [
        f"# Float GEMV vs cuBLAS at M = 1 -- {env['device']}, torch {env['torch']}, triton {env['triton']}, "
        f"{env['date']}, commit {env['commit']}",
        "",
        "| dtype | N x K | cuBLAS us | gemv us | speedup | gemv TB/s | runtime uses it |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        used = "yes" if r["used_by_runtime"] else "no"
        lines.append(f"| {r['dtype']} | {r['n']}x{r['k']} | {r['cublas_us']:.1f} | {r['gemv_us']:.1f} | "
                     f"{r['speedup']:.2f}x | {r['gemv_tbs']:.2f} | {used} |")  # fmt: skip
    (out / "gemv.md").write_text("\n".join(lines) + "\n")
    print(f"{sum(r['ok'] for r in rows)}/{len(rows)} correct; wrote {out}/gemv.json and gemv.md")


if __name__ == "__main__":
    main()
