"""One launch each of the prefill attention kernel and of SDPA at L = 1k x 16 (bench_attention.py's first case),
inside an NVTX range, for Nsight Compute: where did the 64 x 64 default lose ~20% to SDPA? (2026-12-03: its L2 hit
rate was 57% against cuDNN's 79%; the sequence-major grid that followed raised it to 87%,
results/attention-h200-2026-12-03-seqmajor.md)

    ncu --clock-control none --nvtx --nvtx-include "profile/" --section SpeedOfLight ... \\
        python benchmarks/probes/ncu_prefill.py [ours|sdpa|both] [bm,bn,warps,stages ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_attention
from bench_attention import HKV, HQ, D, first_prefills
from quantkit.kernels.flash_prefill import flash_prefill

WHAT = sys.argv[1] if len(sys.argv) > 1 else "both"
CONFIGS = [tuple(int(v) for v in a.split(",")) for a in sys.argv[2:]] or [(64, 64, 4, 3)]
LENGTH, N_SEQ = 1024, 16

gen = torch.Generator().manual_seed(0)
q, kp, vp, k, v, tables, cu, ctx = first_prefills(LENGTH, N_SEQ, HQ, HKV, D, torch.bfloat16, "cuda", gen)
qs = q.view(N_SEQ, LENGTH, HQ, D).transpose(1, 2)
kc = kp.view(N_SEQ, LENGTH, HKV, D).transpose(1, 2).contiguous()
vc = vp.view(N_SEQ, LENGTH, HKV, D).transpose(1, 2).contiguous()


def ours(bm, bn, warps, stages):
    return flash_prefill(q, kp, vp, k, v, tables, cu, ctx, LENGTH, D**-0.5, block_m=bm, block_n=bn,
                         num_warps=warps, num_stages=stages, use_tma=True, has_prefix=False)  # fmt: skip


def sdpa():
    return F.scaled_dot_product_attention(qs, kc, vc, is_causal=True, enable_gqa=True)


calls = ([lambda c=c: ours(*c) for c in CONFIGS] if WHAT in ("ours", "both") else []) + (
    [sdpa] if WHAT in ("sdpa", "both") else []
)
for fn in calls:  # compile and warm up outside the range
    fn()
    fn()
torch.cuda.synchronize()
torch.cuda.nvtx.range_push("profile")
for fn in calls:
    fn()
torch.cuda.synchronize()
torch.cuda.nvtx.range_pop()
print("profiled", WHAT, CONFIGS)
