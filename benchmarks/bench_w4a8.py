"""W4A8 end-to-end speed against cuBLAS bf16, quantkit W4A16 and W8A8 on one GPU, correctness checked first.

Every figure goes from bf16 activations x [M, K] to a bf16 output [M, N] and is timed in the same run as:

  bf16       F.linear(x, W_bf16): cuBLAS, the baseline of every ratio
  w4a16      quantkit.kernels.w4a16.w4a16_linear on the same 4-bit weight (what a W4A16 checkpoint runs)
  w8a8       quantkit.kernels.w8a8.w8a8_linear, int8, per-channel int8 weights (what a W8A8 checkpoint runs)
  w4a8_int8  quantkit.kernels.w4a8.w4a8_linear(fmt="int8"): per-token int8 quantizer + the W4A8 GEMM
  w4a8_fp8   the same with e4m3 activations (fmt="fp8")
  w4a8_gemm  the int8 W4A8 GEMM alone on pre-quantized activations, to split the quantizer's cost off
  w4a8_words w4a8_int8 with the weight tile unpacked word by word (``byte_unpack=False``), the byte path's baseline
  w4a8_group w4a8_int8 with ``GROUP_LOOP_TABLE`` (``kernels/w4a8/gemm.py``'s loop per group above M = 16, the default
             before the flat kernel of ``flat.py``); the same as w4a8_int8 up to M = 16
  w4a8_prog  w4a8_linear on a progressive weight (``kernels/w4a8/progressive.py``: QServe's int8 per-channel level
             and 4-bit groups with integer scales, one int32 accumulator over K), RTN of the bf16 baseline's weight,
             ``PROGRESSIVE_TABLE``'s tiles

Weights are random 4-bit GPTQ-v2 buffers (every bit pattern a valid code and zero point, fp16 scales) in groups of
``--group`` (default 128; -1: per channel); the bf16 and int8 baselines get random weights of the same shape.
Correctness, before any timing, at every (shape, M): each W4A8 variant against the float64 reference of its
quantized operands (``w4a8_reference``; ``progressive_reference`` for w4a8_prog) with flash-attn's rule (error
<= 2x PyTorch's bf16 error on the same dequantized operands + 2**-20 max|y|); the W4A16 and W8A8 baselines by
relative error against their own float64 products (< 1e-2). A failure stops the run.

Timing: a CUDA graph of R calls over R rotated copies of every operand (R chosen so that the 4-bit weights and
activations of one pass span more than 3x the 60 MB L2), replayed under ``triton.testing.do_bench(return_mode=
"median")``, which also flushes L2 before each replay; time per call = replay time / R.

Modes (JSON + markdown written under --out, default out/w4a8; a short table is printed last):
  python benchmarks/bench_w4a8.py                      full table: 6 Llama shapes x M in {1, 16, 64, 256, 1024, 4096}
  python benchmarks/bench_w4a8.py --quick              2 shapes x 3 M
  python benchmarks/bench_w4a8.py --group -1 --ms 1,256  per-channel weights, other rows
  python benchmarks/bench_w4a8.py --flat-sweep         only bf16 and candidate flat-kernel tiles (``FLAT_SWEEP``),
                                                       2 shapes x M in {64, 256, 1024, 4096}
  python benchmarks/bench_w4a8.py --prog-sweep         the same for the progressive kernel's tiles (``PROG_SWEEP``)
  python benchmarks/bench_w4a8.py --prog-small-sweep   its small-M tiles (``PROG_SMALL_SWEEP``) beside W4A16,
                                                       6 shapes x M in {1, 16}
  TRITON_INTERPRET=1 python benchmarks/bench_w4a8.py --smoke   CPU plumbing check: tiny shapes, wall clock
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

import torch
import torch.nn.functional as F
from common import (
    L2_BYTES,
    LLAMA_SHAPES,
    Timer,
    add_out_argument,
    environment,
    geomean,
    kernel_device,
    out_folder,
    rotations,
    text_row,
)
from quantkit.kernels import w4a8 as K
from quantkit.kernels import w4a16 as K16
from quantkit.kernels import w8a8 as K8

ROTATE_SPAN = 3 * L2_BYTES
MAX_ROTATIONS = 64
MS = [1, 16, 64, 256, 1024, 4096]
QUICK_SHAPES = [(4096, 4096), (28672, 8192)]
QUICK_MS = [1, 256, 1024]
SMOKE_SHAPES = [(96, 128), (40, 256)]
SMOKE_MS = [1, 20, 70]
SMOKE_GROUP = 64
VARIANTS = ["bf16", "w4a16", "w8a8", "w4a8_int8", "w4a8_fp8", "w4a8_gemm", "w4a8_words", "w4a8_group", "w4a8_prog"]
RATIO_VARIANTS = ["w4a16", "w8a8", "w4a8_int8", "w4a8_fp8", "w4a8_words", "w4a8_group", "w4a8_prog"]
INT8_VARIANTS = ("w4a8_gemm", "w4a8_words", "w4a8_group")  # int8 activations, checked like w4a8_int8
W4A8_FORMATS = {"w4a8_int8": "int8", "w4a8_fp8": "fp8"}
BASELINE_MAX_REL_ERROR = 1e-2
# issue 49's targets over bf16 cuBLAS: (variant, M range, minimum speedup); at M = 1 the goal is relative to W4A16's
TARGETS = [(v, m, goal) for v in ("w4a8_int8", "w4a8_prog") for m, goal in (((256, 256), 1.2), ((1024, None), 1.4))]
# --flat-sweep: flat-kernel tiles beside FLAT_TABLE's (all compiled for sm_90 without spills, Triton 3.6), to tune it
FLAT = K.W4A8Config(128, 128, 128, 8, swap_ab=True, num_warps=8, num_stages=4, flat=True)
FLAT_SWEEP = [
    FLAT,
    replace(FLAT, num_stages=3),
    replace(FLAT, block_m=64),
    replace(FLAT, block_m=64, split_waves=1),
    replace(FLAT, block_m=64, block_n=256, num_stages=3),
    replace(FLAT, block_n=64, num_warps=4),
    replace(FLAT, block_m=64, block_n=64, num_warps=4),  # 145 registers: three CTAs an SM, their MMAs interleave
    replace(FLAT, byte_unpack=False, num_stages=3),
    replace(FLAT, swap_ab=False, num_stages=3),
]
# --prog-sweep: progressive-kernel tiles (``("prog", cfg)`` variants), compiled for sm_90 without spills (Triton 3.6):
# 128 x 64 on 4 warps (PROGRESSIVE_TABLE's M 65-256 entry), 128 x 128 on 8 warps (125 registers; its entry above
# M = 256), the same on 3 stages (66 KB of shared memory: two CTAs an SM), 256 rows of x (n256 wgmma, 195 registers,
# 177 loop instructions for twice the MMAs), 64 rows, 64 x 64 on four warps (the M 17-64 entry), not swapped; 256
# rows of x against 64 weight rows on one warp group (not compiled offline: twice the MMAs per unpacked code)
PROG = K.W4A8Config(128, 128, 128, 8, swap_ab=True, num_warps=8, num_stages=4, flat=True)
PROG_SWEEP = [
    replace(PROG, block_n=64, num_warps=4),
    PROG,
    replace(PROG, num_stages=3),
    replace(PROG, block_m=256, num_stages=3),
    replace(PROG, block_m=64),
    replace(PROG, block_m=64, split_waves=1),
    replace(PROG, block_m=64, block_n=64, num_warps=4),
    replace(PROG, swap_ab=False, num_stages=3),
    replace(PROG, block_m=256, block_n=64, num_warps=4),
]
SWEEP_MS = [64, 256, 1024, 4096]
# --prog-small-sweep: the progressive kernel's small-M tiles (x's rows on the MMA's N side, 16 wide), timed at M = 1
# and 16 on all six shapes beside W4A16 and the default: deeper and wider weight tiles, more or fewer K splits; then
# prog-gemv (``kernels/w4a8/gemv.py`` at M = 1, the default tiles at 16) and prog-pdl (the default tiles launched
# with programmatic dependent launch after the quantizer)
PROG_SMALL = K.PROGRESSIVE_TABLE[0][1]
PROG_SMALL_SWEEP = [
    PROG_SMALL,
    replace(PROG_SMALL, block_k=128),
    replace(PROG_SMALL, block_n=128),
    replace(PROG_SMALL, block_n=128, block_k=128),
    replace(PROG_SMALL, block_n=32, block_k=128),
    replace(PROG_SMALL, split_waves=8),
    replace(PROG_SMALL, split_waves=2),
    replace(PROG_SMALL, block_k=128, num_stages=6),
    replace(PROG_SMALL, block_n=128, block_k=128, num_warps=8),
]
SMALL_SWEEP_MS = [1, 16]
M1_SHARE_OF_W4A16 = 0.9


def random_weight(n: int, k: int, group: int, device: str, gen: torch.Generator) -> K16.W4A16Weight:
    """Random 4-bit GPTQ-v2 buffers, fp16 scales, contiguous groups (``group`` -1: one group per column)."""
    g = k if group == -1 else group
    n_g = -(-k // g)
    full = dict(low=-(2**31), high=2**31 - 1, dtype=torch.int32, device=device, generator=gen)
    qweight = torch.randint(size=(-(-k // 32) * 4, n), **full)
    qzeros = torch.randint(size=(n_g, -(-n // 32) * 4), **full)
    scales = (torch.rand(n_g, n, device=device, generator=gen) * 0.01 + 0.001).half()
    g_idx = (torch.arange(k, device=device) // g).int()
    return K16.prepare_gptq_weight(qweight, qzeros, scales, g_idx, 4, group)


def weight64(w: K16.W4A16Weight) -> torch.Tensor:
    """W [K, N] = s * (q - z) in float64 (kernel channel order)."""
    codes, scales = K.signed_codes(w)
    return codes.double() * scales.double()


class Problem:
    """R rotated copies of every operand of one (N, K, M) point."""

    def __init__(self, n: int, k: int, m: int, group: int, device: str, seed: int, smoke: bool) -> None:
        self.n, self.k, self.m = n, k, m
        per_call = n * k // 2 + 2 * m * k + 2 * m * n  # 4-bit weights, bf16 x and y
        self.r = 1 if smoke else rotations(per_call, span=ROTATE_SPAN, most=MAX_ROTATIONS)
        gen = torch.Generator(device=device).manual_seed(seed)
        self.x = [torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16) for _ in range(self.r)]
        self.w4 = [random_weight(n, k, group, device, gen) for _ in range(self.r)]
        self.w16, self.w8, self.w8_scale, self.wp = [], [], [], []
        for _ in range(self.r):
            w = (torch.randn(n, k, generator=gen, device=device) * 0.02).to(torch.bfloat16)
            q, s = K8.quantize_rows_reference(w, "int8")
            self.w16.append(w)
            self.w8.append(q)
            self.w8_scale.append(s)
            self.wp.append(K.quantize_progressive(w, 0 if group == -1 else group))
        self.qa = [K8.quantize_activations(x, "int8") for x in self.x]

    def calls(self, variant: str) -> list:
        """One zero-argument callable per rotation, each returning the bf16 output [M, N]."""
        return [self._call(variant, i) for i in range(self.r)]

    def _call(self, variant: str, i: int):
        x, w4 = self.x[i], self.w4[i]
        if variant == "bf16":
            return lambda: F.linear(x, self.w16[i])
        if variant == "w4a16":
            return lambda: K16.w4a16_linear(x, w4)
        if variant == "w8a8":
            return lambda: K8.w8a8_linear(x, self.w8[i], self.w8_scale[i])
        if variant in W4A8_FORMATS:
            fmt = W4A8_FORMATS[variant]
            return lambda: K.w4a8_linear(x, w4, fmt=fmt)
        if variant == "w4a8_words":
            words = replace(K.config_for(self.m), byte_unpack=False)
            return lambda: K.w4a8_linear(x, w4, config=words)
        if variant == "w4a8_group":
            group = K.config_for(self.m, K.GROUP_LOOP_TABLE)
            return lambda: K.w4a8_linear(x, w4, config=group)
        if variant == "w4a8_prog":
            return lambda: K.w4a8_linear(x, self.wp[i])
        if isinstance(variant, K.W4A8Config):
            return lambda: K.w4a8_linear(x, w4, config=variant)
        if isinstance(variant, tuple):  # ("prog" | "prog-pdl" | "prog-gemv", config): the progressive kernel
            if variant[0] == "prog-gemv":  # gemv.py at one row, the default tiles above
                return lambda: K.w4a8_linear(x, self.wp[i], gemv=self.m == 1)
            pdl = variant[0] == "prog-pdl"
            return lambda: K.w4a8_linear(x, self.wp[i], config=variant[1], pdl=pdl)
        if variant == "w4a8_gemm":
            qa, sa = self.qa[i]
            return lambda: K.w4a8_matmul(qa, sa, w4, out_dtype=torch.bfloat16)
        raise ValueError(f"unknown variant {variant!r}")

    def check(self, variant: str, y: torch.Tensor) -> dict:
        """Rotation 0's output against float64 (see the module docstring); raises AssertionError on a failure."""
        x, w4 = self.x[0], self.w4[0]
        where = f"{variant} N={self.n} K={self.k} M={self.m}"
        if variant == "w4a8_prog" or isinstance(variant, tuple):
            ref = K.progressive_reference(x, self.wp[0])
            qa, sa = K8.quantize_activations_reference(x, "int8")
            x_dq = (qa.double() * sa.double()[:, None]).to(torch.bfloat16)
            w_dq = K.dequantize(self.wp[0], torch.float64).to(torch.bfloat16)
            torch_err = ((x_dq @ w_dq.t()).double() - ref).abs().max().item()
            err = (y.double() - ref).abs().max().item()
            if not err <= 2 * torch_err + 2**-20 * ref.abs().max().item():
                raise AssertionError(f"{where}: error {err:.3g} > 2 x PyTorch bf16's {torch_err:.3g}")
            return {"err": err, "torch_err": torch_err}
        if variant in W4A8_FORMATS or variant in INT8_VARIANTS or isinstance(variant, K.W4A8Config):
            fmt = W4A8_FORMATS.get(variant, "int8")
            ref = K.w4a8_reference(x, w4, None, fmt)
            qa, sa = K8.quantize_activations_reference(x, fmt)
            x_dq = (qa.double() * sa.double()[:, None]).to(torch.bfloat16)
            torch_err = ((x_dq @ weight64(w4).to(torch.bfloat16)).double() - ref).abs().max().item()
            err = (y.double() - ref).abs().max().item()
            ok = err <= 2 * torch_err + 2**-20 * ref.abs().max().item()
            if not ok:
                raise AssertionError(f"{where}: error {err:.3g} > 2 x PyTorch bf16's {torch_err:.3g}")
            return {"err": err, "torch_err": torch_err}
        if variant == "w4a16":
            ref = x.double() @ weight64(w4)
        elif variant == "w8a8":
            qa, sa = K8.quantize_activations_reference(x, "int8")
            ref = (qa.double() @ self.w8[0].double().t()) * sa.double()[:, None] * self.w8_scale[0].double()
        else:
            return {}
        rel = ((y.double() - ref).norm() / ref.norm().clamp(min=1e-30)).item()
        if not rel < BASELINE_MAX_REL_ERROR:
            raise AssertionError(f"{where}: relative error {rel:.3g}")
        return {"rel_err": rel}


