"""Probe: the split-K fix-up's rounds against the committed W4A16 skinny configs (M = 1-32).

    python benchmarks/probes/probe_fixup.py [--out DIR] [--ms 1,2,16,32] [--groups 128,64] [--set m1|m4]

Why: at M = 1 the committed gemv splits K until ~4 x 132 CTAs exist, so a 4096 x 4096 layer runs 32 splits of one
128-deep K tile each, and the last CTA of each output tile sums 32 partials four per round: eight dependent L2
round trips after the weights have been read. The small layers take 9.9 us for 8.4 MB of weights (0.9 TB/s,
results/w4a16-medium-h200-2026-12-02.md) and the runtime's batch-1 decode spends most of its time in such layers.
Candidates: the committed config of each M with ``fixup_unroll`` 8, 16 and 32 partials per round, and with other
split factors. Shapes: issue 6's six plus the runtime's fused projections of Llama-3-8B (qkv 6144 x 4096,
gate_up 28672 x 4096).

Each cell: cuBLAS fp16 and every candidate in the same run (bench_w4a16.py's method: CUDA graphs over rotated
operands, L2 flushed, medians), every candidate checked against float64 first (within 2x cuBLAS's own error).
Registers and spills of each candidate's compiled kernel (first shape) are recorded. Rows are printed and the
JSON rewritten as they come.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_w4a16
from bench_w4a16 import SHAPES, run_probe
from quantkit.kernels import w4a16_configs as C

RUNTIME_SHAPES = [(6144, 4096), (28672, 4096)]  # Llama-3-8B's fused qkv and gate_up projections


def m1_candidates() -> list[C.KernelConfig]:
    """``--set m1``: the M = 1 gemv with 64-deep K tiles (64 registers: 8 CTAs of 4 warps per SM instead of 5) at
    group 128 too, and with more splits on the wide layers, all with the one-round fix-up."""
    base = C.config_for(1)
    return [base] + [replace(base, block_k=bk, split_waves=w) for bk, w in ((64, 4), (64, 8), (64, 16), (128, 8))]


def m4_candidates() -> list[C.KernelConfig]:
    """``--set m4``: the M = 4 swap kernel with the M = 16 regime's 64-wide N tiles and more splits (on 28672 x 8192
    the committed 128-wide tiles ran 1.10-1.14x where a 64-wide register-A probe ran 1.54x,
    results/w4a16-rega-h200-2026-12-03.md)."""
    base = C.config_for(4)
    narrow = replace(base, block_n=64)
    return [base, narrow, replace(narrow, split_waves=8), replace(narrow, block_k=128), replace(base, split_waves=8)]


def wave_candidates(n: int) -> list[C.KernelConfig]:
    """``--set waves``: the M = 1 gemv split to fill the resident CTA slots without a second wave. The wide-layer
    config (64 registers, 8 CTAs per SM, 1056 slots) splits 28672 x 8192 into 56 x 19 = 1064 CTAs, 8 of them in a
    second wave; the table's config (96 registers, 5 per SM, 660 slots) fills 512 of them on N = 8192 layers."""
    base = C.config_for(1, n)
    waves = (6, 7) if base.split_waves == 8 else (5, 6)
    return [base] + [replace(base, split_waves=w) for w in waves]


def candidates(m: int, which: str = "fixup", n: int = 0) -> list[C.KernelConfig]:
    if which == "waves":
        return wave_candidates(n)
    if which == "m1":
        return m1_candidates()
    if which == "m4":
        return m4_candidates()
    base = C.config_for(m)
    cands = [base] + [replace(base, fixup_unroll=u) for u in (8, 16, 32)]
    waves = (base.split_waves // 2, base.split_waves * 2)
    return cands + [replace(base, split_waves=w, fixup_unroll=16) for w in waves]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    ap.add_argument("--ms", default="1,2,16,32")
    ap.add_argument("--groups", default="128,64")
    ap.add_argument("--set", default="fixup", choices=["fixup", "m1", "m4", "waves"],
                    help="m1: the M = 1 occupancy candidates; m4: the M = 4 tile widths; waves: M = 1 splits that "
                         "fill one wave")  # fmt: skip
    args = ap.parse_args()
    if args.set in ("m1", "m4", "waves"):
        args.ms = "1" if args.set == "waves" else args.set[1:]
    args.out.mkdir(parents=True, exist_ok=True)
    ms = [int(v) for v in args.ms.split(",")]
    groups = [int(g) for g in args.groups.split(",")]
    out = args.out / f"probe_fixup{'' if args.set == 'fixup' else '-' + args.set}.json"
    run_probe(SHAPES + RUNTIME_SHAPES, groups, ms, out, 4, lambda m, n: candidates(m, args.set, n))


if __name__ == "__main__":
    main()
