"""Probe: the mma gemv's M <= 8 rule with and without its under-filled-grid fallback, through the same kernel.

    python benchmarks/probes/probe_mma_rule_ab.py [--out DIR] [--cells "4096x14336:2,4,8;3584x3584:1,4"] [--group 128]

For each N x K and M: cuBLAS fp16, the plan of ``_doubling_config`` (the rule before the fallback) and the plan of
``mma_config_for`` (with it), each checked against float64 (fp16 and bf16) and timed as bench_w4a16.py times
(CUDA graphs over rotated weights larger than L2, medians). Prints a line per cell; ``probe_mma_rule_ab.json``.
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
from probe_mma_gemv import check_bf16
from quantkit.kernels import w4a16_mma_gemv as MG
from quantkit.kernels.w4a16_weight import num_sms

CELLS = ("4096x14336:2,4,8;3584x3584:1,4;4608x3584:1,4;2048x5632:1,4;8192x29568:1,4;4096x11008:1,4;"
         "5120x13824:2,8;4096x12288:4")  # fmt: skip


def forced(cfg, split):
    return lambda x, w, config=None, out=None: MG.w4a16_mma_gemv(x, w, out=out, config=cfg, split=split)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--cells", default=CELLS)
    ap.add_argument("--group", type=int, default=128)
    args = ap.parse_args()
    timer, dev, sms = Timer(False), "cuda", num_sms(torch.device("cuda"))
    gen = torch.Generator(device=dev).manual_seed(1)
    rows = []
    for cell in args.cells.split(";"):
        shape, ms = cell.split(":")
        n, k = map(int, shape.split("x"))
        layer = Layer(n, k, args.group, dev, seed=n + k)
        for m in map(int, ms.split(",")):
            fp16 = timer.per_call(fp16_calls(n, k, m, dev, gen))
            row = {"n": n, "k": k, "m": m, "group": args.group, "fp16_us": fp16}
            line = f"{n}x{k} g{args.group} M={m}: fp16 {fp16:.1f} us"
            for tag, cfg in (("old", MG._doubling_config(n, k, args.group, sms, m)),
                             ("new", MG.mma_config_for(n, k, args.group, sms, m))):  # fmt: skip
                split = MG.mma_gemv_split(cfg, n, k, sms)
                linear = forced(cfg, split)
                ok = layer.check(m, cfg, linear=linear)["ok"] and check_bf16(layer, m, cfg, linear)
                us = timer.per_call(layer.calls(m, cfg, linear=linear)) if ok else float("nan")
                row[tag] = {"config": cfg.name, "split": split, "ok": ok, "us": us}
                line += f" | {tag} {cfg.name}-sk{split} {us:.1f} us {fp16 / us:.2f}x" + ("" if ok else " WRONG")
            rows.append(row)
            print(line, flush=True)
            if args.out:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "probe_mma_rule_ab.json").write_text(json.dumps(rows, indent=1))
        del layer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
