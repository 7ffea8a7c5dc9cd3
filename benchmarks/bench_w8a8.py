"""W8A8 end-to-end speed against cuBLAS on one GPU, correctness checked first.

Every figure goes from bf16 activations x [M, K] to a bf16 output [M, N] and is timed in the same run as bf16 cuBLAS:

  bf16            F.linear(x, W_bf16): cuBLAS, the baseline of every ratio
  int8            quantize_activations + w8a8_matmul (ours, Triton): the end-to-end figure
  int8_gemm       w8a8_matmul alone on pre-quantized activations (ours), to split the cost
  quant           quantize_activations alone (int8; fp8 costs the same)
  int_mm          our quantizer + torch._int_mm(qa, W.t()) + a PyTorch epilogue; cuBLAS int8 needs M > 16, so
                  M <= 16 runs on INT_MM_ROWS = 32 zero-padded rows
  fp8             quantize_activations + w8a8_matmul, fp8, partial sums promoted to fp32 every BLOCK_K
  fp8_fast        the same, accumulating in the tensor core throughout (fp8_fast_accum=True)
  scaled_mm       our fp8 quantizer + torch._scaled_mm with row-wise scales, use_fast_accum=False
  scaled_mm_fast  the same with use_fast_accum=True
  fp8_block       block-wise fp8 (w8a8-fp8-block, DeepSeek-V3): 1 x 128 activation tiles + the block GEMM with
                  128 x 128 weight-block scales applied in its K loop (quantkit.kernels.w8a8.block)
  --block mode only:
  fp8_block_gemm  the block GEMM alone on pre-quantized activations (M-major scales), to split the cost
  block_quant     the 1 x 128 tile quantizer alone (quantize_tiles, M-major scales)
  block_quant_4   the same with four tiles per program along K (tiles_per_program=4; the default is
                  block.QUANT_TILES)
  fp8_block_ws2   fp8_block with the warp-specialized Hopper kernel, two consumer warp groups (128 x 128 tiles), at
                  M >= 64 (the dispatch uses it from block.WS_FROM_M rows, and from WS_ONE_WAVE_FROM_M where its
                  output tiles make one wave), to place those thresholds
  fp8_block_ws3   the same with three consumer warp groups (192 x 128 tiles; block.WS3_FROM_M)
  fp8_block_fused / fp8_block_unfused
                  fp8_block with the activation tiles quantized inside the GEMM (fuse_quant=True, below
                  block.WS_ONE_WAVE_FROM_M rows; the dispatch does so up to block.FUSED_QUANT_MAX_M rows, i.e.
                  never) / by quantize_tiles first (fuse_quant=False, M <= 64)

Timing: a CUDA graph of R calls over R rotated copies of every operand (R chosen so that they span more than 3x
the 60 MB L2), replayed under ``triton.testing.do_bench(return_mode="median")``, which also flushes L2 before each
replay; the time per call is the replay time / R. The graph removes Python launch overhead, which would otherwise
dominate the small-M figures.

Modes (JSON + markdown written under --out, default out/w8a8; a short table is printed last):
  python benchmarks/bench_w8a8.py                       full table, 6 shapes x 7 M
  python benchmarks/bench_w8a8.py --quick               2 shapes x 3 M
  python benchmarks/bench_w8a8.py --deepseek            DeepSeek-V3's own layer shapes x 7 M
  python benchmarks/bench_w8a8.py --block               block fp8 only: the Llama and DeepSeek-V3 shapes x 7 M,
                                                        with the GEMM, the quantizer and the Gluon kernel apart
  python benchmarks/bench_w8a8.py --sweep               time tile candidates per (format, M regime), print the
                                                        winners as a CONFIGS block to commit
  python benchmarks/bench_w8a8.py --sweep-block         time block-fp8 tile candidates per M regime (end to end)
  python benchmarks/bench_w8a8.py --configs SWEEP.json  full table with a sweep's winners instead of CONFIGS
  TRITON_INTERPRET=1 python benchmarks/bench_w8a8.py --smoke  CPU plumbing check in Triton's interpreter: tiny
                                                        shapes, wall-clock timing, numbers meaningless
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

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
from quantkit.kernels import w8a8 as K
from quantkit.kernels.w8a8 import block as KB
from quantkit.kernels.w8a8 import ws as WS
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from quantkit.algorithms.fp8 import quantize_fp8

ROTATE_SPAN = 3 * L2_BYTES
MAX_ROTATIONS = 64
SHAPES = LLAMA_SHAPES  # (N, K)
# DeepSeek-V3's (N, K): dense down_proj, dense gate/up, fused q_a + kv_a, an expert's gate/up, q_b_proj, kv_b_proj
DEEPSEEK_SHAPES = [(7168, 18432), (18432, 7168), (2112, 7168), (7168, 2048), (24576, 1536), (32768, 512)]
BLOCK = 128
MS = [1, 16, 64, 256, 1024, 4096, 16384]
QUICK_SHAPES = [(4096, 4096), (28672, 8192)]
QUICK_MS = [16, 1024, 4096]
SMOKE_SHAPES = [(96, 64), (48, 160)]
SMOKE_MS = [1, 20, 70]
INT_MM_ROWS = 32  # cuBLAS int8 (torch._int_mm) requires M > 16: smaller M is padded to this many rows
TARGETS = [  # (format variant, M range, minimum speedup over bf16) from issue 7
    ("int8", (1024, None), 1.3),
    ("int8", (16, 64), 1.6),
    ("fp8", (1024, None), 1.6),  # the default: partial sums promoted to fp32 every BLOCK_K (DeepSeek-V3)
    ("fp8_fast", (1024, None), 1.6),  # the option fp8_fast_accum=True (vLLM's choice for per-token scales)
    ("fp8_block", (1024, None), 1.5),  # issue 50: block-wise fp8
    ("fp8_block", (1, 64), 1.4),
]
VARIANTS = ["bf16", "int8", "int8_gemm", "quant", "int_mm", "fp8", "fp8_fast", "scaled_mm", "scaled_mm_fast",
            "fp8_block"]  # fmt: skip
RATIO_VARIANTS = ["int8", "int_mm", "fp8", "fp8_fast", "scaled_mm", "scaled_mm_fast", "fp8_block"]
BLOCK_VARIANTS = ["bf16", "fp8", "fp8_block", "fp8_block_gemm", "block_quant", "fp8_block_ws2", "fp8_block_ws3",
                  "fp8_block_fused", "fp8_block_unfused", "block_quant_4"]  # fmt: skip
BLOCK_RATIO_VARIANTS = ["fp8", "fp8_block", "fp8_block_gemm", "fp8_block_ws2", "fp8_block_ws3", "fp8_block_fused",
                        "fp8_block_unfused"]  # fmt: skip
VARIANT_MS = {"fp8_block_ws2": (64, MS[-1]), "fp8_block_ws3": (64, MS[-1]),
              "fp8_block_fused": (1, KB.WS_ONE_WAVE_FROM_M - 1),  # fp8_block_linear refuses to fuse from there
              "fp8_block_unfused": (1, 64)}  # fmt: skip
# variants a GPU or cuBLAS may refuse (reported as n/a)
OPTIONAL = ("int_mm", "scaled_mm", "scaled_mm_fast", "fp8_block_ws2", "fp8_block_ws3")
# bf16 computes from unquantized operands; the quantizers give no y
UNCHECKED = ("bf16", "quant", "block_quant", "block_quant_4")

# Sweep candidates per M regime, as K.CONFIG_KEYS tuples (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, USE_TMA, num_warps,
# num_stages), the same for int8 and fp8. Small M is weight-bandwidth bound: narrow N tiles give enough CTAs to fill
# 132 SMs and deep K pipelines keep bytes in flight; large M is tensor-core bound: wide tiles for operand reuse.
# Each regime tries pointer loads and TMA; large M also the persistent TMA kernel.
SWEEP_CANDIDATES = {
    "m16": [
        (16, 64, 256, 1, 0, 4, 4),
        (16, 32, 256, 1, 0, 4, 5),
        (16, 128, 128, 1, 0, 4, 4),
        (16, 64, 256, 1, 1, 4, 4),
        (16, 32, 256, 1, 1, 4, 6),
    ],
    "m64": [
        (64, 64, 256, 1, 0, 4, 4),
        (64, 128, 128, 1, 0, 4, 4),
        (32, 64, 256, 1, 0, 4, 4),
        (64, 64, 256, 1, 1, 4, 4),
        (64, 128, 128, 1, 1, 4, 4),
    ],
    "m256": [
        (128, 128, 128, 8, 0, 8, 4),
        (64, 128, 128, 8, 0, 4, 4),
        (128, 128, 128, 8, 1, 8, 4),
        (128, 256, 128, 8, 1, 8, 3),
        (64, 256, 128, 8, 1, 4, 4),
    ],
    "large": [
        (128, 256, 128, 8, 0, 8, 3),
        (128, 256, 128, 8, 1, 8, 3),
        (256, 128, 128, 8, 1, 8, 3),
        (128, 128, 128, 8, 1, 8, 4),
        (128, 256, 64, 8, 1, 8, 4),
        (256, 128, 128, 8, 2, 8, 3),  # persistent (USE_TMA 2)
        (128, 256, 128, 8, 2, 8, 3),
    ],
}
SWEEP_MS = {"m16": [1, 16], "m64": [32], "m256": [256], "large": [1024, 4096]}  # m64's entry serves M 17-32
# Block-fp8 candidates (KB.BlockConfig: BLOCK_M, BLOCK_N, GROUP_M, split_waves, num_warps, num_stages) per regime of
# KB.TILE_CONFIGS; BLOCK_K is the quantization block. Small M: narrow tiles, K split over the SMs. (M > 256 runs the
# warp-specialized kernel on Hopper, whose tiles are fixed.)
BLOCK_SWEEP = {
    16: [(16, 64, 1, 2, 4, 4), (16, 64, 1, 1, 4, 5), (16, 128, 1, 2, 4, 3), (16, 64, 1, 2, 4, 6)],
    32: [(32, 64, 1, 2, 4, 4), (16, 64, 1, 2, 4, 4), (32, 64, 1, 1, 4, 5), (32, 128, 1, 2, 4, 4),
         (32, 32, 1, 2, 4, 4)],
    64: [(64, 64, 1, 1, 4, 4), (64, 64, 1, 1, 4, 5), (64, 32, 1, 1, 4, 4), (32, 64, 1, 1, 4, 4), (64, 64, 1, 1, 8, 4),
         (64, 128, 1, 1, 8, 4), (64, 64, 1, 2, 4, 4), (32, 64, 1, 2, 4, 4)],
    256: [(64, 128, 8, 0, 4, 4), (64, 64, 8, 1, 4, 4), (64, 128, 8, 0, 4, 5), (128, 64, 8, 0, 4, 4)],
}  # fmt: skip
BLOCK_SWEEP_MS = {16: [1, 16], 32: [32], 64: [64], 256: [256]}
SMOKE_SWEEP_CANDIDATES = {r: [(16, 32, 32, 1, 0, 4, 2), (16, 16, 64, 2, 1, 4, 2)] for r in SWEEP_CANDIDATES}
SMOKE_SWEEP_MS = {"m16": [1], "m64": [20], "m256": [70], "large": [300]}


def rotations_for(m: int, n: int, k: int) -> int:
    """How many operand copies make one pass over them span ROTATE_SPAN bytes (int8 weights, the smallest)."""
    return rotations(n * k + 2 * m * k + 2 * m * n, span=ROTATE_SPAN, most=MAX_ROTATIONS)


# -- operands and variants ---------------------------------------------------------------------------------------


class Problem:
    """R rotated copies of every operand of one (N, K, M) point; weights quantized per channel (RTN)."""

    def __init__(self, n: int, k: int, m: int, device: str, seed: int, r: int | None = None) -> None:
        self.n, self.k, self.m = n, k, m
        self.r = r if r is not None else rotations_for(m, n, k)
        g = torch.Generator(device=device).manual_seed(seed)
        self.x, self.w16, self.wq = [], [], {"int8": [], "fp8": []}
        self.w_scale = {"int8": [], "fp8": []}
        self.qa = {"int8": [], "fp8": []}
        self.a_scale = {"int8": [], "fp8": []}
        self.block = []  # (weight codes, block scales) per rotation
        for _ in range(self.r):
            x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
            w = (torch.randn(n, k, generator=g, device=device) * 0.02).to(torch.bfloat16)
            self.x.append(x)
            self.w16.append(w)
            self.block.append(quantize_fp8(w, "block", BLOCK))
            for fmt in ("int8", "fp8"):
                q, s = K.quantize_rows_reference(w, fmt)
                self.wq[fmt].append(q)
                self.w_scale[fmt].append(s)
                qa, sa = K.quantize_activations_reference(x, fmt)
                self.qa[fmt].append(qa)
                self.a_scale[fmt].append(sa)
        self.qa_pad = [
            torch.zeros(INT_MM_ROWS, k, dtype=torch.int8, device=device) if m <= 16 else None for _ in range(self.r)
        ]
        self._reference = {}

    def calls(self, variant: str, config: dict | None = None) -> list:
        """One zero-argument callable per rotation, each returning the bf16 output [M, N]."""
        return [self._call(variant, i, config) for i in range(self.r)]

    def _call(self, variant: str, i: int, config: dict | None):
        x, m = self.x[i], self.m
        fmt = "fp8" if variant.startswith(("fp8", "scaled_mm")) else "int8"
        wq, ws = self.wq[fmt][i], self.w_scale[fmt][i]
        if variant == "bf16":
            return lambda: F.linear(x, self.w16[i])
        if variant in ("int8", "fp8", "fp8_fast"):
            fast = variant == "fp8_fast"
            return lambda: K.w8a8_linear(x, wq, ws, config=config, fp8_fast_accum=fast)
        if variant == "fp8_block":
            qb, sb = self.block[i]
            block_config = config if isinstance(config, KB.BlockConfig) else None
            return lambda: KB.fp8_block_linear(x, qb, sb, BLOCK, config=block_config)
        if variant == "fp8_block_gemm":
            qb, sb = self.block[i]
            qa, sa = KB.quantize_tiles(x, BLOCK, m_major=True)
            return lambda: KB.fp8_block_matmul(qa, sa, qb, sb, BLOCK, out_dtype=torch.bfloat16)
        if variant in ("fp8_block_fused", "fp8_block_unfused"):
            qb, sb = self.block[i]
            fuse = variant == "fp8_block_fused"
            return lambda: KB.fp8_block_linear(x, qb, sb, BLOCK, fuse_quant=fuse)
        if variant in ("block_quant", "block_quant_4"):
            tiles = 4 if variant == "block_quant_4" else None
            return lambda: KB.quantize_tiles(x, BLOCK, m_major=True, tiles_per_program=tiles)
        if variant in ("fp8_block_ws2", "fp8_block_ws3"):
            qb, sb = self.block[i]
            out = torch.empty(m, self.n, dtype=torch.bfloat16, device=x.device)
            reason = WS.block_unsupported(KB.quantize_tiles(x, BLOCK)[0], qb, out, BLOCK) if x.is_cuda else "CPU"
            if reason:
                raise RuntimeError(f"warp-specialized block kernel unavailable: {reason}")

            def block_ws():
                qa, sa = KB.quantize_tiles(x, BLOCK, m_major=True)
                return WS.launch_block(qa, sa, qb, sb, None, out, consumers=int(variant[-1]))

            return block_ws
        if variant == "int8_gemm":
            qa, sa = self.qa["int8"][i], self.a_scale["int8"][i]
            return lambda: K.w8a8_matmul(qa, sa, wq, ws, out_dtype=torch.bfloat16, config=config)
        if variant == "quant":
            return lambda: K.quantize_activations(x, "int8")
        if variant == "int_mm":
            pad = self.qa_pad[i]

            def int_mm():
                if pad is None:
                    qa, sa = K.quantize_activations(x, "int8")
                    acc = torch._int_mm(qa, wq.t())
                else:
                    _, sa = K.quantize_activations(x, "int8", out=pad[:m])
                    acc = torch._int_mm(pad, wq.t())[:m]
                return (acc.float() * sa[:, None] * ws[None, :]).to(torch.bfloat16)

            return int_mm
        if variant in ("scaled_mm", "scaled_mm_fast"):
            fast = variant == "scaled_mm_fast"

            def scaled_mm():
                qa, sa = K.quantize_activations(x, "fp8")
                return torch._scaled_mm(
                    qa, wq.t(), sa[:, None], ws[None, :], out_dtype=torch.bfloat16, use_fast_accum=fast
                )

            return scaled_mm
        raise ValueError(f"unknown variant {variant!r}")

    def reference(self, fmt: str) -> torch.Tensor:
        """fp32 GEMM of rotation 0's quantized operands, scaled in fp32 (close enough to judge bf16 outputs)."""
        if fmt == "fp8_block" and fmt not in self._reference:
            qa, sa = KB.quantize_tiles_reference(self.x[0], BLOCK)
            self._reference[fmt] = KB.fp8_block_matmul_reference(qa, sa, *self.block[0], BLOCK, None, torch.float32)
        if fmt not in self._reference:
            qa, sa = self.qa[fmt][0], self.a_scale[fmt][0]
            acc = qa.float() @ self.wq[fmt][0].float().t()
            self._reference[fmt] = acc * sa[:, None] * self.w_scale[fmt][0][None, :]
        return self._reference[fmt]

    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k


def rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm().clamp(min=1e-30)).item()


MAX_REL_ERROR = 4e-3  # bf16 output rounding alone is ~2e-3 relative (rms); fp8 fast accumulation adds a little
# PyTorch's fp8 fast-accumulation baseline keeps partial sums in Hopper's ~14-bit accumulator over the whole K:
# at K = 28672 it measured 4.7e-3. Baselines are only timed, so they get a looser bound than quantkit's kernels.
MAX_REL_ERROR_BASELINE = 2e-2


def check(problem: Problem, variant: str, y: torch.Tensor) -> float:
    fmt = (
        "fp8_block"
        if variant.startswith("fp8_block")
        else "fp8"
        if variant.startswith(("fp8", "scaled_mm"))
        else "int8"
    )
    err = rel_error(y, problem.reference(fmt))
    fast_accumulation = variant.startswith(("scaled_mm", "int_mm")) or variant.endswith("_fast")
    bound = MAX_REL_ERROR_BASELINE if fast_accumulation else MAX_REL_ERROR
    if not err <= bound:
        raise AssertionError(f"{variant} N={problem.n} K={problem.k} M={problem.m}: relative error {err:.3g}")
    return err


def quantizer_mismatches(problem: Problem) -> int:
    """Codes where the Triton quantizer and the PyTorch reference differ (expected: 0)."""
    bad = 0
    for fmt in ("int8", "fp8"):
        qa, sa = K.quantize_activations(problem.x[0], fmt)
        bad += int((qa.view(torch.uint8) != problem.qa[fmt][0].view(torch.uint8)).sum())
        bad += int((sa != problem.a_scale[fmt][0]).sum())
    return bad


