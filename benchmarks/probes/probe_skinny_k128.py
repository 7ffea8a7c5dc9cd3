"""Probe: W4A16 tensor-core configs for M = 4-64 with 128-deep K tiles against the committed ones.

    python benchmarks/probes/probe_skinny_k128.py [--out DIR] [--ms 4,8,16,32,64] [--groups 128,64] [--second]

Why: the committed M = 4-16 config (swap-AB, 64 x 64 tiles) runs 7.7 SASS instructions per weight at sm_90 in its
main loop, half of them loop and address overhead paid once per 64-deep K tile; with K tiles of 128 the same
work is 4.8-5.1 per weight (``benchmarks/sass_w4a16.py`` style counts, Triton 3.6). No sweep had offered BLOCK_K
128 to these regimes. At group 64 a K tile is capped to the group (``plan_launch``), so those rows show what the
config does where it cannot use the deeper tile.

Each cell: cuBLAS fp16 and every candidate in the same run (bench_w4a16.py's method: CUDA graphs over rotated
operands, L2 flushed, medians), every candidate checked against float64 first (within 2x cuBLAS's own error).
Rows are printed and the JSON rewritten as they come.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_w4a16
from bench_w4a16 import SHAPES, Timer, checked_time, layer_walk
from quantkit.kernels import w4a16_configs as C

F_ = C.KernelConfig
CANDIDATES = {
    "skinny": [  # M <= 16
        F_("fused", 16, 64, 128, 4, 3, split_waves=4, fuse_scale=True, swap_ab=True),
        F_("fused", 16, 128, 128, 4, 3, split_waves=4, fuse_scale=True, swap_ab=True),
        F_("fused", 16, 128, 128, 4, 4, split_waves=4, fuse_scale=True, swap_ab=True),
        F_("fused", 16, 256, 128, 8, 3, split_waves=4, fuse_scale=True, swap_ab=True),
        F_("fused", 16, 64, 128, 4, 3, split_waves=4, swap_ab=True),
        F_("fused", 16, 64, 128, 4, 4, split_waves=8, fuse_scale=True, swap_ab=True),
    ],
    "medium": [  # 16 < M <= 64
        F_("fused", 32, 128, 128, 4, 3, split_waves=2, fuse_scale=True, swap_ab=True),
        F_("fused", 64, 128, 128, 4, 3, split_waves=2, fuse_scale=True, swap_ab=True),
        F_("fused", 64, 64, 128, 4, 3, split_waves=2, fuse_scale=True, swap_ab=True),
        F_("fused", 64, 64, 128, 4, 3, split_waves=4, fuse_scale=True, swap_ab=True),
    ],
    # second run (--second): around the first run's medium winner, 64 x 64 tiles 128 deep
    "second": [
        F_("fused", 64, 64, 128, 4, 3, split_waves=2, fuse_scale=True, swap_ab=True),
        F_("fused", 64, 64, 128, 4, 4, split_waves=2, fuse_scale=True, swap_ab=True),
        F_("fused", 64, 64, 128, 4, 2, split_waves=2, fuse_scale=True, swap_ab=True),
        F_("fused", 64, 64, 128, 4, 3, split_waves=3, fuse_scale=True, swap_ab=True),
        F_("fused", 64, 64, 128, 4, 3, split_waves=1, fuse_scale=True, swap_ab=True),
        F_("fused", 64, 64, 64, 4, 3, split_waves=2, fuse_scale=True, swap_ab=True),
        F_("fused", 32, 64, 128, 4, 3, split_waves=2, fuse_scale=True, swap_ab=True),
        F_("fused", 64, 64, 128, 4, 3, split_waves=2, fuse_scale=True),
    ],
    # third run (--ms 128,256): the fused kernel where the committed table dequantizes and calls cuBLAS
    "large": [
        F_("fused", 64, 64, 128, 4, 3, split_waves=2, fuse_scale=True, swap_ab=True),
        F_("fused", 128, 64, 128, 4, 3, split_waves=2, fuse_scale=True, swap_ab=True),
        F_("fused", 128, 128, 128, 8, 3, split_waves=1, fuse_scale=True, swap_ab=True),
        F_("fused", 128, 64, 128, 4, 3, split_waves=1, fuse_scale=True),
        F_("fused", 128, 128, 64, 8, 4, split_waves=1, fuse_scale=True),
    ],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    ap.add_argument("--ms", default="4,8,16,32,64")
    ap.add_argument("--groups", default="128,64")
    ap.add_argument("--second", action="store_true", help="the second run's candidates (M 32 and 64)")
    args = ap.parse_args()
    if args.second and args.ms == "4,8,16,32,64":
        args.ms = "32,64"
    args.out.mkdir(parents=True, exist_ok=True)
    ms = [int(v) for v in args.ms.split(",")]
    timer = Timer(smoke=False)
    gen = torch.Generator(device="cuda").manual_seed(4)
    rows = []
    groups = [int(g) for g in args.groups.split(",")]
    for n, k, group, layer, base in layer_walk(SHAPES, groups, ms, timer, "cuda", gen):
        for m in ms:
            committed = C.config_for(m)
            regime = "second" if args.second else "skinny" if m <= 16 else "medium" if m <= 64 else "large"
            cands = [committed, *CANDIDATES[regime]]
            row = {"n": n, "k": k, "group": group, "m": m, "fp16_us": base[m], "committed": committed.name}
            line = f"{n}x{k} g{group} M={m}: fp16 {base[m]:.1f} us"
            for cfg in cands:
                ok, us = checked_time(layer, m, cfg, timer)
                row[cfg.name] = {"us": us, "ok": ok}
                line += f" | {cfg.name} " + (f"{base[m] / us:.2f}x" if us else "FAILED")
            print(line, flush=True)
            rows.append(row)
            (args.out / f"probe_skinny_k128{'-second' * args.second}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
