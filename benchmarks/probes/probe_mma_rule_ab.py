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


def checked_variant(timer: Timer, layer: Layer, m: int, fp16: float, tag: str, label: str, split: int, linear,
                    row: dict) -> str:  # fmt: skip
    """``linear`` (x, w, config=, out=) checked against float64 (fp16 and bf16 activations), timed if right; its
    figures go into row[tag] and its piece of the cell's line comes back. A launch failure is reported, not fatal."""
    try:
        ok = layer.check(m, None, linear=linear)["ok"] and check_bf16(layer, m, None, linear)
        us = timer.per_call(layer.calls(m, None, linear=linear)) if ok else float("nan")
    except Exception as exc:
        ok, us = False, float("nan")
        row[tag + "_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    row[tag] = {"config": label, "split": split, "ok": ok, "us": us}
    return f" | {tag} {label}-sk{split} {us:.1f} us {fp16 / us:.2f}x" + ("" if ok else " WRONG")


def ab_walk(default_cells: str, plan, json_name: str) -> None:
    """The A/B probes' command line (--cells "NxK:M,M;...", --group, --out) and walk: per cell, ``plan(n, k, group,
    sms, m)`` gives [(tag, label, split, linear), ...] to compare, or a string saying why the cell is skipped; then
    cuBLAS fp16 and each variant (``checked_variant``), a line printed and the JSON rewritten per cell."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--cells", default=default_cells)
    ap.add_argument("--group", type=int, default=128)
    args = ap.parse_args()
    timer, dev, sms = Timer(False), "cuda", num_sms(torch.device("cuda"))
    gen = torch.Generator(device=dev).manual_seed(1)
    rows = []
    for cell in args.cells.split(";"):
        shape, ms = cell.split(":")
        n, k = map(int, shape.split("x"))
        layer = None
        for m in map(int, ms.split(",")):
            variants = plan(n, k, args.group, sms, m)
            if isinstance(variants, str):
                print(f"{n}x{k} g{args.group} M={m}: {variants}")
                continue
            layer = layer or Layer(n, k, args.group, dev, seed=n + k)
            fp16 = timer.per_call(fp16_calls(n, k, m, dev, gen))
            row = {"n": n, "k": k, "m": m, "group": args.group, "fp16_us": fp16}
            line = f"{n}x{k} g{args.group} M={m}: fp16 {fp16:.1f} us"
            for tag, label, split, linear in variants:
                line += checked_variant(timer, layer, m, fp16, tag, label, split, linear, row)
            rows.append(row)
            print(line, flush=True)
            if args.out:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / json_name).write_text(json.dumps(rows, indent=1))
        del layer
        torch.cuda.empty_cache()


def rule_variants(n: int, k: int, group: int, sms: int, m: int) -> list:
    """The plan of ``_doubling_config`` (before the fallback) and of ``mma_config_for`` (with it)."""
    variants = []
    for tag, cfg in (
        ("old", MG._doubling_config(n, k, group, sms, m)),
        ("new", MG.mma_config_for(n, k, group, sms, m)),
    ):
        split = MG.mma_gemv_split(cfg, n, k, sms)
        variants.append((tag, cfg.name, split, forced(cfg, split)))
    return variants


def main() -> None:
    ab_walk(CELLS, rule_variants, "probe_mma_rule_ab.json")


if __name__ == "__main__":
    main()