# -- full table ----------------------------------------------------------------------------------------------------


def run_table(shapes, ms, timer: Timer, device: str, configs: dict | None, save, variants=None, ratios=None):
    """One row per (shape, M); ``save(rows)`` after every row, so a run cut short still leaves its results."""
    variants, ratios = variants or VARIANTS, ratios or RATIO_VARIANTS
    rows = []
    for n, k in shapes:
        for m in ms:
            t0 = time.perf_counter()
            p = Problem(n, k, m, device, seed=n + k + m, r=1 if timer.smoke else None)
            row = {"N": n, "K": k, "M": m, "R": p.r, "quant_mismatches": quantizer_mismatches(p), "us": {}, "err": {}}
            for variant in variants:
                lo, hi = VARIANT_MS.get(variant, (0, m))
                if not lo <= m <= hi:
                    continue
                fmt = "fp8" if variant.startswith(("fp8", "scaled_mm")) else "int8"
                cfg = configs.get((fmt, K.m_regime(m))) if configs else None
                try:
                    calls = p.calls(variant, cfg)
                    y = calls[0]()
                except (RuntimeError, CompilationError, OutOfResources) as e:  # reported where optional, else fatal
                    if variant in (
                        "bf16",
                        "int8",
                        "int8_gemm",
                        "quant",
                        "fp8",
                        "fp8_fast",
                        "fp8_block",
                        "fp8_block_gemm",
                    ):
                        raise
                    row["us"][variant] = None
                    row["err"][variant] = f"unsupported: {str(e).splitlines()[0][:120]}"
                    continue
                if variant not in UNCHECKED:
                    row["err"][variant] = check(p, variant, y)
                row["us"][variant] = timer.per_call(calls)
            base = row["us"]["bf16"]
            row["speedup"] = {v: base / row["us"][v] for v in ratios if row["us"].get(v)}
            row["bf16_tflops"] = p.flops() / (base * 1e-6) / 1e12
            if row["us"].get("int8"):
                row["int8_tops"] = p.flops() / (row["us"]["int8"] * 1e-6) / 1e12
                row["int8_weight_tbps"] = n * k / (row["us"]["int8"] * 1e-6) / 1e12
            rows.append(row)
            save(rows)
            cells = "  ".join(f"{v} {row['speedup'][v]:.2f}x" for v in ratios if v in row["speedup"])
            print(
                f"N={n:6d} K={k:6d} M={m:6d}  bf16 {base:9.1f} us  {cells}  [{time.perf_counter() - t0:.1f} s]",
                flush=True,
            )
            del p
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def target_report(rows: list[dict]) -> list[str]:
    lines = []
    for variant, (lo, hi), goal in TARGETS:
        got = [
            r["speedup"][variant]
            for r in rows
            if variant in r["speedup"] and r["M"] >= lo and (hi is None or r["M"] <= hi)
        ]
        if not got:
            continue
        worst, gm = min(got), geomean(got)
        verdict = "met" if worst >= goal else ("met on geomean only" if gm >= goal else "NOT met")
        span = f"M >= {lo}" if hi is None else f"M {lo}-{hi}"
        lines.append(f"{variant} {span}: target {goal:.1f}x, worst {worst:.2f}x, geomean {gm:.2f}x -> {verdict}")
    return lines


