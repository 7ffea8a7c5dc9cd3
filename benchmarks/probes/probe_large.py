"""Probe: fused W4A16 tiles that reuse each dequantized weight tile for 256 rows of x, against dequantize + cuBLAS
(M = 128-4096).

    python benchmarks/probes/probe_large.py [--out DIR] [--ms 128,256,512,1024,4096] [--groups 128]

Why: from M = 256 the committed path dequantizes the whole weight to fp16 (2 bytes written and read back per
weight) before cuBLAS: 0.59x cuBLAS fp16 at M = 256, 0.82x at 1024 (results/w4a16-fixup-h200-2026-12-02.md). The
fused tiles tried so far put at most 128 rows of x on one dequantized tile (m128n64k128 swap-AB: 0.47x at M = 256;
m128n128k64 with 8 warps: 0.35-0.65x), so the dequantization and its trip through shared memory were paid once
per 128 rows. Candidates here give one weight tile 256 rows of x: swap-AB with the 256 rows as wgmma's N side
(64 x 256 or 128 x 256 per warpgroup pair), and the plain orientation with 256-wide tiles either way. The JSON
records each candidate's compiled registers and spills (the H200 run: 201-255 registers, 2 spilled words in the
m256n128k64 8-warp tiles).

Each cell: cuBLAS fp16, the committed config, dequantize + cuBLAS and every candidate in the same run
(bench_w4a16.py's method: CUDA graphs over rotated operands, L2 flushed, medians), every candidate checked
against float64 first (within 2x cuBLAS's own error). Rows are printed and the JSON rewritten as they come.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_w4a16
from bench_w4a16 import SHAPES, run_probe
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

    def candidates(m: int, n: int) -> list[C.KernelConfig]:
        committed = C.config_for(m, n)
        return [committed] + [c for c in CANDIDATES if c != committed]

    run_probe(SHAPES, groups, ms, args.out / "probe_large.json", 5, candidates)


if __name__ == "__main__":
    main()