def run_table(shapes, ms, group: int, timer: Timer, device: str, save) -> list[dict]:
    """One row per (shape, M): every variant checked, then timed; ``save(rows)`` after each row."""
    rows = []
    for n, k in shapes:
        for m in ms:
            t0 = time.perf_counter()
            p = Problem(n, k, m, group, device, seed=n + k + m, smoke=timer.smoke)
            plan = K.explain(m, n, k, p.w4[0].group_size, device)
            row = {"N": n, "K": k, "M": m, "R": p.r, "plan": plan, "us": {}, "check": {}}
            for variant in VARIANTS:
                calls = p.calls(variant)
                row["check"][variant] = p.check(variant, calls[0]())
            for variant in VARIANTS:
                row["us"][variant] = timer.per_call(p.calls(variant))
            base = row["us"]["bf16"]
            row["speedup"] = {v: base / row["us"][v] for v in RATIO_VARIANTS}
            row["w4a8_int8_tops"] = 2.0 * m * n * k / (row["us"]["w4a8_int8"] * 1e-6) / 1e12
            rows.append(row)
            save(rows)
            sp = row["speedup"]
            print(
                f"N={n:6d} K={k:6d} M={m:5d}  bf16 {base:9.1f} us  w4a16 {sp['w4a16']:.2f}x  w8a8 {sp['w8a8']:.2f}x  "
                f"w4a8 int8 {sp['w4a8_int8']:.2f}x  fp8 {sp['w4a8_fp8']:.2f}x  words {sp['w4a8_words']:.2f}x  "
                f"group loop {sp['w4a8_group']:.2f}x  progressive {sp['w4a8_prog']:.2f}x  "
                f"[{time.perf_counter() - t0:.1f} s]",
                flush=True,
            )
            del p
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def variant_name(variant) -> str:
    """A variant's column name: its own (a string), its config's, or for ("prog-pdl" | "prog-gemv", cfg) "prog-pdl"
    and "prog-gemv"."""
    if isinstance(variant, str):
        return variant
    if isinstance(variant, tuple):
        return variant[1].name if variant[0] == "prog" else variant[0]
    return variant.name


