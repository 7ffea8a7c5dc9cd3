"""The fused MoE layer (``quantkit.kernels.moe``) alone against a plain loop over experts, on one GPU.

One MoE layer's routed experts from router logits to the layer output [M, H] (the router linear and shared experts
left out: the same for every variant), bf16 activations, timed in the same run:

  loop       the runtime's CPU path on the GPU: softmax top-k, pairs sorted by expert, one cuBLAS gate/up and down
             per expert that received tokens (bf16 weights), index_add back. It reads its expert counts on the host,
             so it cannot be captured: timed eagerly (``do_bench``, median), as it runs. The baseline of every ratio.
  bf16       routed_moe on bf16 experts (ours): route_and_align (one launch up to 16 tokens), fused_moe; the
             decode path (GEMV programs, ``kernels/moe/decode.py``) up to DECODE_MAX_TOKENS, the tile path above
  w4a16      the same on 4-bit experts, groups of 128 (the W4A16 kernel layout, stacked)
  bf16 tile, w4a16 tile  where the default is the decode path: the tile path on the same layer (``moe_config``'s
             tiles); bf16 decode, w4a16 decode: above DECODE_MAX_TOKENS up to M = 64, the decode path; both to
             compare the two paths (and place the threshold) in the same run
  fp8_block  the same on block-fp8 experts, B = 128 (DeepSeek-V3's layout, stacked; activations quantized per tile)
  dense      a bf16 dense SiLU MLP of the active parameters (width k * I): what the routed work costs without routing
  routing    route_and_align alone (part of every fused figure): the share of the layer that is not GEMM

The fused variants and dense run in a CUDA graph replayed under ``do_bench`` (median; L2 flushed before each replay;
the experts of one layer span far more than the L2, so one copy of the operands suffices). ``GB/s`` is the bytes of
the experts the routing chose (all of them once M is large) over the time, and ``of copy`` that figure as a fraction
of the device's copy bandwidth measured in the same run (the issue's batch-1 target: >= 70% in bf16 and W4A16).
Every fused output is checked against ``fused_moe_reference`` first (at most 4 ulps of the output's largest value).

Shapes: Qwen3-30B-A3B (H 2048, I 768, 128 experts, top 8) and Mixtral-8x7B (H 4096, I 14336, 8 experts, top 2),
from ``quantkit.runtime.bench.DUMMY_MODELS``; M in {1, 16, 64, 256, 1024, 4096} tokens.

  python benchmarks/bench_moe.py [--out DIR]          both shapes, every M
  python benchmarks/bench_moe.py --quick              M in {1, 64, 1024}
  python benchmarks/bench_moe.py --ms 1,16            the given M (here: the decode path against the tile path)
  python benchmarks/bench_moe.py --sweep              tile candidates per (shape, format, M), each checked against
                                                      the reference and timed; the best printed with its share of
                                                      copy bandwidth and written as TUNED_CONFIGS entries
                                                      (moe_sweep.py, for kernels/moe/configs.py); routing as one
                                                      launch against two. Where the decode path is the
                                                      default (bf16, w4a16), its variants are timed first (their
                                                      best printed as a comment). --sweep-budget (s) bounds it.
  TRITON_INTERPRET=1 python benchmarks/bench_moe.py --smoke   CPU plumbing check: a tiny layer, wall clock
Writes moe.json and moe.md (--sweep: moe_sweep.json and moe_sweep.py) under --out (default out/moe).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from common import Timer, add_out_argument, copy_bandwidth, environment, kernel_device, median_seconds, out_folder
from quantkit.kernels import moe as M
from quantkit.kernels.moe.experts import ExpertWeights
from quantkit.kernels.w4a16.weight import W4A16Weight

from quantkit.runtime.bench import DUMMY_MODELS

QWEN, MIXTRAL = DUMMY_MODELS["qwen3-30b-a3b"], DUMMY_MODELS["mixtral-8x7b"]
SHAPES = {  # name: (H, I, experts, top-k)
    "qwen3-30b-a3b": (QWEN["hidden_size"], QWEN["moe_intermediate_size"], QWEN["num_experts"], 8),
    "mixtral-8x7b": (MIXTRAL["hidden_size"], MIXTRAL["intermediate_size"], MIXTRAL["num_local_experts"], 2),
}
MS = [1, 16, 64, 256, 1024, 4096]
QUICK_MS = [1, 64, 1024]
SMOKE_SHAPES = {"tiny": (64, 32, 8, 2)}
SMOKE_MS = [1, 5]
FORMATS = ["bf16", "w4a16", "fp8_block"]
COMPARE_FORMATS = ["bf16", "w4a16"]  # timed on both paths up to COMPARE_MAX_M
GROUP, BLOCK = 128, 128


def expert_weights(fmt: str, n: int, k: int, e: int, dev: str, g: torch.Generator) -> ExpertWeights:
    """Random experts [E, N, K] in ``fmt``: bf16 N(0, 0.02); 4-bit codes, zeros and scales ~0.002 (groups of
    GROUP, one group where K is shorter); e4m3 codes of N(0, 1) with block scales ~0.02 (B = BLOCK)."""
    if fmt == "bf16":
        return ExpertWeights("float", torch.randn(e, n, k, device=dev, generator=g).mul_(0.02).bfloat16(), k, n)
    if fmt == "w4a16":
        group = GROUP if k > GROUP else 0
        n_g = k // GROUP if group else 1

        def words(*shape: int) -> torch.Tensor:  # random 32-bit patterns: eight random 4-bit codes each
            return torch.randint(-(2**31), 2**31, shape, device=dev, generator=g, dtype=torch.int64).int()

        qw = [W4A16Weight(words(k // 8, n), words(n_g, n // 8),
                          (torch.rand(n_g, n, device=dev, generator=g) * 0.004).half(), 4, group, k, n)
              for _ in range(e)]  # fmt: skip
        return ExpertWeights.from_w4a16(qw)
    codes = torch.randn(e, n, k, device=dev, generator=g).to(torch.float8_e4m3fn)
    scales = torch.rand(e, -(-n // BLOCK), -(-k // BLOCK), device=dev, generator=g) * 0.02
    return ExpertWeights("fp8_block", codes, k, n, scales, group_size=BLOCK)


def loop_layer(x, logits, w13, w2, top_k):
    """The plain implementation: route, sort pairs by expert, one cuBLAS pass per expert with tokens."""
    weights, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    order = torch.argsort(ids.flatten(), stable=True)
    token = order // top_k
    counts = torch.bincount(ids.flatten(), minlength=w13.shape[0]).tolist()
    xs = x[token]
    ys = torch.empty_like(xs)
    start = 0
    for e, cnt in enumerate(counts):
        if cnt:
            g, u = F.linear(xs[start : start + cnt], w13[e]).chunk(2, dim=-1)
            ys[start : start + cnt] = F.linear(F.silu(g) * u, w2[e])
            start += cnt
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, token, ys.float() * weights.flatten()[order, None])
    return out.to(x.dtype)


def dense_mlp(x, w13, w2):
    g, u = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(g) * u, w2)


KERNEL_FORMAT = {"bf16": "float", "w4a16": "w4a16", "fp8_block": "fp8_block"}  # bench name -> ExpertWeights.fmt


def block_m(m: int, shape: tuple, fmt: str = "bf16") -> int:
    """The BLOCK_M ``routed_moe`` aligns the pairs to for m tokens (the decode path's or the tile path's)."""
    h, inter, e, k = shape
    return M.layer_config(m, k, e, KERNEL_FORMAT[fmt], h, inter, None)["BLOCK_M"]


COMPARE_MAX_M = 64  # up to this M, bf16 and w4a16 are also timed on the path the default does not take


def other_path(m: int, shape: tuple, fmt: str) -> tuple[str, dict[str, int]] | None:
    """(column, config) of the path m tokens do not take by default (the tile path where the default is the decode
    path, the decode path up to COMPARE_MAX_M above it), None where there is nothing to compare."""
    h, inter, e, k = shape
    kfmt = KERNEL_FORMAT[fmt]
    if M.layer_config(m, k, e, kfmt, h, inter, None)["DECODE"]:
        return f"{fmt} tile", {**M.moe_config(m, k, e, kfmt, h, inter), "DECODE": 0}
    if m <= COMPARE_MAX_M:
        return f"{fmt} decode", M.decode_config(m, k, e)
    return None


def fused_layer(x, logits, w13, w2, top_k, config=None):
    return M.routed_moe(x, logits, w13, w2, top_k, config=config)


def expert_bytes(w: ExpertWeights) -> int:
    """Bytes one expert of ``w`` occupies (codes, scales and zeros)."""
    tensors = [t for t in (w.weight, w.scales, w.qzeros) if t is not None]
    return sum(t[0].numel() * t.element_size() for t in tensors)


def run_shape(name, shape, ms, timer, dev, copy_bw, smoke) -> list[dict]:
    h, inter, e, k = shape
    g = torch.Generator(device=dev).manual_seed(0)
    bf16 = [expert_weights("bf16", 2 * inter, h, e, dev, g), expert_weights("bf16", h, inter, e, dev, g)]
    experts = {"bf16": bf16}
    for fmt in FORMATS[1:]:
        experts[fmt] = [expert_weights(fmt, 2 * inter, h, e, dev, g), expert_weights(fmt, h, inter, e, dev, g)]
    dense13 = torch.randn(2 * k * inter, h, device=dev, generator=g).mul_(0.02).bfloat16()
    dense2 = torch.randn(h, k * inter, device=dev, generator=g).mul_(0.02).bfloat16()
    rows = []
    for m in ms:
        x = torch.randn(m, h, device=dev, generator=g).bfloat16()
        logits = torch.randn(m, e, device=dev, generator=g).bfloat16()
        chosen = M.route(logits, k)[1].unique().numel()
        loop = lambda x=x, logits=logits: loop_layer(x, logits, bf16[0].weight, bf16[1].weight, k)
        loop_us = median_seconds(loop, smoke=smoke) * 1e6
        row = {"shape": name, "m": m, "experts_read": chosen, "loop_us": loop_us}
        row["dense_us"] = timer.per_call([lambda x=x: dense_mlp(x, dense13, dense2)])
        bm = block_m(m, shape)
        row["routing_us"] = timer.per_call([lambda logits=logits, bm=bm: M.route_and_align(logits, k, bm)])
        variants = [(fmt, fmt, None) for fmt in FORMATS]
        variants += [(o[0], fmt, o[1]) for fmt in COMPARE_FORMATS if (o := other_path(m, shape, fmt))]
        for col, fmt, cfg in variants:
            w13, w2 = experts[fmt]
            weights, ids = M.route(logits, k)
            y = M.fused_moe(x, w13, w2, weights, ids, config=cfg)
            ref = M.fused_moe_reference(x, w13, w2, weights, ids)
            err = (y.float() - ref.float()).abs().max().item()
            ok = err <= 4 * torch.finfo(torch.bfloat16).eps * ref.float().abs().max().item()
            us = timer.per_call([lambda x=x, logits=logits, w13=w13, w2=w2, cfg=cfg:
                                 fused_layer(x, logits, w13, w2, k, cfg)])  # fmt: skip
            gbs = chosen * (expert_bytes(w13) + expert_bytes(w2)) / us / 1e3
            row[col] = {"us": us, "speedup": loop_us / us, "gbs": gbs, "of_copy": gbs * 1e9 / copy_bw, "ok": ok,
                        "err": err}  # fmt: skip
        rows.append(row)
        cells = "  ".join(f"{f} {row[f]['us']:.1f} us {row[f]['speedup']:.2f}x {100 * row[f]['of_copy']:.0f}%"
                          f"{'' if row[f]['ok'] else ' WRONG'}" for f in columns([row]))  # fmt: skip
        print(f"{name} M={m}: loop {loop_us:.1f} us, dense {row['dense_us']:.1f} us, routing + align "
              f"{row['routing_us']:.1f} us | {cells}", flush=True)  # fmt: skip
    return rows


# -- tile sweep ------------------------------------------------------------------------------------------------


def tile(bm: int, bn: int, bk: int, warps: int, stages: int, swap: bool = False, scale_tile: bool = False):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages,
            "SWAP_AB": int(swap), "SCALE_TILE": int(scale_tile)}  # fmt: skip


# Candidates by the mean rows per expert at an M (<= 8, <= 48, more), beside the format's current default. Few rows:
# small BLOCK_N (more programs over the chosen experts' weights), long K tiles, the weight tile as the MMA's M side;
# many rows: larger tiles. Each distinct config compiles twice (gate/up, down) per format, a few seconds each; the
# two shapes share the compiled kernels. Compiled offline for sm_90 (Triton 3.6), none of these spills (up to 185
# registers; bf16 128 x 256: 211); w4a16's 128 x 256 tiles take all 255 registers and are left out.
MOST_TILE = {"w4a16": 128 * 128}  # the largest BLOCK_M * BLOCK_N a format's candidates keep
SWEEP_CANDIDATES = {
    8: [tile(16, 32, 128, 4, 4), tile(16, 64, 128, 4, 3), tile(16, 64, 128, 4, 4, True), tile(16, 128, 128, 4, 3, True),
        tile(16, 32, 64, 2, 4), tile(16, 32, 128, 4, 4, scale_tile=True), tile(16, 64, 128, 4, 4, True, True)],
    48: [tile(16, 64, 128, 4, 4, True), tile(32, 64, 64, 4, 4), tile(64, 64, 64, 4, 4), tile(64, 128, 64, 4, 3),
         tile(64, 64, 64, 4, 4, scale_tile=True)],
    2**62: [tile(64, 128, 64, 4, 4), tile(128, 128, 64, 8, 3), tile(128, 128, 64, 8, 4), tile(64, 256, 64, 8, 3),
            tile(128, 256, 64, 8, 3)],
}  # fmt: skip
SMOKE_CANDIDATES = [tile(16, 32, 32, 4, 1), tile(16, 32, 64, 4, 1, True)]


KEY_ORDER = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "SWAP_AB", "SCALE_TILE")


def normalized(cfg: dict, fmt: str) -> dict[str, int]:
    """``cfg`` with every key explicit (BLOCK_K 64, SWAP_AB and SCALE_TILE 0 where absent); fp8_block's BLOCK_K (B)
    and SCALE_TILE outside w4a16 dropped."""
    full = {"BLOCK_K": 64, "SWAP_AB": 0, "SCALE_TILE": 0, **cfg}
    drop = {"BLOCK_K"} if fmt == "fp8_block" else set()
    drop |= {"SCALE_TILE"} if fmt != "w4a16" else set()
    return {key: full[key] for key in KEY_ORDER if key not in drop}


def decode_candidates(m: int, shape: tuple, fmt: str) -> list[dict]:
    """Where m tokens take the decode path by default (bf16, w4a16): its config first, then variants of it (no K
    split, other warps, w4a16 with HOIST flipped, half or twice the rows per program, gate/up's split summed in a
    launch of its own)."""
    h, inter, e, k = shape
    if fmt not in COMPARE_FORMATS or not M.layer_config(m, k, e, KERNEL_FORMAT[fmt], h, inter, None)["DECODE"]:
        return []
    base = M.decode_config(m, k, e)
    bm = base["BLOCK_M"]
    out = [base, {**base, "SPLIT_K": 1}, {**base, "SPLIT_K": 4}, {**base, "num_warps": 1}, {**base, "num_warps": 4}]
    out += [{**base, "HOIST": int(bm > 1)}] * (fmt == "w4a16") + [{**base, "BLOCK_M": bm // 2}] * (bm > 1)
    out += [{**base, "FIXUP": 0}]
    return out + [{**base, "BLOCK_M": bm * 2}] * (bm < 4 and m * k >= e)


def sweep_candidates(m: int, shape: tuple, fmt: str, smoke: bool) -> list[dict]:
    """The default config first (the decode path's where m tokens take it, with its variants), then the tile
    candidates of m's rows per expert, without duplicates."""
    h, inter, e, k = shape
    default = M.moe_config(m, k, e, KERNEL_FORMAT[fmt], h, inter)
    pool = SMOKE_CANDIDATES if smoke else next(c for most, c in SWEEP_CANDIDATES.items() if m * k / e <= most)
    out: list[dict] = []
    for cfg in decode_candidates(m, shape, fmt):
        if cfg not in out:
            out.append(cfg)
    for cfg in [default, *pool]:
        if normalized(cfg, fmt) not in out and cfg["BLOCK_M"] * cfg["BLOCK_N"] <= MOST_TILE.get(fmt, 2**30):
            out.append(normalized(cfg, fmt))
    return out


PRECOMPILE_SHAPE = (128, 128, 8, 2)  # tiny, with the layer shapes' divisibility by 16: the same compiled kernels


def precompile_worker(jobs: list[tuple[str, dict]], dev: str = "cuda") -> None:
    """Compile (through one small launch each) the kernels of (format, config) jobs into Triton's disk cache."""
    h, inter, e, k = PRECOMPILE_SHAPE
    g = torch.Generator(device=dev).manual_seed(0)
    x, logits = torch.randn(4, h, device=dev).bfloat16(), torch.randn(4, e, device=dev).bfloat16()
    for fmt, cfg in jobs:
        w13, w2 = expert_weights(fmt, 2 * inter, h, e, dev, g), expert_weights(fmt, h, inter, e, dev, g)
        fused_layer(x, logits, w13, w2, k, cfg)
    if dev == "cuda":
        torch.cuda.synchronize()


def precompile(jobs: list[tuple[str, dict]], workers: int, dev: str = "cuda") -> float:
    """Compile every job's kernels in ``workers`` processes at once (compiling one after another took most of the
    sweep's time); the sweep then loads them from the cache. Returns the seconds it took."""
    import concurrent.futures
    import multiprocessing

    start = time.monotonic()
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        list(pool.map(precompile_worker, [jobs[i::workers] for i in range(workers)], [dev] * workers))
    return time.monotonic() - start


def first_line(exc: BaseException) -> str:
    return (str(exc).strip() or type(exc).__name__).splitlines()[0][:160]


def label(cfg: dict) -> str:
    if cfg.get("DECODE"):
        return "decode " + " ".join(f"{key}={v}" for key, v in cfg.items() if key != "DECODE")
    bk = f"x{cfg['BLOCK_K']}" if "BLOCK_K" in cfg else ""
    swap = " swap" if cfg.get("SWAP_AB") else ""
    scale = " tile-scaled" if cfg.get("SCALE_TILE") else ""
    return f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}{bk} w{cfg['num_warps']} s{cfg['num_stages']}{swap}{scale}"