def table_markdown(rows: list[dict], env: dict, variants=None, ratios=None) -> str:
    variants, ratios = variants or VARIANTS, ratios or RATIO_VARIANTS
    head = ["N", "K", "M", "bf16 us"] + [f"{v} us" for v in variants[1:]] + [f"{v} x" for v in ratios]
    out = [f"# W8A8 vs bf16 cuBLAS, {env['device']}, {env['date']}", "", "```", json.dumps(env, indent=1), "```", ""]
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        us = [f"{r['us'][v]:.1f}" if r["us"].get(v) else "n/a" for v in variants]
        sp = [f"{r['speedup'][v]:.2f}" if v in r["speedup"] else "n/a" for v in ratios]
        out.append("| " + " | ".join([str(r["N"]), str(r["K"]), str(r["M"]), *us, *sp]) + " |")
    out += ["", "## Targets (issue 7)", ""] + [f"- {line}" for line in target_report(rows)]
    return "\n".join(out) + "\n"


def short_table(rows: list[dict], ratios=None) -> str:
    """Geomean speedup over bf16 across shapes, one line per M."""
    ratios = ratios or RATIO_VARIANTS
    widths = [-9] + [max(16, len(v) + 2) for v in ratios]
    lines = [text_row(["M", *ratios], widths, sep="")]
    for m in sorted({r["M"] for r in rows}):
        at = [r for r in rows if r["M"] == m]
        cells = [geomean([r["speedup"][v] for r in at if v in r["speedup"]] or [float("nan")]) for v in ratios]
        lines.append(text_row([m, *(f"{c:.2f}x" for c in cells)], widths, sep=""))
    return "\n".join(lines)