def run_sweep(shapes, ms, group: int, timer: Timer, device: str, variants: list) -> list[dict]:
    """bf16 and every variant (``FLAT_SWEEP`` configs, ``("prog", cfg)`` and the others of ``variant_name``) at each
    (shape, M), each checked first; one printed line per point."""
    rows = []
    for n, k in shapes:
        for m in ms:
            p = Problem(n, k, m, group, device, seed=n + k + m, smoke=timer.smoke)
            base = timer.per_call(p.calls("bf16"))
            row = {"N": n, "K": k, "M": m, "bf16_us": base, "speedup": {}}
            for variant in variants:
                name = variant_name(variant)
                p.check(variant, p.calls(variant)[0]())
                row["speedup"][name] = base / timer.per_call(p.calls(variant))
            rows.append(row)
            cells = "  ".join(f"{v:.2f}" for v in row["speedup"].values())
            print(f"N={n:6d} K={k:6d} M={m:5d}  bf16 {base:8.1f} us  {cells}", flush=True)
            del p
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def target_report(rows: list[dict]) -> list[str]:
    """Issue 49's speed targets, met or not, from the rows measured (none for M ranges not run)."""
    lines = []
    at_one = [r for r in rows if r["M"] == 1]
    for variant in ("w4a8_int8", "w4a8_prog") if at_one else ():
        share = geomean(r["speedup"][variant] / r["speedup"]["w4a16"] for r in at_one)
        verdict = "met" if share >= M1_SHARE_OF_W4A16 else "NOT met"
        lines.append(f"{variant} M = 1: target {M1_SHARE_OF_W4A16:.1f}x of W4A16's speed-up, geomean {share:.2f}x "
                     f"-> {verdict}")  # fmt: skip
    for variant, (lo, hi), goal in TARGETS:
        got = [r["speedup"][variant] for r in rows if r["M"] >= lo and (hi is None or r["M"] <= hi)]
        if not got:
            continue
        worst, gm = min(got), geomean(got)
        verdict = "met" if worst >= goal else ("met on geomean only" if gm >= goal else "NOT met")
        span = f"M >= {lo}" if hi is None else f"M = {lo}" if lo == hi else f"M {lo}-{hi}"
        lines.append(f"{variant} {span}: target {goal:.1f}x, worst {worst:.2f}x, geomean {gm:.2f}x -> {verdict}")
    return lines