def sweep_order(ms: list[int]) -> list[int]:
    """The swept M in order of value, so that a sweep cut short by its budget loses the least: batch 1 (the
    bandwidth target), then the largest M (where the loop over experts wins), then the rest from both ends."""
    rest, out = sorted(ms), []
    while rest:
        out.append(rest.pop(0))
        if rest:
            out.append(rest.pop())
    return out


def sweep(shapes, ms, fmts, timer, dev, copy_bw, smoke, deadline) -> list[dict]:
    """Every candidate of every (shape, format, M), M in ``sweep_order``: time (routed_moe in a graph), share of
    copy bandwidth and a check against the reference. Past ``deadline`` (time.monotonic) the remaining candidates
    are skipped. Rows come back sorted by shape, format and M."""
    g = torch.Generator(device=dev).manual_seed(0)
    experts = {(name, f): [expert_weights(f, 2 * inter, h, e, dev, g), expert_weights(f, h, inter, e, dev, g)]
               for name, (h, inter, e, k) in shapes.items() for f in fmts}  # fmt: skip
    rows = []
    for m in sweep_order(ms):
        for name, shape in shapes.items():
            h, _, e, k = shape
            x = torch.randn(m, h, device=dev, generator=g).bfloat16()
            logits = torch.randn(m, e, device=dev, generator=g).bfloat16()
            weights, ids = M.route(logits, k)
            chosen = ids.unique().numel()
            for fmt in fmts:
                w13, w2 = experts[name, fmt]
                ref = M.fused_moe_reference(x, w13, w2, weights, ids).float()
                tol = 4 * torch.finfo(torch.bfloat16).eps * ref.abs().max().item()
                tried = []
                for cfg in sweep_candidates(m, shape, fmt, smoke):
                    if time.monotonic() > deadline:
                        tried.append({"config": cfg, "skipped": True})
                        continue
                    try:  # a config the device cannot run (shared memory, registers) is reported, not fatal
                        err = (M.fused_moe(x, w13, w2, weights, ids, config=cfg).float() - ref).abs().max().item()
                    except Exception as exc:
                        print(f"sweep {name} {fmt} M={m}: {label(cfg)} failed: {first_line(exc)}")
                        tried.append({"config": cfg, "failed": str(exc)[:500]})
                        continue
                    us = timer.per_call([lambda x=x, logits=logits, w13=w13, w2=w2, cfg=cfg, k=k:
                                         fused_layer(x, logits, w13, w2, k, cfg)])  # fmt: skip
                    gbs = chosen * (expert_bytes(w13) + expert_bytes(w2)) / us / 1e3
                    tried.append({"config": cfg, "us": us, "of_copy": gbs * 1e9 / copy_bw, "ok": err <= tol,
                                  "err": err})  # fmt: skip
                rows.append(sweep_row(name, fmt, m, tried))
    order = {name: i for i, name in enumerate(shapes)}
    return sorted(rows, key=lambda r: (order[r["shape"]], fmts.index(r["fmt"]), r["m"]))


