"""Probe: static per-tensor activations quantized inside the W8A8 GEMM, against the two-kernel static path.

    python benchmarks/probes/probe_static_fused.py [--out DIR] [--ms 1,16,64] [--fmts int8,fp8]

Why: at M 16-64 the GEMM is bound by its weight reads, and the activation quantizer's own launch and pass (2.5-5 us,
partly hidden by programmatic dependent launch) are a fixed cost that keeps int8 at 1.45-1.48x bf16 against the
issue's 1.6x. With a calibrated static scale no reduction over the row is needed, so each program of the GEMM can
quantize its x tiles in registers (``w8a8_static_matmul``) and no second kernel runs.

Each point, end to end from bf16 x, timed as bench_w8a8.py times (CUDA graphs over rotated operands, L2 flushed,
medians): bf16 cuBLAS; ``dynamic``: the committed per-token path; ``static2``: static quantizer + GEMM (the
committed static path before this probe, PDL as ``use_pdl``); then the fused kernel under each candidate config.
Every fused output is compared bit for bit with ``static2`` run under the same config.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_w8a8
import bench_w8a8 as B8
from quantkit.kernels import w8a8 as W

CANDIDATES = {  # CONFIG_KEYS tuples, pointer kernel (USE_TMA 0)
    "m16": [
        (16, 32, 256, 1, 0, 4, 6),
        (16, 32, 256, 1, 0, 4, 4),
        (16, 64, 256, 1, 0, 4, 4),
        (16, 64, 128, 1, 0, 4, 6),
        (16, 128, 128, 1, 0, 4, 4),
        (16, 32, 512, 1, 0, 4, 3),
        (16, 64, 256, 1, 0, 8, 4),
    ],
    "m64": [
        (64, 64, 256, 1, 0, 4, 4),
        (64, 64, 128, 1, 0, 4, 6),
        (64, 128, 128, 1, 0, 4, 4),
        (64, 128, 256, 1, 0, 8, 3),
        (32, 64, 256, 2, 0, 4, 4),
        (64, 32, 256, 1, 0, 4, 5),
        (64, 128, 128, 1, 0, 8, 4),
    ],
}


def static_scale(x: torch.Tensor, fmt: str) -> torch.Tensor:
    return (x.float().abs().amax() / W.QMAX_OF_FORMAT[fmt]).reshape(1)


def variants(p: B8.Problem, fmt: str, scales: list[torch.Tensor]) -> dict[str, list]:
    """name -> one call per rotation: the dynamic path, the two-kernel static path, the fused candidates."""
    wq, ws, r = p.wq[fmt], p.w_scale[fmt], range(p.r)
    timed = {
        "dynamic": [lambda i=i: W.w8a8_linear(p.x[i], wq[i], ws[i]) for i in r],
        "static2": [lambda i=i: W.w8a8_linear(p.x[i], wq[i], ws[i], None, scales[i], pdl=W.use_pdl(p.x[i])) for i in r],
    }
    for cand in CANDIDATES[W.m_regime(min(p.m, W.FUSED_STATIC_MAX_M))]:
        cfg = dict(zip(W.CONFIG_KEYS, cand, strict=True))
        timed["fused" + "_".join(map(str, cand))] = [
            (lambda i=i, cfg=cfg: W.w8a8_static_matmul(p.x[i], scales[i], wq[i], ws[i], config=cfg)) for i in r
        ]
    return timed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    ap.add_argument("--ms", default="1,16,64")
    ap.add_argument("--fmts", default="int8,fp8")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "probe_static_fused.json"
    timer, rows = B8.Timer(False, 10, 40), []
    for n, k in B8.SHAPES:
        for m in map(int, args.ms.split(",")):
            p = B8.Problem(n, k, m, "cuda", seed=0)
            bf16 = timer.per_call([(lambda i=i, p=p: F.linear(p.x[i], p.w16[i])) for i in range(p.r)]) * 1e6
            for fmt in args.fmts.split(","):
                scales = [static_scale(x, fmt) for x in p.x]
                wq, ws = p.wq[fmt], p.w_scale[fmt]
                row = {"n": n, "k": k, "m": m, "fmt": fmt, "bf16_us": bf16}
                line = f"{fmt} {n}x{k} M={m}: bf16 {bf16:.1f}"
                timed = variants(p, fmt, scales)
                for name, calls in timed.items():
                    try:
                        y = calls[0]()
                        exact = True
                        if name.startswith("fused"):
                            cfg = dict(zip(W.CONFIG_KEYS, map(int, name[5:].split("_")), strict=True))
                            qa, sa = W.quantize_activations(p.x[0], fmt, scales[0])
                            exact = torch.equal(y, W.w8a8_matmul(qa, sa, wq[0], ws[0], out_dtype=y.dtype, config=cfg))
                        us = timer.per_call(calls) * 1e6
                    except Exception as e:  # a candidate that fails to compile must not end the probe
                        print(f"  {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                        exact, us = False, float("nan")
                    row[name] = {"us": us, "exact": exact}
                    line += f" | {name} {bf16 / us:.2f}x" + ("" if exact else " WRONG")
                print(line, flush=True)
                rows.append(row)
                out.write_text(json.dumps(rows, indent=1))
            del p
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
