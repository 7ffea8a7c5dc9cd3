"""Probe of the W8A8 activation quantizer (``kernels/w8a8.py``) on a GPU: launch shapes against the committed one.

    python benchmarks/probes/probe_quant.py [--out DIR]

For M in {1, 16, 64, 256, 1024} and the benchmark's K values, times ``_quantize_rows_kernel`` with the committed
(block_k, num_warps), the launch used until 2026-12-02, and alternatives (one pass with more warps, two sweeps over L2
with smaller blocks), each checked bit for bit against ``quantize_rows_reference``. Same timing method as bench_w4a16.py
(CUDA graphs over rotated operands, medians); reports TB/s of bytes moved (x read once, codes written once).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_w4a16
from bench_w4a16 import Timer, rotations
from quantkit.kernels import w8a8 as W

KS = (4096, 8192, 14336, 28672)
MS = (1, 16, 64, 256, 1024)


def variants(k: int, fmt: str, m: int) -> dict[str, tuple[int, int]]:
    """name -> (block_k, num_warps); the committed launch first, then the rule before 2026-12-02 (one pass up to
    32768 with 4 / 8 / 16 warps) and alternatives."""
    bk, _, nw = W._quantize_launch_params(k, None, fmt, m)
    out = {"committed": (bk, nw)}
    old = triton.next_power_of_2(k)
    old_warps = 4 if old <= 2048 else 8 if old <= 8192 else 16
    out["one pass (until 2026-12-02)"] = (old, old_warps)
    if old_warps < 32:
        out["one pass, 2x warps"] = (old, min(32, 2 * old_warps))
    for block, warps in ((2048, 4), (4096, 8), (8192, 8), (8192, 16)):
        if block < k:
            out[f"two sweeps {block}/{warps}w"] = (block, warps)
    return out


def launch(x, q, s, block_k: int, num_warps: int, fmt: str) -> None:
    W._quantize_rows_kernel[(x.shape[0],)](
        x, q, s, x.shape[1], x.stride(0), x.stride(1), q.stride(0), q.stride(1),
        QMAX=W.QMAX_OF_FORMAT[fmt], IS_FP8=fmt == "fp8", DYNAMIC=True, ONE_PASS=block_k >= x.shape[1],
        BLOCK_K=block_k, PDL=False, num_warps=num_warps,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--formats", default="int8,fp8")
    args = ap.parse_args()
    dev, timer = "cuda", Timer(False)
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for fmt in args.formats.split(","):
        for k in KS:
            for m in MS:
                nbytes = 3 * m * k
                r = rotations(nbytes)
                xs = [torch.randn(m, k, device=dev, generator=gen).half() * 3 for _ in range(r)]
                qs = [torch.empty(m, k, device=dev, dtype=W.DTYPE_OF_FORMAT[fmt]) for _ in range(r)]
                ss = [torch.empty(m, device=dev, dtype=torch.float32) for _ in range(r)]
                want_q, want_s = W.quantize_rows_reference(xs[0], fmt)
                line = [f"{fmt} M={m} K={k}:"]
                for name, (bk, nw) in variants(k, fmt, m).items():
                    launch(xs[0], qs[0], ss[0], bk, nw, fmt)
                    ok = torch.equal(qs[0].view(torch.int8), want_q.view(torch.int8)) and torch.equal(ss[0], want_s)
                    calls = [
                        (lambda x=x, q=q, s=s, bk=bk, nw=nw, fmt=fmt: launch(x, q, s, bk, nw, fmt))
                        for x, q, s in zip(xs, qs, ss, strict=True)
                    ]
                    us = timer.per_call(calls)
                    line.append(f"{name} ({bk}/{nw}w) {us:.2f} us {nbytes / us / 1e6:.2f} TB/s{'' if ok else ' WRONG'}")
                    rows.append({"fmt": fmt, "m": m, "k": k, "variant": name, "block_k": bk, "num_warps": nw,
                                 "us": us, "ok": ok})  # fmt: skip
                print("\n    ".join(line), flush=True)
                del xs, qs, ss
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe_quant.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