def routing_launches(shapes, timer, dev) -> list[dict]:
    """Routing of 1 and 16 tokens as two launches (route, align) and as one (route_and_align), in a graph."""
    rows = []
    for name, (h, inter, e, k) in shapes.items():
        for m in (1, 16):
            logits = torch.randn(m, e, device=dev).bfloat16()
            bm = block_m(m, (h, inter, e, k))
            two = timer.per_call([lambda logits=logits, bm=bm, e=e, k=k: M.align(M.route(logits, k)[1], e, bm)])
            one = timer.per_call([lambda logits=logits, bm=bm, k=k: M.route_and_align(logits, k, bm)])
            rows.append({"shape": name, "m": m, "route_then_align_us": two, "route_and_align_us": one})
            print(f"sweep {name} routing M={m}: route + align {two:.1f} us, route_and_align {one:.1f} us", flush=True)
    return rows


def sweep_row(name: str, fmt: str, m: int, tried: list[dict]) -> dict:
    """One (shape, format, M): the candidates' figures, the best correct one and the default's (the first)."""
    timed = [t for t in tried if "us" in t]
    good = [t for t in timed if t["ok"]]
    best = min(good, key=lambda t: t["us"]) if good else None
    tiles = [t for t in good if not t["config"].get("DECODE")]
    best_tile = min(tiles, key=lambda t: t["us"]) if tiles else None  # what TUNED_CONFIGS can hold
    default = timed[0] if timed else None
    row = {"shape": name, "fmt": fmt, "m": m, "tried": tried, "best": best, "best_tile": best_tile,
           "default": default}  # fmt: skip
    wrong = sum(not t["ok"] for t in timed)
    skipped = sum(bool(t.get("skipped")) for t in tried)
    if best is None:
        print(f"sweep {name} {fmt} M={m}: nothing correct timed ({wrong} wrong, {skipped} skipped)", flush=True)
        return row
    print(f"sweep {name} {fmt} M={m}: {label(best['config'])} {best['us']:.1f} us {100 * best['of_copy']:.0f}% "
          f"(default {default['us']:.1f}, {default['us'] / best['us']:.2f}x; {len(timed)} timed"
          + (f", {wrong} WRONG" if wrong else "") + (f", {skipped} skipped)" if skipped else ")"),
          flush=True)  # fmt: skip
    return row


