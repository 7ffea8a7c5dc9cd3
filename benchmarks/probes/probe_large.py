"""Probe: fused W4A16 tiles that reuse each dequantized weight tile for 256 rows of x, against dequantize + cuBLAS
(M = 128-4096).

    python benchmarks/probes/probe_large.py [--out DIR] [--ms 128,256,512,1024,4096] [--groups 128]

Why: from M = 256 the committed path dequantizes the whole weight to fp16 (2 bytes written and read back per
weight) before cuBLAS: 0.59x cuBLAS fp16 at M = 256, 0.82x at 1024 (results/w4a16-fixup-h200-2026-12-02.md). The
fused tiles tried so far put at most 128 rows of x on one dequantized tile (m128n64k128 swap-AB: 0.47x at M = 256;
m128n128k64 with 8 warps: 0.35-0.65x), so the dequantization and its trip through shared memory were paid once
per 128 rows. Candidates here give one weight tile 256 rows of x: swap-AB with the 256 rows as wgmma's N side
(64 x 256 or 128 x 256 per warpgroup pair), and the plain orientation with 256-wide tiles either way. All compile
for sm_90 with Triton 3.6 at 221-254 registers (benchmarks/sass_w4a16.py-style report; split-K variants spill
8 bytes in the fix-up only).

Each cell: cuBLAS fp16, the committed config, dequantize + cuBLAS and every candidate in the same run
(bench_w4a16.py's method: CUDA graphs over rotated operands, L2 flushed, medians), every candidate checked
against float64 first (within 2x cuBLAS's own error). Rows are printed and the JSON rewritten as they come.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_w4a16
from bench_w4a16 import SHAPES, Timer, checked_time, kernel_metadata, layer_walk
from quantkit.kernels import w4a16_configs as C

F_ = C.KernelConfig
CANDIDATES = [
    F_("dequant"),
    F_("fused", 256, 128, 64, 8, 3, split_waves=1, fuse_scale=True, swap_ab=True),  # wgmma 64 x 256 per warpgroup
    F_("fused", 256, 64, 64, 4, 3, split_waves=1, fuse_scale=True, swap_ab=True),
    F_("fused", 256, 64, 64, 4, 2, split_waves=1, fuse_scale=True, swap_ab=True),
    F_("fused", 128, 256, 64, 8, 3, split_waves=1, fuse_scale=True),  # x as A from shared memory, N = 256
    F_("fused", 256, 128, 64, 8, 3, split_waves=1, fuse_scale=True),
    F_("fused", 128, 128, 64, 8, 3, split_waves=1, fuse_scale=True, swap_ab=True),
    F_("fused", 128, 128, 64, 8, 4, split_waves=1, fuse_scale=True),  # bench_w4a16.py's "large" candidate
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    ap.add_argument("--ms", default="128,256,512,1024,4096")
    ap.add_argument("--groups", default="128")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ms = [int(v) for v in args.ms.split(",")]
    groups = [int(g) for g in args.groups.split(",")]
    timer = Timer(smoke=False)
    gen = torch.Generator(device="cuda").manual_seed(5)
    rows, meta = [], {}
    out = args.out / "probe_large.json"
    for n, k, group, layer, base in layer_walk(SHAPES, groups, ms, timer, "cuda", gen):
        for m in ms:
            committed = C.config_for(m, n)
            row = {"n": n, "k": k, "group": group, "m": m, "fp16_us": base[m], "committed": committed.name}
            line = f"{n}x{k} g{group} M={m}: fp16 {base[m]:.1f} us"
            cands = [committed] + [c for c in CANDIDATES if c != committed]
            for cfg in cands:
                ok, us = checked_time(layer, m, cfg, timer)
                if ok and cfg.method == "fused" and cfg.name not in meta:
                    meta[cfg.name] = kernel_metadata(layer, m, cfg)
                row[cfg.name] = {"us": us, "ok": ok}
                line += f" | {cfg.name} " + (f"{base[m] / us:.2f}x" if us else "FAILED")
            print(line, flush=True)
            rows.append(row)
            out.write_text(json.dumps({"rows": rows, "kernels": meta}, indent=1))


if __name__ == "__main__":
    main()
