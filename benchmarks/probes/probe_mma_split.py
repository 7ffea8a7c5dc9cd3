"""Probe: the mma.sync W4A16 gemv (``kernels/w4a16_mma_gemv.py``) at every split-K factor, to fit the split rule.

    python benchmarks/probes/probe_mma_split.py [--out DIR] [--ms 1,4,16] [--groups 128,64]
        [--variants mma-w4s4f4,mma-w4s2f4,mma-w2s4f8pv14] [--splits 1,2,4,8,16,32] [--shapes 8192x28672,...]

For each layer shape, M, group and config: the time of each split that divides the K loop, with cuBLAS fp16 in the
same run (bench_w4a16.py's timing: CUDA graphs over rotated weights larger than L2, medians). The split the
automatic rule picks is checked against float64 first (a wrong config is reported, not timed), and so is every
split that is not a power of two (the tests force powers of two); a wrong split is reported and not timed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_w4a16
sys.path.insert(0, str(Path(__file__).resolve().parent))  # probe_mma_gemv
from bench_w4a16 import Layer, Timer, fp16_calls
from probe_mma_gemv import SHAPES, parse_variant
from quantkit.kernels.w4a16_configs import LOCK_SLOTS
from quantkit.kernels.w4a16_mma_gemv import mma_gemv_split, w4a16_mma_gemv
from quantkit.kernels.w4a16_weight import num_sms


def forced(plan):
    """The product at a fixed (config, split), in the signature Layer.calls expects."""
    cfg, split = plan
    return lambda x, w, config=None, out=None: w4a16_mma_gemv(x, w, out=out, config=cfg, split=split)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--ms", default="1,4,16")
    ap.add_argument("--groups", default="128,64")
    ap.add_argument("--variants", default="mma-w4s4f4,mma-w4s2f4,mma-w2s4f8pv14")
    ap.add_argument("--splits", default="1,2,4,8,16,32")
    ap.add_argument("--shapes", default="all", help="N x K pairs, e.g. 8192x28672,4096x14336 (default: all)")
    args = ap.parse_args()
    shapes = SHAPES if args.shapes == "all" else [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    timer, dev, sms = Timer(False), "cuda", num_sms(torch.device("cuda"))
    gen = torch.Generator(device=dev).manual_seed(1)
    variants = [parse_variant(v) for v in args.variants.split(",")]
    rows = []
    for n, k in shapes:
        for group in map(int, args.groups.split(",")):
            layer = Layer(n, k, group, dev, seed=n + k)
            for m in map(int, args.ms.split(",")):
                fp16 = timer.per_call(fp16_calls(n, k, m, dev, gen))
                for cfg in variants:
                    auto = mma_gemv_split(cfg, n, k, sms)
                    row = {"n": n, "k": k, "m": m, "group": group, "config": cfg.name, "fp16_us": fp16, "auto": auto,
                           "bytes": layer.bytes, "us": {}}  # fmt: skip
                    try:
                        ok = layer.check(m, (cfg, auto), linear=forced((cfg, auto)))["ok"]
                    except Exception as exc:  # a config that cannot run this layer: the others still run
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                        rows.append(row)
                        print(f"{n}x{k} g{group} M={m} {cfg.name}: {row['error']}", flush=True)
                        continue
                    if not ok:
                        row["error"] = "WRONG"
                        rows.append(row)
                        print(f"{n}x{k} g{group} M={m} {cfg.name}: WRONG", flush=True)
                        continue
                    iters = k // (32 * cfg.steps)
                    for split in map(int, args.splits.split(",")):
                        if iters % split or (split > 1 and -(-n // cfg.block_n) > LOCK_SLOTS):
                            continue
                        plan = (cfg, split)
                        if split & (split - 1) and not layer.check(m, plan, linear=forced(plan))["ok"]:
                            row.setdefault("wrong", []).append(split)
                            continue
                        row["us"][split] = timer.per_call(layer.calls(m, plan, linear=forced(plan)))
                    rows.append(row)
                    best = min(row["us"], key=row["us"].get)
                    cells = " ".join(f"{s}:{fp16 / t:.2f}" for s, t in row["us"].items())
                    cells += f" WRONG {row['wrong']}" if "wrong" in row else ""
                    print(f"{n}x{k} g{group} M={m} {cfg.name:<15} auto {auto:>2} best {best:>2} | {cells}", flush=True)
                    if args.out:  # after every cell: a run cut short keeps what it measured
                        args.out.mkdir(parents=True, exist_ok=True)
                        (args.out / "probe_mma_split.json").write_text(json.dumps(rows, indent=1))
            del layer
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
