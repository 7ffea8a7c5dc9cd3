"""Probe: launch parameters of the runtime's small per-layer kernels at decode sizes (H200).

    python benchmarks/probes/probe_small_kernels.py [--out DIR] [--rows 1,64]

Llama-3-8B shapes (hidden 4096, intermediate 14336, 32 query / 8 kv heads of 128), bf16: ``add_rms_norm`` (with
residual), ``silu_mul``, ``rotary_store_`` (on the fused q/k/v projection's views) and ``paged_decode`` (context 384,
block tables of a 2048-token max length). Each variant: microseconds per call of a CUDA graph of 50 back-to-back
calls on the same operands (``graph_timing.seconds_per_call``; in a decode step these kernels read what the kernel
before them wrote, so from L2), median of ``do_bench``; each variant's output checked against the default's first.
Prints a table per kernel and saves ``small_kernels.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # graph_timing
from graph_timing import seconds_per_call
from quantkit.kernels import fused_norm_rope as K
from quantkit.kernels.paged_attention import default_num_splits, paged_decode

HIDDEN, INTER, HQ, HKV, D, PAGE, MAX_LEN, CTX = 4096, 14336, 32, 8, 128, 16, 2048, 384


def time_us(fn) -> float:
    return seconds_per_call([fn] * 50, smoke=False, warmup_ms=25, rep_ms=100) * 1e6


def sweep(name: str, variants: dict, run, check) -> list[dict]:
    """``run(**variant)`` -> output; the first variant is the default, the others are checked against it."""
    rows, ref = [], None
    for label, kw in variants.items():
        out = run(**kw)
        torch.cuda.synchronize()
        ok = True if ref is None else check(out, ref)
        ref = out if ref is None else ref
        us = time_us(lambda kw=kw: run(**kw)) if ok else float("nan")
        rows.append({"kernel": name, "variant": label, "us": us, "ok": ok})
        print(f"{name:28} {label:32} {us:7.2f} us {'' if ok else 'WRONG'}", flush=True)
    return rows


def sweep_rows(t: int) -> list[dict]:
    """Every kernel's variants at T = t rows (decode batch t)."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    same = torch.equal
    x, r = torch.randn(t, HIDDEN, device=dev, dtype=dt), torch.randn(t, HIDDEN, device=dev, dtype=dt)
    w = torch.rand(HIDDEN, device=dev, dtype=dt) + 0.5
    norm = {"default": {}} | {f"warps{n}": {"num_warps": n} for n in (1, 2, 4, 8, 16)}
    rows += sweep(f"add_rms_norm T={t}", norm, lambda **kw: K.add_rms_norm(x, w, 1e-5, r, **kw)[0], same)

    gu = torch.randn(t, 2 * INTER, device=dev, dtype=dt)
    g, u = gu.split(INTER, dim=-1)
    silu = {"default": {}} | {f"block{b}w{n}": {"block": b, "num_warps": n}
                              for b, n in ((512, 2), (512, 4), (1024, 2), (1024, 4), (2048, 8), (4096, 8),
                                           (4096, 16), (16384, 16))}  # fmt: skip
    rows += sweep(f"silu_mul T={t}", silu, lambda **kw: K.silu_mul(g, u, **kw), same)

    qkv = torch.randn(t, (HQ + 2 * HKV) * D, device=dev, dtype=dt)
    q, k, v = (a.view(t, -1, D) for a in qkv.split([HQ * D, HKV * D, HKV * D], dim=-1))
    angle = torch.rand(t, D // 2, device=dev) * 6
    cos = torch.cat((angle.cos(), angle.cos()), -1).to(dt)
    sin = torch.cat((angle.sin(), angle.sin()), -1).to(dt)
    kc = torch.zeros(4 * t + 8, PAGE, HKV, D, device=dev, dtype=dt)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(kc.shape[0] * PAGE, device=dev)[:t].to(torch.int32)
    base = qkv.clone()

    def rotary(**kw):  # from the same input every call (the kernel rotates in place)
        qkv.copy_(base)
        K.rotary_store_(q, k, v, cos, sin, kc, vc, slots, **kw)
        return qkv.clone(), kc.clone(), vc.clone()

    def rotary_only(**kw):
        K.rotary_store_(q, k, v, cos, sin, kc, vc, slots, **kw)

    rot = {"default": {}} | {f"bh{b}w{n}": {"block_h": b, "num_warps": n}
                             for b, n in ((2, 1), (4, 1), (4, 2), (8, 2), (8, 4), (16, 2), (16, 8), (64, 4),
                                          (64, 8))}  # fmt: skip
    ref = None
    for label, kw in rot.items():
        out = rotary(**kw)
        ok = ref is None or all(torch.equal(a, b) for a, b in zip(out, ref, strict=True))
        ref = ref or out
        us = time_us(lambda kw=kw: rotary_only(**kw)) if ok else float("nan")
        rows.append({"kernel": f"rotary_store_ T={t}", "variant": label, "us": us, "ok": ok})
        print(f"{'rotary_store_ T=' + str(t):28} {label:32} {us:7.2f} us {'' if ok else 'WRONG'}", flush=True)

    pages = MAX_LEN // PAGE
    kcache = torch.randn(t * pages + 1, PAGE, HKV, D, device=dev, dtype=dt)
    vcache = torch.randn_like(kcache)
    tables = torch.arange(t * pages, device=dev, dtype=torch.int32).view(t, pages)
    ctx = torch.full((t,), CTX, device=dev, dtype=torch.int32)
    qd = torch.randn(t, HQ, D, device=dev, dtype=dt)
    default_splits = default_num_splits(t, HKV, MAX_LEN)
    dec = {f"default(s{default_splits})": {"num_splits": default_splits}}
    for s in sorted({1, 2, 4, default_splits, 8}):
        for bn in (16, 32, 64):
            for nw in (1, 2, 4):
                dec[f"s{s}n{bn}w{nw}"] = {"num_splits": s, "block_n": bn, "num_warps": nw}
    rows += sweep(
        f"paged_decode B={t} ctx={CTX}",
        dec,
        lambda **kw: paged_decode(qd, kcache, vcache, tables, ctx, D**-0.5, **kw),
        lambda a, b: torch.allclose(a.float(), b.float(), atol=2e-2, rtol=0),
    )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    ap.add_argument("--rows", default="1,64")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    rows = []
    for t in (int(r) for r in args.rows.split(",")):
        rows += sweep_rows(t)
        (args.out / "small_kernels.json").write_text(json.dumps(rows, indent=1))
    print("\nbest per kernel (us: default -> best)")
    for kernel in dict.fromkeys(r["kernel"] for r in rows):
        rs = [r for r in rows if r["kernel"] == kernel and r["ok"]]
        best = min(rs, key=lambda r: r["us"])
        print(f"{kernel:28} {rs[0]['us']:6.2f} -> {best['us']:6.2f}  {best['variant']}")


if __name__ == "__main__":
    main()
