"""Probe: how fast can the skinny-M W4A16 kernels' access pattern read the packed weight at all? (H200)

    python benchmarks/probes/probe_strip_read.py [--out DIR]

Why: the mma.sync gemv streams 4-bit weights at 1.1-2.9 TB/s; a TMA ring that kept 16-64 KB per CTA in flight did
not raise that (results/w4a16-mma-tma-ring-h200-2026-12-04.md), so either the consumers' work or the memory access
pattern bounds it. This probe runs no arithmetic: each program sums the int32 words of one [K / 8 / split, BLOCK_N]
strip, as the gemv's CTAs read them (grid N / BLOCK_N x split, split chosen as the gemv's rule does), from
- ``gptq``: the GPTQ layout [K / 8, N] (each strip row is BLOCK_N x 4 contiguous bytes, rows N x 4 bytes apart);
- ``tiles``: the same words stored strip by strip ([N / BLOCK_N, K / 8, BLOCK_N], each program's strip contiguous),
the re-layout a kernel could ask for at load time.
Timing as bench_w4a16.py (CUDA graphs over rotated buffers larger than L2, medians); TB/s of weight bytes.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_w4a16
from bench_w4a16 import Timer, copy_bandwidth, rotations

SHAPES = [(28672, 8192), (8192, 28672), (8192, 8192), (14336, 4096), (4096, 14336), (4096, 4096), (6144, 4096),
          (28672, 4096)]  # fmt: skip


@triton.jit
def _read_strips(w_ptr, out_ptr, rows_per_split, stride_r, strip_stride, BN: tl.constexpr, RB: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    r = tl.arange(0, RB)[:, None]
    c = tl.arange(0, BN)[None, :]
    base = w_ptr + pid_n.to(tl.int64) * strip_stride + (split * rows_per_split).to(tl.int64) * stride_r
    acc = tl.zeros([RB, BN], tl.int32)
    for r0 in range(0, rows_per_split, RB):
        acc += tl.load(base + (r0 + r) * stride_r + c)
    tl.store(out_ptr + pid_n * tl.num_programs(1) + split, tl.sum(tl.sum(acc, 1), 0))


def split_for(n: int, k: int, bn: int, rb: int, sms: int, fill: float = 4.0, max_split: int = 32) -> int:
    ctas, rows, split = n // bn, k // 8, 1
    while ctas * split < fill * sms and split * 2 <= max_split and rows % (2 * split * rb) == 0:
        split *= 2
    return split


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--variants",
        default="128x16w4s1,128x16w4s3,64x16w2s3,128x32w4s3,256x16w8s3",
        help="BLOCK_N x rows per load, warps, stages, optional f<fill> (grid = fill x SMs, default 4)",
    )
    ap.add_argument("--layouts", default="gptq,tiles")
    ap.add_argument("--shapes", default="all", help="all, or the first N of SHAPES")
    args = ap.parse_args()
    timer, dev = Timer(False), "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy = copy_bandwidth(timer, dev)
    print(f"copy bandwidth {copy:.2f} TB/s", flush=True)
    rows = []
    for n, k in SHAPES if args.shapes == "all" else SHAPES[: int(args.shapes)]:
        nbytes = n * k // 2
        r = rotations(nbytes)
        bufs = [torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, device=dev) for _ in range(r)]
        row = {"n": n, "k": k, "bytes": nbytes, "copy_tbs": copy}
        line = f"{n}x{k}:"
        ref = [(lambda w=w: torch.amax(w)) for w in bufs]  # PyTorch's own reduction: a read of every word
        us = timer.per_call(ref)
        row["amax_us"] = us
        line += f" | torch.amax {us:6.1f} us {nbytes / us / 1e6:4.2f} TB/s"
        # cuBLAS fp16 at M = 1 on a [N, K / 4] weight: the same bytes as the 4-bit codes, the float gemv's read
        x = torch.randn(1, k // 4, device=dev, dtype=torch.float16)
        same = [partial(F.linear, x, w.view(torch.float16).view(n, k // 4)) for w in bufs]
        us = timer.per_call(same)
        row["fp16_same_bytes_us"] = us
        line += f" | fp16 gemv, same bytes {us:6.1f} us {nbytes / us / 1e6:4.2f} TB/s"
        for name in args.variants.split(","):
            hit = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)(?:f([\d.]+))?", name)
            bn, rb, warps, stages = (int(v) for v in hit.groups()[:4])
            split = split_for(n, k, bn, rb, sms, float(hit.group(5) or 4.0))
            rps = k // 8 // split
            out = torch.empty(n // bn * split, dtype=torch.int32, device=dev)
            for layout in args.layouts.split(","):
                if layout == "gptq":
                    ws, stride_r, strip = bufs, n, bn
                else:  # the same words, strip by strip
                    ws = [b.view(k // 8, n // bn, bn).transpose(0, 1).contiguous() for b in bufs]
                    stride_r, strip = bn, (k // 8) * bn
                launch = _read_strips[(n // bn, split)]
                kw = dict(BN=bn, RB=rb, num_warps=warps, num_stages=stages)
                calls = [partial(launch, w, out, rps, stride_r, strip, **kw) for w in ws]
                us = timer.per_call(calls)
                row[f"{name}_{layout}_us"] = us
                line += f" | {name} split {split} {layout} {us:6.1f} us {nbytes / us / 1e6:4.2f} TB/s"
                if layout == "tiles":
                    del ws
        print(line, flush=True)
        rows.append(row)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "probe_strip_read.json").write_text(json.dumps(rows, indent=1))
        del bufs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
