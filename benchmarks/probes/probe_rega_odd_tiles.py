"""Probe: layers whose K is an odd number of 128-deep tiles (Qwen2.5-72B's down projection, 8192 x 29568 = 231
tiles; Qwen2.5-0.5B's K = 896 = 7) at M 17-128, where the register-A kernel now takes the last pair's phantom tile,
against what served those rows before it could (the Triton tiles of the regime table, or the warp-specialized
kernel at M 65-128 where its rule offers it).

    python benchmarks/probes/probe_rega_odd_tiles.py [--out DIR] [--cells "8192x29568:32,64,128"] [--group 128]

Each variant checked against float64 (fp16 and bf16) and timed as bench_w4a16.py times; ``probe_rega_odd_tiles.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_w4a16
sys.path.insert(0, str(Path(__file__).resolve().parent))  # probe_mma_gemv
from probe_mma_rule_ab import ab_walk
from quantkit.kernels import w4a16 as K
from quantkit.kernels import w4a16_rega as R
from quantkit.kernels import w4a16_ws as WS

CELLS = "8192x29568:17,32,48,64,96,128;9728x896:32,128;1152x896:64"


def variants(n: int, k: int, group: int, sms: int, m: int) -> list | str:
    """The previous path (Triton table, or the warp-specialized kernel where offered) and the register-A kernel."""
    rcfg = R._rega_config(m, n, k, group)  # the rule without its odd-tile weight bound (which these cells set)
    if rcfg is None or k % (2 * rcfg.block_k) == 0:
        return "not an odd-tile register-A cell"
    wcfg = WS.ws_config_for(m, group)
    if wcfg is not None and WS.ws_offered(wcfg, m, n, k, group, sms):
        wsplit = WS.ws_split(wcfg, m, n, k, group, sms)

        def previous(x, w, config=None, out=None):
            return WS.w4a16_ws_gemm(x, w, out=out, config=wcfg, split=wsplit)

        old = ("old", wcfg.name, wsplit, previous)
    else:
        tcfg = K.config_for(m, n)

        def previous(x, w, config=None, out=None):
            return K.w4a16_linear(x, w, config=tcfg, out=out)

        old = ("old", tcfg.name, 1, previous)
    split = R.rega_split(rcfg, n, k, sms)

    def register_a(x, w, config=None, out=None):
        return R.w4a16_rega_gemm(x, w, out=out, config=rcfg, split=split)

    new = ("new", rcfg.name, split, register_a)
    return [old, new]


if __name__ == "__main__":
    ab_walk(CELLS, variants, "probe_rega_odd_tiles.json")