def table_markdown(rows: list[dict], env: dict) -> str:
    head = ["N", "K", "M", "bf16 us"] + [f"{v} us" for v in VARIANTS[1:]] + [f"{v} x" for v in RATIO_VARIANTS]
    out = [f"# W4A8 vs bf16 cuBLAS, {env['device']}, {env['date']}", "", "```", json.dumps(env, indent=1), "```", ""]
    out += ["| " + " | ".join([*head, "W4A8 plan"]) + " |", "|" + "---|" * (len(head) + 1)]
    for r in rows:
        us = [f"{r['us'][v]:.1f}" for v in VARIANTS]
        sp = [f"{r['speedup'][v]:.2f}" for v in RATIO_VARIANTS]
        out.append("| " + " | ".join([str(r["N"]), str(r["K"]), str(r["M"]), *us, *sp, r["plan"]]) + " |")
    out += ["", "## Targets (issue 49)", ""] + [f"- {line}" for line in target_report(rows)]
    return "\n".join(out) + "\n"


def short_table(rows: list[dict]) -> str:
    """Geomean speedup over bf16 across shapes, one line per M."""
    widths = [-7] + [12] * len(RATIO_VARIANTS)
    lines = [text_row(["M", *RATIO_VARIANTS], widths, sep="")]
    for m in sorted({r["M"] for r in rows}):
        at = [r for r in rows if r["M"] == m]
        cells = [geomean(r["speedup"][v] for r in at) for v in RATIO_VARIANTS]
        lines.append(text_row([m, *(f"{c:.2f}x" for c in cells)], widths, sep=""))
    return "\n".join(lines)


