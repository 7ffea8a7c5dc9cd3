"""Probes of the M = 1 W4A16 gemv on a GPU (results/w4a16-h200-2026-12-02.md), correctness checked on every cell.

    python benchmarks/probes/probe_gemv.py [--out DIR] [--quick]   K-major variants (gemv_kmajor.py) vs the
                                                                     committed gemv and cuBLAS fp16
    python benchmarks/probes/probe_gemv.py --nmajor [--out DIR]     the committed gemv with its split-K factor
                                                                     forced to fill 1, 2 or 3 waves of CTAs
    python benchmarks/probes/probe_gemv.py --vector [--out DIR]     the committed M = 1 and M = 2 gemv against
                                                                     variants reading x 4 activations per load
    ncu --clock-control none --kernel-name regex:gemv --section ... python benchmarks/probes/ncu_gemv.py

Same timing method as bench_w4a16.py (CUDA graphs over rotated operands, medians, cuBLAS in the same run).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_w4a16
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gemv_kmajor
import gemv_kmajor as GK
from bench_w4a16 import Layer, Timer, copy_bandwidth, fp16_calls

SHAPES = [(28672, 8192), (8192, 28672), (8192, 8192), (14336, 4096), (4096, 14336), (4096, 4096)]
# (block_n, block_k, warps, split_waves, prefetch, xpair)
VARIANTS = [
    (64, 128, 4, 4, False, True),
    (64, 128, 4, 8, False, True),
    (64, 128, 4, 4, True, True),
    (64, 128, 4, 8, True, True),
    (64, 128, 4, 4, False, False),
    (128, 128, 4, 2, False, True),
    (128, 128, 4, 4, False, True),
    (128, 128, 4, 4, True, True),
    (128, 128, 8, 4, False, True),
    (128, 128, 8, 8, True, True),
    (256, 128, 8, 2, False, True),
    (256, 128, 8, 4, False, True),
    (32, 128, 4, 8, False, True),
    (32, 128, 2, 8, True, True),
]


def name(v) -> str:
    bn, bk, w, sw, pf, xp = v
    return f"k-n{bn}k{bk}w{w}sw{sw}{'p' if pf else ''}{'x' if xp else ''}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--groups", default="128,64")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--nmajor", action="store_true")
    ap.add_argument("--vector", action="store_true")
    args = ap.parse_args()
    if args.nmajor:
        return nmajor(args)
    if args.vector:
        return vector(args)
    dev = "cuda"
    timer = Timer(False)
    bw = copy_bandwidth(timer, dev)
    print(f"copy bandwidth {bw:.2f} TB/s", flush=True)
    rows = []
    gen = torch.Generator(device=dev).manual_seed(1)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for n, k in SHAPES[:2] if args.quick else SHAPES:
        fp16 = timer.per_call(fp16_calls(n, k, 1, dev, gen))
        for group in [int(g) for g in args.groups.split(",")]:
            layer = Layer(n, k, group, dev, seed=0)
            wb = layer.bytes
            base = timer.per_call(layer.calls(1, None))
            row = {"n": n, "k": k, "g": group, "fp16_us": fp16, "table_us": base, "variants": {}}
            qts = [GK.kmajor_words(w.qweight) for w in layer.weights]
            x0 = torch.randn(1, k, device=dev, generator=gen).half()
            ref = x0.double() @ layer.w64()
            torch_err = ((x0 @ layer.w64().half()).double() - ref).abs().max().item()
            for v in VARIANTS:
                bn, bk, w, sw, pf, xp = v
                kw = dict(block_n=bn, block_k=bk, num_warps=w, split_waves=sw, num_sms=sms, prefetch=pf, xpair=xp)
                w0 = layer.weights[0]
                y = GK.gemv_k(x0, qts[0], w0.qzeros, w0.scales, w0.group_size, w0.locks, **kw)
                err = (y.double() - ref).abs().max().item()
                ok = err <= 2 * torch_err + 2**-20 * ref.abs().max().item()
                xs = [torch.randn(1, k, device=dev, generator=gen).half() for _ in layer.weights]
                calls = [
                    (
                        lambda x=x, q=q, wt=wt, kw=kw: GK.gemv_k(
                            x, q, wt.qzeros, wt.scales, wt.group_size, wt.locks, **kw
                        )
                    )
                    for x, q, wt in zip(xs, qts, layer.weights, strict=True)
                ]
                us = timer.per_call(calls)
                row["variants"][name(v)] = {"us": us, "ok": ok, "err": err, "torch_err": torch_err}
            best = min(row["variants"].items(), key=lambda kv: kv[1]["us"])
            line = (
                f"{n}x{k} g{group}: fp16 {fp16:.1f} us, table gemv {base:.1f} us ({fp16 / base:.2f}x, "
                f"{wb / base / 1e6:.2f} TB/s), best k-major {best[0]} {best[1]['us']:.1f} us "
                f"({fp16 / best[1]['us']:.2f}x, {wb / best[1]['us'] / 1e6:.2f} TB/s)"
            )
            print(line, flush=True)
            for nm, r in row["variants"].items():
                print(
                    f"    {nm:<24} {r['us']:7.1f} us {fp16 / r['us']:5.2f}x {wb / r['us'] / 1e6:5.2f} TB/s ok={r['ok']}"
                )
            rows.append(row)
            del layer, qts
            torch.cuda.empty_cache()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe_gemv_k.json").write_text(json.dumps({"copy_tbs": bw, "rows": rows}, indent=1))


# -- N-major gemv with the split-K factor forced (wave filling) -------------------------------------------------------
def nmajor(args) -> None:
    from bench_w4a16 import Layer, Timer, fp16_calls
    from quantkit.kernels import w4a16_configs as C
    from quantkit.kernels import w4a16_gemv as G

    dev, timer = "cuda", Timer(False)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device=dev).manual_seed(1)
    real_plan = C.plan_launch
    forced = {}

    def plan(cfg, m, n, k, group, num_sms):
        p = real_plan(cfg, m, n, k, group, num_sms)
        if "split" not in forced:
            return p
        k_tiles = -(-k // p.block_k)
        tps = -(-k_tiles // forced["split"])
        split = -(-k_tiles // tps)
        return C.LaunchPlan(p.block_k, split, tps, (p.grid[0], split))

    G.plan_launch = plan
    configs = [
        C.KernelConfig("gemv", 1, 512, 128, 4, 1, split_waves=4, fold_zero=True),
        C.KernelConfig("gemv", 1, 256, 128, 2, 1, split_waves=4, fold_zero=True),
        C.KernelConfig("gemv", 1, 128, 128, 1, 1, split_waves=4, fold_zero=True),
    ]
    out = []
    for n, k in SHAPES:
        fp16 = timer.per_call(fp16_calls(n, k, 1, dev, gen))
        for group in (128, 64):
            layer = Layer(n, k, group, dev, seed=0)
            x = torch.randn(1, k, device=dev, generator=gen).half()
            line = [f"{n}x{k} g{group} fp16 {fp16:.1f}"]
            for cfg in configs:
                forced.clear()
                _, handle = G.w4a16_gemv(x, layer.weights[0], cfg)
                regs = handle.n_regs
                per_sm = min(65536 // (-(-regs * 32 // 256) * 256 * cfg.num_warps), 64 // cfg.num_warps, 32)
                slots = per_sm * sms
                p = real_plan(cfg, 1, n, k, group, sms)
                k_tiles = -(-k // p.block_k)
                tiles = p.grid[0]
                cands = {"default": None}
                for waves in (1, 2, 3):
                    s = max(1, min(k_tiles, waves * slots // tiles))
                    while s > 1 and tiles * (-(-k_tiles // (-(-k_tiles // s)))) > waves * slots:
                        s -= 1
                    cands[f"fill{waves}"] = s
                for label, s in cands.items():
                    forced.clear()
                    if s is not None:
                        forced["split"] = s
                    ok = layer.check(1, cfg)["ok"]
                    us = timer.per_call(layer.calls(1, cfg))
                    sp = plan(cfg, 1, n, k, group, sms).split_k
                    line.append(f"{cfg.name}/{label}(split {sp}, {tiles * sp}/{slots} CTAs) {us:.1f} us "
                                f"{fp16 / us:.2f}x{'' if ok else ' WRONG'}")  # fmt: skip
                    out.append({"n": n, "k": k, "g": group, "cfg": cfg.name, "label": label, "split": sp,
                                "slots": slots, "regs": regs, "us": us, "fp16_us": fp16, "ok": ok})  # fmt: skip
            print("\n    ".join(line), flush=True)
            del layer
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe_nmajor.json").write_text(json.dumps(out, indent=1))


# -- x read four activations per load (vector_x), against the committed table --------------------------------------
def vector(args) -> None:
    from quantkit.kernels import w4a16_configs as C

    g = C.KernelConfig
    variants = {
        1: [
            g("gemv", 1, 512, 128, 4, 1, split_waves=4, fold_zero=True, vector_x=True),
            g("gemv", 1, 512, 128, 4, 1, split_waves=8, fold_zero=True, vector_x=True),
            g("gemv", 1, 1024, 64, 4, 1, split_waves=4, fold_zero=True, vector_x=True),
            g("gemv", 1, 1024, 64, 4, 1, split_waves=8, fold_zero=True, vector_x=True),
            g("gemv", 1, 1024, 128, 4, 1, split_waves=4, fold_zero=True, vector_x=True),
            g("gemv", 1, 512, 64, 4, 1, split_waves=4, fold_zero=True, prefetch=True, vector_x=True),
            g("gemv", 1, 1024, 64, 4, 1, split_waves=4, fold_zero=True, prefetch=True, vector_x=True),
        ],
        2: [
            g("gemv", 2, 512, 64, 4, 1, split_waves=8, fold_zero=True, prefetch=True, vector_x=True),
            g("gemv", 2, 1024, 64, 4, 1, split_waves=8, fold_zero=True, vector_x=True),
        ],
    }
    dev, timer = "cuda", Timer(False)
    gen = torch.Generator(device=dev).manual_seed(1)
    out = []
    for n, k in SHAPES:
        for m, cands in variants.items():
            fp16 = timer.per_call(fp16_calls(n, k, m, dev, gen))
            for group in (128, 64):
                layer = Layer(n, k, group, dev, seed=0)
                table = C.config_for(m)
                line = [f"{n}x{k} g{group} M={m} fp16 {fp16:.1f} us"]
                for cfg in [table, *cands]:
                    ok = layer.check(m, cfg)["ok"]
                    us = timer.per_call(layer.calls(m, cfg))
                    tag = "table " if cfg is table else ""
                    line.append(f"{tag}{cfg.name:<28} {us:7.1f} us {fp16 / us:5.2f}x {layer.bytes / us / 1e6:5.2f} TB/s"
                                f"{'' if ok else ' WRONG'}")  # fmt: skip
                    out.append({"n": n, "k": k, "g": group, "m": m, "cfg": cfg.name, "table": cfg is table,
                                "us": us, "fp16_us": fp16, "ok": ok})  # fmt: skip
                print("\n    ".join(line), flush=True)
                del layer
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe_vector.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
