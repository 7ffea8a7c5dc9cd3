"""Probe: W8A8 GEMM with one persistent program per SM (``USE_TMA`` 2) against the committed configs.

    python benchmarks/probes/probe_persistent.py [--out DIR] [--ms 16,64,256,1024,4096,16384] [--shapes all|big]

Each point times, in one run and under bench_w8a8.py's method (CUDA graphs over rotated operands, medians), end to
end (activation quantizer + GEMM): bf16 cuBLAS (``F.linear``), the committed config, and the candidates below, for
int8, fp8 with promoted accumulation (the default) and fp8 with fast accumulation. Every candidate's output is
compared with the committed config's: int8 must match bit for bit, fp8 is reported as the largest difference
relative to the output's largest magnitude.

The first H200 run (2026-12-02) also timed the loop warp-specialized by Triton 3.6 (``warp_specialize=True``,
num_warps 4, not flattened: a producer warp group and two consumers, 12 warps): 4096 x 4096 at M 16/64 ran 10-46%
slower than the committed configs, and 128 x 256 tiles at M >= 1024 hung; that option was removed.

Eighth session (2026-12-02): the skinny candidates had only run on 4096 x 4096, whose 128 output tiles of 16 x 32
fit in one wave. The larger shapes have 448-896 such tiles for 3 resident CTAs per SM (72 KB of shared memory
each), so the last wave runs a fraction of the SMs' slots; persistent programs, one to three per SM, spread the
tiles evenly: `--ms 16,64 --variants int8` on every shape.
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

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, USE_TMA, num_warps, num_stages); the skinny set runs for M <= 64
LARGE = {
    "p128x256w8s3": (128, 256, 128, 8, 2, 8, 3),
    "p256x128w8s3": (256, 128, 128, 8, 2, 8, 3),
}
SKINNY = {  # "pp2" / "pp3": two / three persistent programs per SM (USE_TMA 3 / 4)
    "p16x32k256s6": (16, 32, 256, 1, 2, 4, 6),
    "pp2-16x32k256s6": (16, 32, 256, 1, 3, 4, 6),
    "pp3-16x32k256s6": (16, 32, 256, 1, 4, 4, 6),
    "pp2-16x64k256s4": (16, 64, 256, 1, 3, 4, 4),
    "p64x64k256s4": (64, 64, 256, 1, 2, 4, 4),
    "pp2-64x64k256s4": (64, 64, 256, 1, 3, 4, 4),
    "pp2-32x64k256s4": (32, 64, 256, 1, 3, 4, 4),
}
CANDIDATES = {**LARGE, **SKINNY}
VARIANTS = (("int8", False), ("fp8", False), ("fp8", True))


def as_config(values: tuple) -> dict[str, int]:
    return dict(zip(W.CONFIG_KEYS, values, strict=True))


def measure(p: Problem, fmt: str, fast: bool, timer: Timer, bf16: float, only: set | None = None) -> dict:
    def calls(cfg):
        pdl = False if cfg is not None and cfg["USE_TMA"] >= 2 else None  # the persistent kernel has no PDL launch
        return [
            (
                lambda i=i: W.w8a8_linear(
                    p.x[i], p.wq[fmt][i], p.w_scale[fmt][i], config=cfg, fp8_fast_accum=fast, pdl=pdl
                )
            )
            for i in range(p.r)
        ]

    base = calls(None)
    want = base[0]().float()
    row = {"n": p.n, "k": p.k, "m": p.m, "fmt": fmt + ("_fast" if fast else ""), "bf16_us": bf16}
    row["committed"] = W.pick_config(p.m, fmt, fast)
    row["committed_us"] = timer.per_call(base) * 1e6
    for name, values in (SKINNY if p.m <= 64 else LARGE).items():
        if only and name not in only:
            continue
        print(f"  {fmt}{'_fast' if fast else ''} M={p.m} {name} ...", end="", flush=True)
        try:
            cand = calls(as_config(values))
            got = cand[0]().float()
            diff = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
            row[f"{name}_diff"] = diff
            row[f"{name}_us"] = timer.per_call(cand) * 1e6
            print(f" {row[f'{name}_us']:.1f} us", flush=True)
        except Exception as exc:  # a candidate that does not compile or fit is reported, not fatal
            row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--ms", default="16,64,256,1024,4096,16384")
    ap.add_argument("--shapes", default="all", choices=["all", "big", "one"])
    ap.add_argument("--variants", default="int8,fp8,fp8_fast")
    ap.add_argument("--only", default="", help="comma-separated candidate names (default: all)")
    args = ap.parse_args()
    timer, rows = Timer(False, 10, 40), []
    shapes = {"all": SHAPES, "big": SHAPES[-2:], "one": [(8192, 8192)]}[args.shapes]
    only = set(filter(None, args.only.split(",")))
    variants = [(f, fast) for f, fast in VARIANTS if f + ("_fast" if fast else "") in args.variants.split(",")]
    for n, k in shapes:
        for m in [int(v) for v in args.ms.split(",")]:
            p = Problem(n, k, m, "cuda", seed=0)
            bf16 = timer.per_call([(lambda i=i, p=p: F.linear(p.x[i], p.w16[i])) for i in range(p.r)]) * 1e6
            for fmt, fast in variants:
                row = measure(p, fmt, fast, timer, bf16, only)
                rows.append(row)
                timed = {name: row[f"{name}_us"] for name in CANDIDATES if f"{name}_us" in row}
                best = min(timed, key=timed.get) if timed else None
                cells = " ".join(
                    f"{name} {bf16 / us:.2f}x" + ("" if row[f"{name}_diff"] <= (0 if fmt == "int8" else 1e-2) else "!")
                    for name, us in timed.items()
                )
                errors = [name for name in CANDIDATES if f"{name}_error" in row]
                print(
                    f"{row['fmt']} {n}x{k} M={m}: bf16 {bf16:.1f} committed {bf16 / row['committed_us']:.2f}x | "
                    f"{cells} | best {best}" + (f" | errors {errors}" if errors else ""),
                    flush=True,
                )
                if args.out:  # after every row: a run cut short keeps what it measured
                    args.out.mkdir(parents=True, exist_ok=True)
                    (args.out / "probe_persistent.json").write_text(json.dumps(rows, indent=1))
            del p
            torch.cuda.empty_cache()
    if args.out:
        for row in rows:
            for name in CANDIDATES:
                if f"{name}_error" in row:
                    print(f"{row['fmt']} {row['n']}x{row['k']} M={row['m']} {name}: {row[f'{name}_error']}")


if __name__ == "__main__":
    main()
