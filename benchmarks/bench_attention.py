"""Paged attention kernels alone on one GPU (issue 8, benchmark 3), correctness checked first.

Shapes are Llama-3-8B's attention (32 query heads, 8 kv heads, head dim 128), bf16, 16-token pages scattered over
a shuffled block pool:

  decode   quantkit.kernels.attention.paged.paged_decode: one query per sequence over its paged context.
           Minimum bytes = K + V of every context (+ q and out); "% copy" compares the achieved TB/s with the
           device-to-device copy bandwidth measured in the same run (read + write bytes).
           Target: >= 70% at batch 64, 4k context. Timed as a CUDA graph (do_bench_cudagraph, median).
  mla      quantkit.kernels.attention.mla.mla_decode: DeepSeek-V3's absorbed latent attention decode (kv_lora_rank
           512 + 64 rope values per token, one latent row for all heads) at 16 heads (dummy:deepseek-v3-tiny, or
           DeepSeek-V3 split over 8 GPUs) and 128 (all of DeepSeek-V3's heads). Minimum bytes = the latent rows of
           every context (+ q and out); "% copy" as for decode. Target: >= 70% at batch 64, 4k context.
  prefill  quantkit.kernels.attention.prefill.flash_prefill: causal attention of packed sequences (first prefills: the
           chunk's K/V packed, no cached prefix), against torch SDPA (is_causal, GQA via enable_gqa and via repeated
           K/V; the faster is the baseline) on the same tensors. FLOPs = 4 * L^2 / 2 * Hq * D per sequence.
           Target: >= 80% of SDPA. 16k tokens per case (L = 1k, 2k and 4k). Timed with do_bench (median, L2
           flushed); every configuration's output is checked against the reference before it is recorded.

A small sweep of launch configurations runs for each case; the table reports the default configuration (what the
runtime uses for first prefills: ``flash_prefill.prefill_config`` of the case's length, TMA on, no prefix loops)
and the best one found, so a better default can be committed from one run.

  python benchmarks/bench_attention.py            full: ~1-2 minutes on an H200 (mostly Triton compiles)
  python benchmarks/bench_attention.py --quick    target cases only; decode default config, small prefill sweep
  python benchmarks/bench_attention.py --mla      the MLA decode cases with their launch-config sweep only
  TRITON_INTERPRET=1 python benchmarks/bench_attention.py --smoke    CPU plumbing check (tiny shapes, wall clock)

Results: JSON + markdown under --out (default out/attention); a short table is printed last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial

import torch
import torch.nn.functional as F
from common import (
    LLAMA3_8B,
    add_out_argument,
    copy_bandwidth,
    environment,
    head_dim,
    kernel_device,
    median_seconds,
    out_folder,
)
from quantkit.kernels.attention.mla import mla_decode, mla_decode_reference
from quantkit.kernels.attention.paged import paged_decode, paged_decode_reference
from quantkit.kernels.attention.prefill import LAZY_RESCALE, flash_prefill, flash_prefill_reference, prefill_config

HQ, HKV, D = LLAMA3_8B["num_attention_heads"], LLAMA3_8B["num_key_value_heads"], head_dim(LLAMA3_8B)
PAGE = 16
DECODE_TARGET = (64, 4096, 0.70)  # batch, context, fraction of copy bandwidth
PREFILL_TARGET = 0.80  # fraction of SDPA's TFLOP/s
DECODE_CASES = [(64, 4096), (256, 1024), (8, 8192), (1, 32768)]
PREFILL_CASES = [(1024, 16), (2048, 8), (4096, 4)]  # (sequence length, sequences): 16k tokens each
DECODE_SWEEP = [  # (block_n, num_warps, num_stages, splits or None = default)
    (64, 4, 2, None),
    (32, 4, 2, None),
    (128, 4, 2, None),
    (64, 4, 3, None),
    (64, 8, 2, None),
    (128, 8, 3, None),
    (64, 4, 2, 1),
    (64, 4, 2, 2),
    (64, 4, 2, 6),
    (64, 4, 2, 64),  # the default's cap on splits (raised from 32 for batch 1 at 32k context)
    (64, 4, 2, 128),
    (128, 4, 2, 32),
    (128, 4, 2, 64),
    (64, 4, 3, 64),
]
PREFILL_SWEEP = [  # (block_m, block_n, num_warps, num_stages, TMA for q and the chunk's K/V, lazy rescaling,
    # the cached-prefix loops compiled in): first prefills, so the runtime launches them without (has_prefix=False)
    (64, 64, 4, 3, True, False, False),  # the committed default up to 1024 queries a chunk (PREFILL_CONFIGS)
    (128, 128, 8, 3, True, False, False),  # ... and for longer chunks
    (64, 64, 4, 3, True, False, True),  # the same with the prefix loops (every launch, before they became optional)
    (128, 128, 8, 3, True, False, True),
    (128, 32, 4, 4, True, False, False),  # the former default up to 2048 queries
    (128, 32, 4, 4, True, False, True),
    (128, 64, 8, 2, True, False, False),  # 162 registers without the prefix loops (Triton 3.6, sm_90)
    (64, 64, 4, 2, True, False, False),  # 158
    (64, 32, 4, 3, True, False, False),  # 133
    (128, 64, 8, 3, True, False, False),
    (128, 128, 8, 2, True, False, False),  # 216
    (64, 128, 4, 2, True, False, False),  # 210
    (128, 32, 4, 3, True, False, False),
    (64, 64, 4, 3, True, True, False),  # lazy rescaling (slower on the H200)
    (128, 128, 8, 3, True, True, False),
    (64, 64, 4, 3, False, False, False),  # without TMA
    (128, 128, 8, 3, False, False, False),
    (128, 64, 4, 4, True, False, False),
    (64, 32, 4, 4, True, False, False),
    (128, 128, 8, 4, True, False, False),
    (256, 64, 8, 3, True, False, False),
]
PREFILL_QUICK = 6  # configurations of the sweep that --quick runs
MLA_RANK, MLA_ROPE = 512, 64  # DeepSeek-V3's kv_lora_rank and qk_rope_head_dim
MLA_CASES = [(16, 64, 4096), (128, 64, 4096), (16, 256, 1024), (16, 1, 32768)]  # (heads, batch, context)
MLA_SWEEP = [  # (block_h, block_n, num_warps, num_stages, splits or None = default)
    (16, 32, 4, 2, None),  # the launcher's default
    (16, 16, 4, 2, None),
    (16, 64, 8, 2, None),
    (32, 32, 8, 2, None),
    (64, 16, 8, 2, None),
    (32, 16, 4, 2, None),
    (32, 32, 8, 3, None),
    (16, 32, 8, 3, None),
    (16, 32, 4, 2, 1),
    (16, 32, 4, 2, 8),
]
SMOKE = {"decode": [(3, 40)], "prefill": [(48, 2)], "hq": 4, "hkv": 2, "d": 32, "mla": [(4, 3, 40)], "rank": 32,
         "rope": 16}  # fmt: skip
DTYPE = torch.bfloat16  # fp16 under --smoke: Triton 3.9's interpreter computes bf16 tl.dot wrongly


def paged_kv(lens: list[int], hkv: int, d: int, dtype, device, gen):
    """Random K/V caches holding ``lens`` tokens per sequence in shuffled pages; int32 block tables."""
    pages = [-(-n // PAGE) for n in lens]
    perm = torch.randperm(sum(pages), generator=gen).to(device)
    k = torch.randn(sum(pages), PAGE, hkv, d, device=device, dtype=dtype)
    v = torch.randn_like(k)
    tables = torch.zeros(len(lens), max(pages), dtype=torch.int32, device=device)
    at = 0
    for i, n in enumerate(pages):
        tables[i, :n] = perm[at : at + n]
        at += n
    return k, v, tables


def bench_config(fn, graph: bool, smoke: bool) -> float | None:
    """Median seconds per call of one sweep candidate; None when it does not fit the GPU (shared memory,
    registers)."""
    from triton.runtime.errors import OutOfResources

    try:
        return median_seconds(fn, graph, smoke)
    except OutOfResources as exc:
        print(f"  skipped: {exc}")
        return None


def check_decode(q, k, v, tables, ctx, scale, rows: int = 4) -> float:
    """Max |kernel - reference| over the first ``rows`` sequences (the reference loops in Python)."""
    out = paged_decode(q, k, v, tables, ctx, scale)
    ref = paged_decode_reference(q[:rows], k, v, tables[:rows], ctx[:rows], scale)
    return float((out[:rows].float() - ref.float()).abs().max())


def run_decode(cases, hq, hkv, d, copy_bw, sweep, smoke, device, gen, dtype) -> list[dict]:
    rows = []
    for batch, context in cases:
        k, v, tables = paged_kv([context] * batch, hkv, d, dtype, device, gen)
        q = torch.randn(batch, hq, d, device=device, dtype=dtype)
        ctx = torch.full((batch,), context, dtype=torch.int32, device=device)
        scale = d**-0.5
        err = check_decode(q, k, v, tables, ctx, scale)
        if err > 3e-2:
            raise AssertionError(f"decode B={batch} ctx={context}: max error {err:.3e} against the reference")
        nbytes = 2 * batch * context * hkv * d * 2 + 2 * q.numel() * 2
        for block_n, warps, stages, splits in sweep:
            fn = partial(paged_decode, q, k, v, tables, ctx, scale, num_splits=splits, block_n=block_n,
                         num_warps=warps, num_stages=stages)  # fmt: skip
            sec = bench_config(fn, graph=True, smoke=smoke)
            if sec is None:
                continue
            rows.append({
                "kernel": "decode", "case": f"B={batch} ctx={context}", "config": f"n{block_n} w{warps} s{stages} "
                f"splits={splits or 'auto'}", "default": (block_n, warps, stages, splits) == DECODE_SWEEP[0],
                "us": sec * 1e6, "TB/s": nbytes / sec / 1e12, "vs_copy": nbytes / sec / copy_bw, "max_err": err,
            })  # fmt: skip
    return rows


def run_mla(cases, rank, rope, copy_bw, sweep, smoke, device, gen, dtype) -> list[dict]:
    rows = []
    for heads, batch, context in cases:
        cache, _, tables = paged_kv([context] * batch, 1, rank + rope, dtype, device, gen)
        q_lat = torch.randn(batch, heads, rank, device=device, dtype=dtype)
        q_pe = torch.randn(batch, heads, rope, device=device, dtype=dtype)
        ctx = torch.full((batch,), context, dtype=torch.int32, device=device)
        scale = (128 + rope) ** -0.5
        n = min(batch, 4)
        ref = mla_decode_reference(q_lat[:n], q_pe[:n], cache, tables[:n], ctx[:n], scale)
        err = float((mla_decode(q_lat, q_pe, cache, tables, ctx, scale)[:n].float() - ref.float()).abs().max())
        if err > 3e-2:
            raise AssertionError(f"mla H={heads} B={batch} ctx={context}: max error {err:.3e} against the reference")
        nbytes = batch * context * (rank + rope) * 2 + 2 * q_lat.numel() * 2 + q_pe.numel() * 2
        for block_h, block_n, warps, stages, splits in sweep:
            fn = partial(mla_decode, q_lat, q_pe, cache, tables, ctx, scale, num_splits=splits, block_h=block_h,
                         block_n=block_n, num_warps=warps, num_stages=stages)  # fmt: skip
            sec = bench_config(fn, graph=True, smoke=smoke)
            if sec is None:
                continue
            rows.append({
                "kernel": "mla", "case": f"H={heads} B={batch} ctx={context}", "config": f"h{block_h} n{block_n} "
                f"w{warps} s{stages} splits={splits or 'auto'}", "default": (block_h, block_n, warps, stages, splits)
                == MLA_SWEEP[0], "us": sec * 1e6, "TB/s": nbytes / sec / 1e12, "vs_copy": nbytes / sec / copy_bw,
                "max_err": err,
            })  # fmt: skip
    return rows


def sdpa_seconds(q, k, v, smoke: bool) -> tuple[float, str]:
    """The faster of SDPA with enable_gqa and SDPA on K/V repeated to every query head."""
    group = q.shape[1] // k.shape[1]
    gqa = median_seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), False, smoke)
    kr, vr = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    mha = median_seconds(lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=True), False, smoke)
    return (gqa, "sdpa enable_gqa") if gqa <= mha else (mha, "sdpa repeated kv")


def first_prefills(length: int, n_seq: int, hq: int, hkv: int, d: int, dtype, device, gen):
    """``n_seq`` whole prompts of ``length`` tokens: (q, packed k, packed v, k cache, v cache, block tables,
    cu_seqlens, context lens), the chunk's K/V packed [n_seq * L, Hkv, D] as the runtime passes them (and holds
    them in the cache)."""
    k, v, tables = paged_kv([length] * n_seq, hkv, d, dtype, device, gen)
    q = torch.randn(n_seq * length, hq, d, device=device, dtype=dtype)
    cu = torch.arange(0, (n_seq + 1) * length, length, dtype=torch.int32, device=device)
    ctx = torch.full((n_seq,), length, dtype=torch.int32, device=device)
    pos = torch.arange(length, device=device)
    kp = torch.cat([k[tables[s, pos // PAGE].long(), pos % PAGE] for s in range(n_seq)])
    vp = torch.cat([v[tables[s, pos // PAGE].long(), pos % PAGE] for s in range(n_seq)])
    return q, kp, vp, k, v, tables, cu, ctx


def run_prefill(cases, hq, hkv, d, sweep, smoke, device, gen, dtype) -> list[dict]:
    rows = []
    for length, n_seq in cases:
        q, kp, vp, k, v, tables, cu, ctx = first_prefills(length, n_seq, hq, hkv, d, dtype, device, gen)
        scale = d**-0.5
        check = slice(0, min(length, 256))  # first rows of sequence 0 against the reference
        ref = flash_prefill_reference(q[:length], kp[:length], vp[:length], k, v, tables[:1], cu[:2], ctx[:1], scale)
        # the same K/V for SDPA: [n_seq, H, L, D]
        kc = kp.view(n_seq, length, hkv, d).transpose(1, 2)
        vc = vp.view(n_seq, length, hkv, d).transpose(1, 2)
        qs = q.view(n_seq, length, hq, d).transpose(1, 2)
        flops = 4 * n_seq * length * length / 2 * hq * d
        base, base_name = sdpa_seconds(qs, kc.contiguous(), vc.contiguous(), smoke)
        rows.append({"kernel": "prefill", "case": f"L={length} x{n_seq}", "config": base_name, "default": False,
                     "us": base * 1e6, "TFLOP/s": flops / base / 1e12, "vs_sdpa": 1.0, "max_err": 0.0})  # fmt: skip
        for bm, bn, warps, stages, tma, lazy, prefix_loops in sweep:
            fn = partial(flash_prefill, q, kp, vp, k, v, tables, cu, ctx, length, scale, block_m=bm, block_n=bn,
                         num_warps=warps, num_stages=stages, use_tma=tma, lazy_rescale=lazy,
                         has_prefix=prefix_loops)  # fmt: skip
            name = f"m{bm} n{bn} w{warps} s{stages}" + (" tma" if tma else "") + (" lazy" if lazy else "")
            name += " prefix-loops" if prefix_loops else ""
            sec = bench_config(fn, graph=False, smoke=smoke)
            if sec is None:
                continue
            err = float((fn()[check].float() - ref[check].float()).abs().max())
            if err > 3e-2:
                raise AssertionError(f"prefill L={length} {name}: max error {err:.3e} against the reference")
            rows.append({
                "kernel": "prefill", "case": f"L={length} x{n_seq}", "config": name,
                "default": (bm, bn, warps, stages, tma, lazy, prefix_loops)
                == (*prefill_config(length, smoke), True, LAZY_RESCALE, False),
                "us": sec * 1e6,
                "TFLOP/s": flops / sec / 1e12, "vs_sdpa": base / sec, "max_err": err,
            })  # fmt: skip
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per case: the default configuration's figure, the best configuration's, and the target verdict."""
    out = []
    for case in dict.fromkeys((r["kernel"], r["case"]) for r in rows):
        mine = [r for r in rows if (r["kernel"], r["case"]) == case and not r["config"].startswith("sdpa")]
        metric = "vs_copy" if case[0] in ("decode", "mla") else "vs_sdpa"
        default = next((r for r in mine if r["default"]), {metric: float("nan")})  # nan: the default did not fit
        best = max(mine, key=lambda r: r[metric])
        target = PREFILL_TARGET if case[0] == "prefill" else None
        if case == ("decode", f"B={DECODE_TARGET[0]} ctx={DECODE_TARGET[1]}"):
            target = DECODE_TARGET[2]
        if case[0] == "mla" and case[1].endswith(f" B={DECODE_TARGET[0]} ctx={DECODE_TARGET[1]}"):
            target = DECODE_TARGET[2]
        out.append({
            "kernel": case[0], "case": case[1], "metric": metric, "default": default[metric], "best": best[metric],
            "best_config": best["config"], "rate": best.get("TB/s", best.get("TFLOP/s")), "target": target,
            "meets_target": None if target is None else default[metric] >= target,
        })  # fmt: skip
    return out


