"""One launch each of the committed M = 1 gemv and K-major variants on 28672 x 8192 g128, for ``ncu``.

ncu --clock-control none --kernel-name regex:gemv --section SpeedOfLight ... python benchmarks/probes/ncu_gemv.py \\
        [bn,bk,warps,split_waves,prefetch,xpair ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_w4a16
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gemv_kmajor
import gemv_kmajor as GK
from bench_w4a16 import random_weight
from quantkit.kernels import w4a16 as K

VARIANTS = [a.split(",") for a in sys.argv[1:]] or [["64", "128", "4", "4", "0", "1"]]
gen = torch.Generator(device="cuda").manual_seed(0)
w = random_weight(28672, 8192, 128, "cuda", gen)
x = torch.randn(1, 8192, device="cuda", generator=gen).half()
K.w4a16_linear(x, w)
qt = GK.kmajor_words(w.qweight)
for bn, bk, nw, sw, pf, xp in VARIANTS:
    GK.gemv_k(x, qt, w.qzeros, w.scales, w.group_size, w.locks, block_n=int(bn), block_k=int(bk),
              num_warps=int(nw), split_waves=int(sw), prefetch=pf == "1", xpair=xp == "1")  # fmt: skip
torch.cuda.synchronize()