def parse_list(flag: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"{flag} takes positive integers, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 shapes x 3 M")
    ap.add_argument("--ms", help="comma-separated M values instead of 1,16,64,256,1024,4096")
    ap.add_argument("--group", type=int, default=128, help="weight group size (default 128; -1: per channel)")
    ap.add_argument("--smoke", action="store_true", help="CPU plumbing check (needs TRITON_INTERPRET=1)")
    ap.add_argument("--flat-sweep", action="store_true", help="only bf16 and the FLAT_SWEEP tiles of the flat kernel")
    ap.add_argument("--prog-sweep", action="store_true", help="only bf16 and the PROG_SWEEP tiles, progressive kernel")
    ap.add_argument(
        "--prog-small-sweep",
        action="store_true",
        help="bf16, W4A16, the default and the PROG_SMALL_SWEEP tiles of the progressive kernel at M 1, 16",
    )
    add_out_argument(ap, "w4a8")
    args = ap.parse_args(argv)
    if args.group != -1 and (args.group < 32 or args.group % 32):
        raise SystemExit(f"--group must be -1 or a positive multiple of 32, got {args.group}")

    device = kernel_device(args.smoke)
    timer = Timer(smoke=True, warmup_ms=0, rep_ms=0) if args.smoke else Timer(smoke=False, warmup_ms=10, rep_ms=50)
    shapes = SMOKE_SHAPES if args.smoke else QUICK_SHAPES if args.quick else LLAMA_SHAPES
    ms = SMOKE_MS if args.smoke else QUICK_MS if args.quick else MS
    if args.ms:
        ms = parse_list("--ms", args.ms)
    group = SMOKE_GROUP if args.smoke and args.group == 128 else args.group
    out_dir = out_folder(args.out)
    env = {**environment(device), "group": group, "configs": "committed w4a8 CONFIG_TABLE (untuned)"}
    t_start = time.perf_counter()

    def save_rows(rows: list[dict]) -> None:
        env["seconds"] = round(time.perf_counter() - t_start)
        (out_dir / "w4a8_results.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))

    if args.flat_sweep or args.prog_sweep or args.prog_small_sweep:
        small = args.prog_small_sweep
        configs = PROG_SWEEP if args.prog_sweep else PROG_SMALL_SWEEP if small else FLAT_SWEEP
        sweep_shapes = shapes if args.smoke or small else QUICK_SHAPES
        sweep_ms = ms if args.smoke or args.ms else SMALL_SWEEP_MS if small else SWEEP_MS
        variants = ["w4a16"] if small else []
        variants += [("prog", cfg) for cfg in configs] if args.prog_sweep or small else configs
        if small:  # the dp4a GEMV at M = 1; programmatic dependent launch after the quantizer (GPU only)
            variants += [("prog-gemv", PROG_SMALL)] + [("prog-pdl", PROG_SMALL)] * (device == "cuda")
        names = [variant_name(v) for v in variants]
        print("speedup over bf16 cuBLAS per variant, in this order:")
        for i, name in enumerate(names):
            print(f"  {i}: {name}")
        rows = run_sweep(sweep_shapes, sweep_ms, group, timer, device, variants)
        env["seconds"] = round(time.perf_counter() - t_start)
        name = "prog_small" if small else "prog" if args.prog_sweep else "flat"
        (out_dir / f"w4a8_{name}_sweep.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
        for i, name in enumerate(names):
            by_m = "  ".join(
                f"M={m}: {geomean(r['speedup'][name] for r in rows if r['M'] == m):.2f}x" for m in sweep_ms
            )
            print(f"geomean {i} {name}: {by_m}")
        return 0
    rows = run_table(shapes, ms, group, timer, device, save_rows)
    (out_dir / "w4a8_results.md").write_text(table_markdown(rows, env))
    print(f"\n{env['device']}, {env['date']}, {env['seconds']} s; full results in {out_dir}/w4a8_results.{{json,md}}")
    print("geomean speedup over bf16 cuBLAS across shapes (end to end: quantize + GEMM + epilogue):")
    print(short_table(rows))
    for line in target_report(rows):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
