"""Probe: split-K in the W8A8 pointer kernel for decode-sized products, end to end (quantizer + GEMM under PDL).

    python benchmarks/probes/probe_split_k.py [--out DIR] [--ms 1,16,32,64] [--fmts int8,fp8]

Why: a 4096-wide layer at M <= 64 has 64-128 output tiles for 132 SMs, so each program streams a long K loop
(458 KB of weight at K = 14336) with a few stages in flight, and the narrow layers are where int8 falls short of
1.6x bf16 (4096 x 4096 1.16-1.29x, 4096 x 14336 1.31-1.44x). ``split_k`` gives each tile several programs along K
and sums their partials in split order (``_split_fixup``). Variants, in one run: ``base`` (the committed config,
split_k=1), ``rule`` (the committed config, ``split_k_for``), then pointer configs with fixed splits. Outputs are
compared bit for bit with ``base`` (int8: exact; fp8: partial sums in another order may differ in the last bit).
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_w8a8
import bench_w8a8 as B8
from quantkit.kernels import w8a8 as W

POINTER = {  # regime -> pointer configs tried with fixed splits
    "m16": [(16, 32, 256, 1, 0, 4, 6), (16, 64, 256, 1, 0, 4, 4)],
    "m64": [(64, 64, 256, 1, 0, 4, 4), (64, 32, 256, 1, 0, 4, 6)],
}
SPLITS = (2, 4)


def linear(x, wq, ws, fmt, config, split_k):
    pdl = W.use_pdl(x)
    qa, sa = W.quantize_activations(x, fmt, pdl=pdl)
    return W.w8a8_matmul(qa, sa, wq, ws, out_dtype=x.dtype, config=config, pdl=pdl,
                         prefetch_k=W.PDL_PREFETCH_K if pdl else 0, split_k=split_k)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    ap.add_argument("--ms", default="1,16,32,64")
    ap.add_argument("--fmts", default="int8,fp8")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "probe_split_k.json"
    timer, rows = B8.Timer(False, 10, 40), []
    for n, k in B8.SHAPES:
        for m in map(int, args.ms.split(",")):
            p = B8.Problem(n, k, m, "cuda", seed=0)
            bf16 = timer.per_call([partial(F.linear, p.x[i], p.w16[i]) for i in range(p.r)]) * 1e6
            for fmt in args.fmts.split(","):
                row = {"n": n, "k": k, "m": m, "fmt": fmt, "bf16_us": bf16}
                committed = W.pick_config(m, fmt, n=n)
                variants = {"base": (committed, 1), "rule": (committed, None)}
                for cand in POINTER[W.m_regime(m)]:
                    for s in SPLITS:
                        variants["_".join(map(str, cand)) + f"_s{s}"] = (dict(zip(W.CONFIG_KEYS, cand, strict=True)), s)
                line, want = f"{fmt} {n}x{k} M={m}: bf16 {bf16:.1f}", None
                for name, (cfg, s) in variants.items():
                    calls = [partial(linear, p.x[i], p.wq[fmt][i], p.w_scale[fmt][i], fmt, cfg, s) for i in range(p.r)]
                    try:
                        y = calls[0]()
                        want = y if want is None else want
                        exact = torch.equal(y, want)
                        us = timer.per_call(calls) * 1e6
                    except Exception as e:  # a candidate that fails must not end the probe
                        print(f"  {name}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                        exact, us = False, float("nan")
                    row[name] = {"us": us, "exact": exact}
                    line += f" | {name} {bf16 / us:.2f}" + ("" if exact else "*")
                print(line, flush=True)
                rows.append(row)
                out.write_text(json.dumps(rows, indent=1))
            del p
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