def markdown(meta: dict, rows: list[dict], table: list[dict]) -> str:
    lines = [f"# Paged attention kernels, {meta['device']}, {meta['date']}, commit {meta['commit']}", ""]
    lines += [f"Command: `{meta['command']}`", ""]
    lines += [f"Copy bandwidth (read + write): {meta['copy_TBps']:.2f} TB/s", ""]
    lines += ["| kernel | case | metric | default | best | best config | target |", "|---|---|---|---|---|---|---|"]
    for t in table:
        target = "-" if t["target"] is None else f"{t['target']:.0%} ({'met' if t['meets_target'] else 'MISSED'})"
        lines.append(f"| {t['kernel']} | {t['case']} | {t['metric']} | {t['default']:.1%} | {t['best']:.1%} | "
                     f"{t['best_config']} | {target} |")  # fmt: skip
    lines += ["", "| kernel | case | config | us | TB/s or TFLOP/s | ratio |", "|---|---|---|---|---|---|"]
    for r in rows:
        rate = r.get("TB/s", r.get("TFLOP/s"))
        ratio = r.get("vs_copy", r.get("vs_sdpa"))
        lines.append(f"| {r['kernel']} | {r['case']} | {r['config']} | {r['us']:.1f} | {rate:.2f} | {ratio:.1%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="target cases; default decode, PREFILL_QUICK prefill configs")
    ap.add_argument("--smoke", action="store_true", help="CPU plumbing check (TRITON_INTERPRET=1), tiny shapes")
    ap.add_argument("--mla", action="store_true", help="the MLA decode cases and their launch-config sweep only")
    add_out_argument(ap, "attention")
    args = ap.parse_args(argv)
    device = kernel_device(args.smoke)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    hq, hkv, d = (SMOKE["hq"], SMOKE["hkv"], SMOKE["d"]) if args.smoke else (HQ, HKV, D)
    decode_cases = SMOKE["decode"] if args.smoke else [DECODE_CASES[0]] if args.quick else DECODE_CASES
    prefill_cases = SMOKE["prefill"] if args.smoke else PREFILL_CASES
    decode_sweep = DECODE_SWEEP[:1] if args.quick or args.smoke else DECODE_SWEEP
    prefill_sweep = PREFILL_SWEEP[:PREFILL_QUICK] if args.quick else PREFILL_SWEEP
    if args.smoke:
        prefill_sweep = [(*prefill_config(0, on_cpu=True), True, LAZY_RESCALE, flag) for flag in (False, True)]

    start = time.perf_counter()
    copy_bw = copy_bandwidth(device, args.smoke)
    dtype = torch.float16 if args.smoke else DTYPE
    rows = []
    if not args.mla:
        rows += run_decode(decode_cases, hq, hkv, d, copy_bw, decode_sweep, args.smoke, device, gen, dtype)
        rows += run_prefill(prefill_cases, hq, hkv, d, prefill_sweep, args.smoke, device, gen, dtype)
    mla_cases = SMOKE["mla"] if args.smoke else MLA_CASES[:2] if args.quick else MLA_CASES
    rank, rope = (SMOKE["rank"], SMOKE["rope"]) if args.smoke else (MLA_RANK, MLA_ROPE)
    mla_sweep = MLA_SWEEP[:1] if args.quick or args.smoke else MLA_SWEEP
    rows += run_mla(mla_cases, rank, rope, copy_bw, mla_sweep, args.smoke, device, gen, dtype)
    table = summary(rows)
    meta = {
        **environment(device),
        "command": " ".join(["python benchmarks/bench_attention.py", *(sys.argv[1:] if argv is None else argv)]),
        "copy_TBps": copy_bw / 1e12,
        "seconds": time.perf_counter() - start,
    }
    out_dir = out_folder(args.out)
    tag = "smoke" if args.smoke else "quick" if args.quick else "full"
    (out_dir / f"bench_attention_{tag}.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "summary": table}, indent=2)
    )
    (out_dir / f"bench_attention_{tag}.md").write_text(markdown(meta, rows, table))
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s; {meta['seconds']:.0f} s; results in {out_dir}")
    print(f"{'kernel':8} {'case':16} {'metric':8} {'default':>8} {'best':>8}  {'best config':28} target")
    for t in table:
        target = "-" if t["target"] is None else f">= {t['target']:.0%} {'met' if t['meets_target'] else 'MISSED'}"
        print(f"{t['kernel']:8} {t['case']:16} {t['metric']:8} {t['default']:8.1%} {t['best']:8.1%}  "
              f"{t['best_config']:28} {target}")  # fmt: skip


if __name__ == "__main__":
    main()
