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

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_w4a16
sys.path.insert(0, str(Path(__file__).resolve().parent))  # probe_mma_gemv
from probe_mma_rule_ab import ab_walk
from quantkit.kernels import w4a16_mma_gemv as MG
from quantkit.kernels import w4a16_rega as R
from quantkit.kernels import w4a16_ws as WS

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


def plans(n: int, k: int, group: int, sms: int, m: int) -> list | str:
    """The kernel the dispatcher would run at the old rule's split and at the committed rule's, as ``ab_walk``
    variants, or why the cell is skipped."""
    mcfg = MG.mma_config_for(n, k, group, sms, m) if m <= MG.MMA_DISPATCH_M else None
    rcfg = R.rega_config_for(m, n, k, group)
    wcfg = WS.ws_config_for(m, group)
    if mcfg is not None:
        name, old, new = (
            mcfg.name,
            MG.mma_gemv_split(replace(mcfg, uneven=False), n, k, sms),
            MG.mma_gemv_split(mcfg, n, k, sms),
        )

        def linear(split):
            return lambda x, w, config=None, out=None: MG.w4a16_mma_gemv(x, w, out=out, config=mcfg, split=split)
    elif rcfg is not None and k % (2 * rcfg.block_k) == 0:
        name, old, new = rcfg.name, old_rega_split(rcfg, n, k, sms), R.rega_split(rcfg, n, k, sms)

        def linear(split):
            return lambda x, w, config=None, out=None: R.w4a16_rega_gemm(x, w, out=out, config=rcfg, split=split)
    elif wcfg is not None and WS.ws_offered(wcfg, m, n, k, group, sms):
        name, old, new = wcfg.name, old_ws_split(wcfg, m, n, k, group, sms), WS.ws_split(wcfg, m, n, k, group, sms)

        def linear(split):
            return lambda x, w, config=None, out=None: WS.w4a16_ws_gemm(x, w, out=out, config=wcfg, split=split)
    else:
        return "neither kernel"
    if old == new:
        return f"rules agree ({name} split {old})"
    return [("old", name, old, linear(old)), ("new", name, new, linear(new))]


if __name__ == "__main__":
    ab_walk(CELLS, plans, "probe_split_ab.json")