def paste_block(rows: list[dict], shapes: dict) -> str:
    """``TUNED_CONFIGS`` entries (kernels/moe/configs.py) from the sweep's best configs: each swept M is a bucket's
    upper bound in tokens, the largest one open-ended."""
    lines = ["TUNED_CONFIGS = {"]
    for name, (h, inter, e, k) in shapes.items():
        for fmt in dict.fromkeys(r["fmt"] for r in rows):
            best = [r for r in rows if r["shape"] == name and r["fmt"] == fmt and r["best_tile"]]
            if not best:
                continue
            lines.append(f'    ("{KERNEL_FORMAT[fmt]}", {h}, {inter}, {e}, {k}): [  # {name}')
            for i, r in enumerate(best):
                most = "INF" if i == len(best) - 1 else str(r["m"])
                if r["best"]["config"].get("DECODE"):  # the decode path won: its config, for configs.py by hand
                    lines.append(f"        # M = {r['m']}: {label(r['best']['config'])} {r['best']['us']:.1f} us")
                cfg = r["best_tile"]["config"]
                args = [str(cfg.get(key, 0)) for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")]
                args += ["swap=1"] * bool(cfg.get("SWAP_AB")) + ["scale_tile=1"] * bool(cfg.get("SCALE_TILE"))
                args += [f"group={GROUP}"] * (KERNEL_FORMAT[fmt] == "w4a16")
                lines.append(f"        ({most}, _tile({', '.join(args)})),  # {r['best_tile']['us']:.1f} us")
            lines.append("    ],")
    return "\n".join([*lines, "}"]) + "\n"


def columns(rows: list[dict]) -> list[str]:
    """The variants timed: FORMATS, then the other path's columns where some row has them."""
    other = [f"{f} {path}" for path in ("tile", "decode") for f in COMPARE_FORMATS]
    return FORMATS + [c for c in other if any(c in r for r in rows)]


def cell(r: dict, col: str) -> str:
    if col not in r:
        return "-"
    c = r[col]
    return f"{c['us']:.1f} ({c['speedup']:.2f}x, {100 * c['of_copy']:.0f}%)" + ("" if c["ok"] else " WRONG")


def markdown(env: dict, copy_bw: float, rows: list[dict]) -> str:
    lines = [
        f"# Fused MoE layer vs a loop over experts -- {env['device']}, torch {env['torch']}, triton {env['triton']}, "
        f"{env['date']}, commit {env['commit']}",
        "",
        f"Copy bandwidth {copy_bw / 1e9:.0f} GB/s. Each cell: microseconds, speedup over the loop, and the chosen "
        "experts' bytes per second as a fraction of copy bandwidth.",
        "",
        "| shape | M | experts read | loop us | dense bf16 us | routing us | " + " | ".join(columns(rows)) + " |",
        "|---|---|---|---|---|---|" + "---|" * len(columns(rows)),
    ]
    for r in rows:
        cells = [cell(r, col) for col in columns(rows)]
        lines.append(f"| {r['shape']} | {r['m']} | {r['experts_read']} | {r['loop_us']:.1f} | {r['dense_us']:.1f} | "
                     f"{r['routing_us']:.1f} | "
                     + " | ".join(cells) + " |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"M in {QUICK_MS}")
    ap.add_argument("--ms", default="", help="comma-separated M values instead (e.g. 1,16: the decode path)")
    ap.add_argument("--smoke", action="store_true", help="CPU plumbing check (needs TRITON_INTERPRET=1)")
    ap.add_argument("--sweep", action="store_true", help="time candidate tile configs, print the best per M")
    ap.add_argument("--sweep-formats", default="bf16,w4a16", help="formats the sweep covers (default bf16,w4a16)")
    ap.add_argument("--sweep-budget", type=float, default=240.0, help="seconds after which the sweep skips the rest")
    add_out_argument(ap, "moe")
    args = ap.parse_args(argv)
    if args.ms and not all(v.isdigit() and int(v) > 0 for v in args.ms.split(",")):
        ap.error(f"--ms takes comma-separated token counts from 1, got {args.ms!r}")
    dev = kernel_device(args.smoke)
    copy_bw = copy_bandwidth(dev, smoke=args.smoke)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    ms = [int(v) for v in args.ms.split(",")] if args.ms else SMOKE_MS if args.smoke else QUICK_MS if args.quick else MS
    out = out_folder(args.out)
    env = environment(dev)
    if args.sweep:
        fmts = args.sweep_formats.split(",")
        if not fmts or not set(fmts) <= set(FORMATS):
            raise SystemExit(f"--sweep-formats takes a comma-separated subset of {FORMATS}, got {args.sweep_formats!r}")
        timer = Timer(args.smoke, warmup_ms=10, rep_ms=40)
        deadline = time.monotonic() + args.sweep_budget
        jobs = list(dict.fromkeys((f, json.dumps(c)) for shape in shapes.values() for m in ms for f in fmts
                                  for c in sweep_candidates(m, shape, f, args.smoke)))  # fmt: skip
        jobs = jobs[:1] if args.smoke else jobs  # smoke: the plumbing only (the interpreter compiles nothing)
        workers = max(1, min(8, (os.cpu_count() or 2) // 2, len(jobs)))
        try:  # a failure here only costs time: the sweep compiles what it lacks itself
            took = precompile([(f, json.loads(c)) for f, c in jobs], workers, dev)
            print(f"sweep: {len(jobs)} (format, config) pairs compiled in {took:.0f} s by {workers} processes")
        except Exception as exc:
            print(f"sweep: parallel compile failed ({first_line(exc)}); compiling in the sweep")
        routing = routing_launches(shapes, timer, dev)
        rows = sweep(shapes, ms, fmts, timer, dev, copy_bw, args.smoke, deadline)
        block = paste_block(rows, shapes)
        record = {"env": env, "copy_bandwidth": copy_bw, "routing": routing, "rows": rows}
        (out / "moe_sweep.json").write_text(json.dumps(record, indent=1))
        (out / "moe_sweep.py").write_text(block)
        print(block + f"wrote {out}/moe_sweep.json and moe_sweep.py")
        return
    timer = Timer(args.smoke, warmup_ms=25, rep_ms=100)
    rows = []
    for name, shape in shapes.items():
        rows += run_shape(name, shape, ms, timer, dev, copy_bw, args.smoke)
        if dev == "cuda":
            torch.cuda.empty_cache()
    (out / "moe.json").write_text(json.dumps({"env": env, "copy_bandwidth": copy_bw, "rows": rows}, indent=1))
    (out / "moe.md").write_text(markdown(env, copy_bw, rows))
    timed = [r[col] for r in rows for col in columns(rows) if col in r]
    print(f"{sum(c['ok'] for c in timed)}/{len(timed)} correct; wrote {out}/moe.json and moe.md")


if __name__ == "__main__":
    main()