# -- sweep ---------------------------------------------------------------------------------------------------------


def as_config(cand: tuple) -> dict[str, int]:
    return dict(zip(K.CONFIG_KEYS, cand, strict=True))


def run_sweep(shapes, timer: Timer, device: str, candidates: dict, sweep_ms: dict, save) -> dict:
    """GEMM-only time (the quantizer does not depend on the tile config) of every candidate; the winner per
    (format, regime) has the smallest geometric-mean time over the regime's shapes and M values."""
    results, winners = [], {}
    for regime, cands in candidates.items():
        points = [(n, k, m) for n, k in shapes for m in sweep_ms[regime]]
        times = {(fmt, c): [] for fmt in ("int8", "fp8") for c in cands}
        for n, k, m in points:
            p = Problem(n, k, m, device, seed=n + k + m, r=1 if timer.smoke else None)
            for fmt in ("int8", "fp8"):
                qa, sa = p.qa[fmt], p.a_scale[fmt]
                ref = p.reference(fmt)
                for c in cands:
                    cfg = as_config(c)
                    calls = [
                        partial(K.w8a8_matmul, qa[i], sa[i], p.wq[fmt][i], p.w_scale[fmt][i], None, torch.bfloat16)
                        for i in range(p.r)
                    ]
                    calls = [partial(c_, config=cfg) for c_ in calls]
                    record = {"fmt": fmt, "regime": regime, "cand": c, "N": n, "K": k, "M": m}
                    try:
                        y = calls[0]()
                    except (OutOfResources, CompilationError, RuntimeError) as e:
                        # a candidate this GPU / Triton cannot build (shared memory, unsupported layout): recorded
                        # with its reason and never the winner, instead of ending the sweep
                        print(f"  candidate {c} {fmt}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
                        times[(fmt, c)].append(float("inf"))
                        results.append({**record, "us": None, "why": str(e)[:120]})
                        continue
                    err = rel_error(y, ref)
                    if not err <= MAX_REL_ERROR:
                        raise AssertionError(f"candidate {c} {fmt} N={n} K={k} M={m}: relative error {err:.3g}")
                    us = timer.per_call(calls)
                    times[(fmt, c)].append(us)
                    results.append({**record, "us": us})
            del p
        for fmt in ("int8", "fp8"):
            scored = sorted((geomean(times[(fmt, c)]), c) for c in cands)
            best_score, best = scored[0]
            current = K.CONFIGS[(fmt, regime)]
            cur_t = next((s for s, c in scored if K.TileConfig(*c) == current), None)
            winners[f"{fmt}/{regime}"] = as_config(best)
            gain = f", {cur_t / best_score:.2f}x over the committed config" if cur_t else ""
            print(f"{fmt:5s} {regime:6s} winner {best}  geomean {best_score:.1f} us{gain}", flush=True)
        save({"winners": winners, "results": results})  # after every regime: a run cut short keeps the finished ones
    return {"winners": winners, "results": results}


def run_block_sweep(shapes, timer: Timer, device: str, save) -> dict:
    """End-to-end time of every block-fp8 candidate (``BLOCK_SWEEP``); the winner per regime has the smallest
    geometric-mean time over the regime's shapes and M values."""
    results, winners = [], {}
    hopper = device == "cuda" and torch.cuda.get_device_capability() >= (9, 0)
    for max_m, cands in BLOCK_SWEEP.items():
        if hopper and max_m >= KB.WS_FROM_M:  # the warp-specialized kernel serves these rows: the tiles go unused
            print(f"block M<={max_m}: skipped, the warp-specialized kernel serves M >= {KB.WS_FROM_M} here")
            continue
        times = {c: [] for c in cands}
        for n, k in shapes:
            for m in BLOCK_SWEEP_MS[max_m]:
                p = Problem(n, k, m, device, seed=n + k + m)
                base = timer.per_call(p.calls("bf16"))
                for c in cands:
                    calls = p.calls("fp8_block", KB.BlockConfig(*c))
                    check(p, "fp8_block", calls[0]())
                    us = timer.per_call(calls)
                    times[c].append(us)
                    results.append({"max_m": max_m, "cand": c, "N": n, "K": k, "M": m, "us": us, "bf16_us": base})
                del p
        scored = sorted((geomean(times[c]), c) for c in cands)
        winners[str(max_m)] = scored[0][1]
        for score, c in scored:
            print(f"block M<={max_m:<10d} {KB.BlockConfig(*c).name:24s} geomean {score:8.1f} us", flush=True)
        save({"winners": winners, "results": results})
    return {"winners": winners, "results": results}


def tuned_on(env: dict) -> str:
    return f"{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}"


def configs_block(winners: dict, label: str) -> str:
    """The CONFIGS literal to commit: the sweep's winners, the committed config where a regime has none."""
    lines = [f"# tuned on {label}", "CONFIGS: dict[tuple[str, str], TileConfig] = {"]
    for fmt, (regime, _) in ((f, r) for f in ("int8", "fp8") for r in K.M_REGIMES):
        cfg = winners.get(f"{fmt}/{regime}")
        tile = K.TileConfig.from_dict(cfg) if cfg else K.CONFIGS[(fmt, regime)]
        values = ", ".join(str(v) for v in tile.to_dict().values())
        lines.append(f'    ("{fmt}", "{regime}"): TileConfig({values}),')
    return "\n".join([*lines, "}"])


# -- main ----------------------------------------------------------------------------------------------------------


def load_configs(path: Path) -> dict:
    winners = json.loads(path.read_text())["winners"]
    return {tuple(key.split("/")): cfg for key, cfg in winners.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="2 shapes x 3 M")
    mode.add_argument("--deepseek", action="store_true", help="DeepSeek-V3's layer shapes x 7 M")
    mode.add_argument("--block", action="store_true", help="block fp8 only, Llama and DeepSeek-V3 shapes x 7 M")
    mode.add_argument("--sweep", action="store_true", help="time tile candidates, print and save the winners")
    mode.add_argument("--sweep-block", action="store_true", help="time block-fp8 tile candidates, all 12 shapes")
    ap.add_argument("--configs", type=Path, metavar="SWEEP_JSON", help="use a sweep's winners instead of CONFIGS")
    ap.add_argument("--smoke", action="store_true", help="CPU plumbing check (needs TRITON_INTERPRET=1)")
    add_out_argument(ap, "w8a8")
    args = ap.parse_args(argv)

    device = kernel_device(args.smoke)
    timer = Timer(smoke=True, warmup_ms=0, rep_ms=0) if args.smoke else Timer(smoke=False, warmup_ms=10, rep_ms=50)
    out_dir = out_folder(args.out)
    env = {**environment(device), "configs": "committed CONFIGS"}
    t_start = time.perf_counter()

    if args.sweep:
        shapes = SMOKE_SHAPES if args.smoke else SHAPES
        cands = SMOKE_SWEEP_CANDIDATES if args.smoke else SWEEP_CANDIDATES
        path = out_dir / "w8a8_sweep.json"

        def save_sweep(sweep: dict) -> None:
            path.write_text(json.dumps({**sweep, "env": env}, indent=1))

        sweep = run_sweep(shapes, timer, device, cands, SMOKE_SWEEP_MS if args.smoke else SWEEP_MS, save_sweep)
        print(f"\nsweep took {time.perf_counter() - t_start:.0f} s; saved {path}. CONFIGS to commit:\n")
        print(configs_block(sweep["winners"], tuned_on(env)))
        return 0

    if args.sweep_block:
        path = out_dir / "block_sweep.json"
        shapes = SHAPES + DEEPSEEK_SHAPES
        sweep = run_block_sweep(shapes, timer, device, lambda d: path.write_text(json.dumps({**d, "env": env})))
        print(f"\nblock sweep took {time.perf_counter() - t_start:.0f} s; winners {sweep['winners']}; saved {path}")
        return 0

    if args.smoke:
        shapes, ms = SMOKE_SHAPES, SMOKE_MS
    elif args.quick:
        shapes, ms = QUICK_SHAPES, QUICK_MS
    elif args.deepseek:
        shapes, ms = DEEPSEEK_SHAPES, MS
    elif args.block:
        shapes, ms = SHAPES + DEEPSEEK_SHAPES, MS
    else:
        shapes, ms = SHAPES, MS
    variants, ratios = (BLOCK_VARIANTS, BLOCK_RATIO_VARIANTS) if args.block else (VARIANTS, RATIO_VARIANTS)
    configs = load_configs(args.configs) if args.configs else None
    if configs:
        env["configs"] = f"sweep winners from {args.configs}"

    def save_rows(rows: list[dict]) -> None:
        env["seconds"] = round(time.perf_counter() - t_start)
        (out_dir / "w8a8_results.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))

    rows = run_table(shapes, ms, timer, device, configs, save_rows, variants, ratios)
    (out_dir / "w8a8_results.md").write_text(table_markdown(rows, env, variants, ratios))
    print(f"\n{env['device']}, {env['date']}, {env['seconds']} s; full results in {out_dir}/w8a8_results.{{json,md}}")
    print("geomean speedup over bf16 cuBLAS across shapes (end to end: quantize + GEMM + epilogue):")
    print(short_table(rows, ratios))
    for line in target_report(rows):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
