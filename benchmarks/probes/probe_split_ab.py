"""Probe: the W4A16 kernels whose split-K parts may be unequal (mma gemv at M 9-16, register-A, warp-specialized)
with the rule that wanted equal parts against the committed one (parts as even as they go), through the same
kernel.

    python benchmarks/probes/probe_split_ab.py [--out DIR] [--cells "4096x11008:64,128;3584x18944:64"] [--group 128]

For each N x K and M: cuBLAS fp16, then the kernel ``w4a16_linear`` dispatches to (the mma gemv up to 16 rows,
register-A below 129 rows where its rule offers it, else the warp-specialized one) at the split of the old rule and
at the committed rule's, each checked against float64 (fp16 and bf16) and timed as bench_w4a16.py times (CUDA graphs
over rotated weights larger than L2, medians). Cells where the two rules agree are skipped. Prints a line per cell;
``probe_split_ab.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_w4a16
sys.path.insert(0, str(Path(__file__).resolve().parent))  # probe_mma_gemv
from bench_w4a16 import Layer, Timer, fp16_calls
from probe_mma_gemv import check_bf16
from quantkit.kernels import w4a16_mma_gemv as MG
from quantkit.kernels import w4a16_rega as R
from quantkit.kernels import w4a16_ws as WS
from quantkit.kernels.w4a16_weight import num_sms

# down projections of Llama-2-7B / -13B, Qwen2.5-7B / -72B, TinyLlama; Llama-2's up projection for contrast
CELLS = ("4096x11008:16,32,64,96,128,256;5120x13824:16,64,128,256;3584x18944:16,32,64,128;2048x5632:16,96,128;"
         "8192x29568:16,64,128,256;11008x4096:16,64,128;1536x8960:16;896x4864:16")  # fmt: skip


def old_rega_split(cfg: R.RegaConfig, n: int, k: int, sms: int) -> int:
    """The rule before uneven parts: doubled only while every part stays an even number of whole tiles."""
    tiles, split = -(-n // cfg.block_n), 1
    while (tiles * split < cfg.split_waves * sms and split * 2 <= R.REGA_MAX_SPLIT
           and k % (cfg.block_k * split * 4) == 0 and k // (split * 2) >= 512):  # fmt: skip
        split *= 2
    return split


def old_ws_split(cfg: WS.WSConfig, m: int, n: int, k: int, group: int, sms: int) -> int:
    """The rule before uneven parts: doubled only while every part stays a whole number of groups."""
    tiles, split = -(-m // cfg.block_m) * -(-n // cfg.block_n), 1
    while (tiles * split < WS.WS_FILL * sms and split * 2 <= WS.WS_MAX_SPLIT
           and k % (group * split * 2) == 0 and k // (split * 2) >= 2 * cfg.block_k):  # fmt: skip
        split *= 2
    return split


def plans(m: int, n: int, k: int, group: int, sms: int):
    """(name, config, old split, new split, linear(split)) of the kernel the dispatcher would run, or None."""
    mcfg = MG.mma_config_for(n, k, group, sms, m) if m <= MG.MMA_DISPATCH_M else None
    if mcfg is not None:

        def mma(split):
            return lambda x, w, config=None, out=None: MG.w4a16_mma_gemv(x, w, out=out, config=mcfg, split=split)

        return (
            mcfg.name,
            MG.mma_gemv_split(replace(mcfg, uneven=False), n, k, sms),
            MG.mma_gemv_split(mcfg, n, k, sms),
            mma,
        )
    rcfg = R.rega_config_for(m, n, k, group)
    if rcfg is not None and k % (2 * rcfg.block_k) == 0:

        def rega(split):
            return lambda x, w, config=None, out=None: R.w4a16_rega_gemm(x, w, out=out, config=rcfg, split=split)

        return rcfg.name, old_rega_split(rcfg, n, k, sms), R.rega_split(rcfg, n, k, sms), rega
    wcfg = WS.ws_config_for(m, group)
    if wcfg is not None and WS.ws_offered(wcfg, m, n, k, group, sms):

        def ws(split):
            return lambda x, w, config=None, out=None: WS.w4a16_ws_gemm(x, w, out=out, config=wcfg, split=split)

        return wcfg.name, old_ws_split(wcfg, m, n, k, group, sms), WS.ws_split(wcfg, m, n, k, group, sms), ws
    return None


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
        layer = None
        for m in map(int, ms.split(",")):
            plan = plans(m, n, k, args.group, sms)
            if plan is None or plan[1] == plan[2]:
                what = f"{plan[0]} split {plan[1]}" if plan else "neither kernel"
                print(f"{n}x{k} g{args.group} M={m}: rules agree ({what})")
                continue
            layer = layer or Layer(n, k, args.group, dev, seed=n + k)
            name, old, new, linear_for = plan
            fp16 = timer.per_call(fp16_calls(n, k, m, dev, gen))
            row = {"n": n, "k": k, "m": m, "group": args.group, "fp16_us": fp16, "config": name}
            line = f"{n}x{k} g{args.group} M={m} {name}: fp16 {fp16:.1f} us"
            for tag, split in (("old", old), ("new", new)):
                linear = linear_for(split)
                try:
                    ok = layer.check(m, None, linear=linear)["ok"] and check_bf16(layer, m, None, linear)
                    us = timer.per_call(layer.calls(m, None, linear=linear)) if ok else float("nan")
                except Exception as exc:  # a launch failure is reported, not fatal
                    ok, us = False, float("nan")
                    row[tag + "_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                row[tag] = {"split": split, "ok": ok, "us": us}
                line += f" | {tag} sk{split} {us:.1f} us {fp16 / us:.2f}x" + ("" if ok else " WRONG")
            rows.append(row)
            print(line, flush=True)
            if args.out:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "probe_split_ab.json").write_text(json.dumps(rows, indent=1))
        del layer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
