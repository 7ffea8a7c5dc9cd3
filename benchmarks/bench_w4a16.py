"""W4A16 speed against cuBLAS fp16 on one GPU, correctness checked first.

Every figure maps fp16 activations x [M, K] to an fp16 output [M, N] and is timed in the same run as cuBLAS:

  fp16     F.linear(x, W_fp16): cuBLAS, the baseline of every ratio
  w4a16    quantkit.kernels.w4a16.w4a16_linear with the committed table: what QuantLinear runs on CUDA (for M
           in the warp-specialized kernel's rows, w4a16_ws.WS_TABLE, that kernel; "triton" then times the
           regime table's Triton config in the same run)
  dequant  Triton dequantize to [K, N] + cuBLAS (M >= 128 only, to show where it crosses the fused kernel)

Weights are 4-bit GPTQ-v2 (random codes and zeros, fp16 scales), groups 128 and 64. "weight TB/s" counts the bytes
of qweight + qzeros + scales once per call; "% copy" compares it with the device-to-device copy bandwidth measured
in the same run (read + write bytes). Correctness: before timing, each (shape, group) is checked at a few M against
a float64 reference with flash-attn's rule (error <= 2x cuBLAS fp16's own error + a floor of 2**-20 max|y|).

Timing: a CUDA graph of R calls over R rotated copies of every operand (R chosen so that they span more than 2x the
60 MB L2), replayed under ``triton.testing.do_bench(return_mode="median")``, which also flushes L2 before each
replay; time per call = replay time / R. The graph removes Python launch overhead, as in a captured decode step.

Modes (JSON + markdown written under --out, default out/w4a16; a short table is printed last):
  python benchmarks/bench_w4a16.py                    full table: 6 shapes x 11 M x groups {128, 64}
  python benchmarks/bench_w4a16.py --quick            smoke test on the GPU: 2 shapes x 4 M, group 128
  python benchmarks/bench_w4a16.py --sweep            time SWEEP candidates per M regime, write sweep.json, print
                                                      the winners as a CONFIG_TABLE literal to commit
  python benchmarks/bench_w4a16.py --sweep --table    the sweep, then the full table with its winners (one run)
  python benchmarks/bench_w4a16.py --configs S.json   full table with a sweep's winners instead of CONFIG_TABLE
  python benchmarks/bench_w4a16.py --summary T.json   (no GPU) the speedups and per-M geomeans of a table this
                                                      benchmark wrote (e.g. out/w4a16/w4a16_full.json)
  python benchmarks/bench_w4a16.py --shapes 4096x11008,3584x18944 [--ms 1,4,64] [--groups 128]
                                                      the table on other layers / rows / groups (w4a16_full-custom)
  TRITON_INTERPRET=1 python benchmarks/bench_w4a16.py --smoke   CPU plumbing check: tiny shapes, wall clock
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from common import (
    LLAMA_SHAPES,
    Timer,
    add_out_argument,
    copy_bandwidth,
    environment,
    geomean,
    kernel_device,
    out_folder,
    rotations,
    text_row,
)
from quantkit.kernels import w4a16 as K
from quantkit.kernels.w4a16 import configs as C

SHAPES = LLAMA_SHAPES  # (N, K)
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096]
GROUPS = [128, 64]
CHECK_MS = [1, 33, 130, 300]  # 130 and 300: the warp-specialized kernel's two configs on a GPU that has it
DEQUANT_MIN_M = 128
QUICK = {"shapes": [(4096, 4096), (28672, 8192)], "ms": [1, 16, 64, 1024], "groups": [128]}
SMOKE = {"shapes": [(64, 320)], "ms": [1, 20], "groups": [64]}
TARGETS = [(1, 3.0), (16, 2.5), (64, 1.5), (256, 0.95), (1024, 0.95), (4096, 0.95)]  # issue 6: M -> min speedup
M1_TARGET_SHAPES = [(14336, 4096), (4096, 14336), (8192, 8192), (28672, 8192), (8192, 28672)]  # "four largest" + tie

# Sweep candidates per regime (largest M of the regime, M values timed, configs), timed on SWEEP_SHAPES at group
# 128 only (the table then covers both groups). Decode (M <= 4) is weight-bandwidth bound: the CUDA-core gemv kernel
# (no tensor cores; 3.7 SASS instructions per 4-bit weight at M = 1 with fold_zero, +1 FFMA per extra row) against
# tensor-core tiles. From M ~ 4 the MMA path wins on instructions: BLOCK_M 16 with swap_ab (y.T = W.T @ x.T) runs
# wgmma 64x16x16 with the dequantized weight as the A operand. Both turned out latency bound, not issue bound: gemv
# at ~2.4 TB/s (12% fewer instructions gained 2%; ptxas issued each word row's load just before its use) and the MMA
# tiles fastest with more pipeline stages. So the gemv candidates also pipeline their loads (tl.range num_stages)
# and the MMA candidates vary the pipeline depth: pipelined gemv lost 10-25% to the plain-load winner; the MMA tiles
# gained 10-30% from 3 stages. Large M is tensor-core bound: dequantize to [N, K] + F.linear against the fused
# kernel. Every candidate compiles for sm_90 with Triton 3.6 without spills. Also tried: gemv with the next K tile
# prefetched into registers (won at M = 2, 1.50x -> 1.71x; lost at M = 1, 2.11-2.20x vs 2.36-2.39x), 8 columns per
# thread at M = 1 and 2 (lost), 2-warp tiles that run mma.sync instead of wgmma at M 8-64 (0.41-0.64x vs
# 0.89-1.35x): the losers stay as the evidence (docs/results/w4a16.md).
F_ = C.KernelConfig
GEMV_M1 = F_("gemv", 1, 512, 128, 4, 2, split_waves=8, fold_zero=True)
SWAP16 = F_("fused", 16, 128, 64, 4, 2, split_waves=4, fuse_scale=True, swap_ab=True)
SWEEP = {
    "m1": (1, [1], [
        F_("gemv", 1, 512, 128, 4, 1, split_waves=4, fold_zero=True),  # first H200 sweep's winner, loads not pipelined
        GEMV_M1,
        F_("gemv", 1, 512, 128, 4, 2, split_waves=4, fold_zero=True),
        F_("gemv", 1, 512, 128, 4, 2, split_waves=16, fold_zero=True),
        F_("gemv", 1, 512, 64, 4, 3, split_waves=8, fold_zero=True),
        F_("gemv", 1, 512, 128, 4, 3, split_waves=8, fold_zero=True),
        F_("gemv", 1, 512, 128, 4, 1, split_waves=4, fold_zero=True, prefetch=True),  # loads in registers, 1 ahead
        F_("gemv", 1, 512, 128, 4, 1, split_waves=8, fold_zero=True, prefetch=True),
        F_("gemv", 1, 512, 64, 4, 1, split_waves=4, fold_zero=True, prefetch=True),
        F_("gemv", 1, 512, 64, 4, 1, split_waves=8, fold_zero=True, prefetch=True),
        F_("gemv", 1, 256, 128, 2, 1, split_waves=8, fold_zero=True, prefetch=True),
        F_("gemv", 1, 1024, 64, 4, 1, split_waves=4, fold_zero=True),  # 8 columns per thread: x loads shared by 8
        F_("gemv", 1, 1024, 64, 4, 1, split_waves=8, fold_zero=True),
        F_("gemv", 1, 1024, 128, 4, 1, split_waves=4, fold_zero=True),
        F_("gemv", 1, 2048, 64, 8, 1, split_waves=4, fold_zero=True),
        F_("gemv", 1, 512, 128, 4, 1, split_waves=4, fold_zero=True, vector_x=True),  # x 4 per 8-byte load
        F_("gemv", 1, 512, 128, 4, 1, split_waves=8, fold_zero=True, vector_x=True),
        # the split-K fix-up loading 32 partials per round
        F_("gemv", 1, 512, 128, 4, 1, split_waves=4, fold_zero=True, vector_x=True, fixup_unroll=32),
    ]),
    "m2": (2, [2], [
        F_("gemv", 2, 512, 128, 4, 2, split_waves=8, fold_zero=True),
        F_("gemv", 2, 512, 64, 4, 3, split_waves=8, fold_zero=True),
        F_("gemv", 2, 512, 128, 4, 1, split_waves=4, fold_zero=True, prefetch=True),
        F_("gemv", 2, 512, 64, 4, 1, split_waves=8, fold_zero=True, prefetch=True),
        F_("gemv", 2, 1024, 64, 4, 1, split_waves=8, fold_zero=True, prefetch=True),
        F_("gemv", 2, 1024, 32, 4, 1, split_waves=8, fold_zero=True, prefetch=True),
        F_("gemv", 2, 512, 64, 4, 1, split_waves=8, fold_zero=True, prefetch=True, fixup_unroll=8),
        SWAP16,
    ]),
    "m4": (4, [4], [
        F_("gemv", 4, 512, 64, 4, 3, split_waves=8, fold_zero=True),
        F_("gemv", 4, 512, 64, 4, 1, split_waves=8, fold_zero=True, prefetch=True),
        SWAP16,
        F_("fused", 16, 128, 64, 4, 3, split_waves=4, fuse_scale=True, swap_ab=True),
    ]),
    "skinny": (16, [8, 16], [
        SWAP16,  # first H200 sweep's winner
        F_("fused", 16, 128, 64, 4, 3, split_waves=4, fuse_scale=True, swap_ab=True),
        F_("fused", 16, 128, 64, 4, 4, split_waves=4, fuse_scale=True, swap_ab=True),
        F_("fused", 16, 128, 64, 4, 2, split_waves=8, fuse_scale=True, swap_ab=True),
        F_("fused", 16, 64, 64, 4, 3, split_waves=4, fuse_scale=True, swap_ab=True),
        F_("fused", 16, 256, 64, 8, 3, split_waves=4, fuse_scale=True, swap_ab=True),
        F_("fused", 16, 64, 64, 2, 3, split_waves=4, fuse_scale=True, swap_ab=True),  # 2 warps: mma.sync, not wgmma
        F_("fused", 16, 128, 64, 2, 3, split_waves=4, fuse_scale=True, swap_ab=True),
    ]),
    # 64-wide N tiles 128 deep with BLOCK_M = M won both halves of a probe at M 32 and 64
    "m32": (32, [32], [
        F_("fused", 32, 64, 128, 4, 3, split_waves=2, fuse_scale=True, swap_ab=True),
        F_("fused", 64, 64, 128, 4, 3, split_waves=2, fuse_scale=True, swap_ab=True),
        F_("fused", 32, 128, 64, 4, 2, split_waves=2, fuse_scale=True, swap_ab=True),  # first sweep's winner
        F_("fused", 64, 128, 64, 4, 3, split_waves=2, fuse_scale=True, swap_ab=True),  # an earlier winner
        F_("fused", 32, 64, 64, 2, 3, split_waves=2, fuse_scale=True, swap_ab=True),
    ]),
    "medium": (64, [64], [
        F_("fused", 64, 64, 128, 4, 3, split_waves=2, fuse_scale=True, swap_ab=True),
        F_("fused", 64, 64, 64, 4, 3, split_waves=2, fuse_scale=True, swap_ab=True),
        F_("fused", 64, 64, 128, 4, 3, split_waves=1, fuse_scale=True, swap_ab=True),
        F_("fused", 64, 128, 64, 4, 3, split_waves=2, fuse_scale=True, swap_ab=True),  # an earlier winner
        F_("fused", 64, 64, 128, 4, 2, split_waves=2, fuse_scale=True),
        F_("fused", 64, 128, 64, 4, 3, split_waves=2, fuse_scale=True),
    ]),
    "m128": (128, [128], [  # swap-AB 128 x 64 tiles measured ahead of dequant + cuBLAS at M 128 and 256
        F_("fused", 128, 64, 128, 4, 3, split_waves=2, fuse_scale=True, swap_ab=True),
        F_("fused", 64, 64, 128, 4, 3, split_waves=2, fuse_scale=True, swap_ab=True),
        F_("fused", 128, 128, 128, 8, 3, split_waves=1, fuse_scale=True, swap_ab=True),
        F_("dequant"),
    ]),
    "large": (256, [256], [
        F_("fused", 128, 64, 128, 4, 3, split_waves=2, fuse_scale=True, swap_ab=True),
        F_("fused", 128, 128, 64, 8, 4, split_waves=1, fuse_scale=True),
        F_("dequant"),
    ]),
    "huge": (2**31, [1024, 4096], [
        F_("fused", 128, 128, 64, 8, 4, fuse_scale=True),
        F_("dequant"),
    ]),
}  # fmt: skip
SWEEP_SHAPES = [(14336, 4096), (8192, 8192), (28672, 8192)]
SWEEP_GROUPS = [128]
SMOKE_SWEEP = {  # decode regimes (M <= 16) timed at the first smoke M, the others at the second
    name: (max_m, [SMOKE["ms"][max_m > 16]], [F_("gemv", 1, 32, 64, 1, 1, split_waves=4), F_("dequant")])
    for name, (max_m, _, _) in SWEEP.items()
}
# written only where not the default
KEYWORD_FIELDS = (
    "split_waves",
    "fuse_scale",
    "group_m",
    "swap_ab",
    "fold_zero",
    "prefetch",
    "vector_x",
    "fixup_unroll",
)


# -- operands ----------------------------------------------------------------------------------------------------


def random_weight(n: int, k: int, group: int, device: str, gen: torch.Generator) -> K.W4A16Weight:
    """Random 4-bit GPTQ-v2 buffers (every bit pattern is a valid code), fp16 scales, contiguous groups."""
    n_g = -(-k // group)
    full = dict(low=-(2**31), high=2**31 - 1, dtype=torch.int32, device=device, generator=gen)
    qweight = torch.randint(size=(-(-k // 32) * 4, n), **full)
    qzeros = torch.randint(size=(n_g, -(-n // 32) * 4), **full)
    scales = (torch.rand(n_g, n, device=device, generator=gen) * 0.01 + 0.001).half()
    g_idx = (torch.arange(k, device=device) // group).int()
    return K.prepare_gptq_weight(qweight, qzeros, scales, g_idx, 4, group)


def weight_bytes(w: K.W4A16Weight) -> int:
    return sum(t.numel() * t.element_size() for t in (w.qweight, w.qzeros, w.scales))


def dequant64(w: K.W4A16Weight) -> torch.Tensor:
    """W [K, N] in float64 from the packed buffers (plain PyTorch)."""
    k, n = w.in_features, w.out_features
    q = K.unpack_gptq_codes(w.qweight, 4, k).double()
    z = K.unpack_gptq_codes(w.qzeros.t().contiguous(), 4, n).t().double()  # [n_g, N]
    g = torch.arange(k, device=q.device) // (w.group_size or k)
    return (q - z[g]) * w.scales.double()[g]


class Layer:
    """R rotated copies of one (N, K, group) weight, fp16 baselines, and x/out buffers per M."""

    def __init__(self, n: int, k: int, group: int, device: str, seed: int) -> None:
        self.n, self.k, self.group, self.device = n, k, group, device
        self.gen = torch.Generator(device=device).manual_seed(seed)
        w0 = random_weight(n, k, group, device, self.gen)
        self.bytes = weight_bytes(w0)
        self.weights = [w0] + [random_weight(n, k, group, device, self.gen) for _ in range(rotations(self.bytes) - 1)]
        self._w64 = None

    def w64(self) -> torch.Tensor:
        if self._w64 is None:
            self._w64 = dequant64(self.weights[0])
        return self._w64

    def calls(self, m: int, config) -> list:
        """One zero-argument callable per rotation (x, out and weights rotate together); ``config`` None: the
        dispatcher's own choice."""
        r = len(self.weights)
        xs = [torch.randn(m, self.k, device=self.device, generator=self.gen).half() for _ in range(r)]
        outs = [torch.empty(m, self.n, device=self.device, dtype=torch.float16) for _ in range(r)]
        return [
            (lambda x=x, w=w, o=o: K.w4a16_linear(x, w, config=config, out=o))
            for x, w, o in zip(xs, self.weights, outs, strict=True)
        ]

    def check(self, m: int, config) -> dict:
        """Kernel error vs float64 against cuBLAS fp16's error on the same inputs (flash-attn's rule)."""
        x = torch.randn(m, self.k, device=self.device, generator=self.gen).half()
        ref = x.double() @ self.w64()
        err = (K.w4a16_linear(x, self.weights[0], config=config).double() - ref).abs().max().item()
        torch_err = ((x @ self.w64().half()).double() - ref).abs().max().item()
        ok = err <= 2 * torch_err + 2**-20 * ref.abs().max().item()
        return {"m": m, "err": err, "torch_err": torch_err, "ok": ok}


def fp16_calls(n: int, k: int, m: int, device: str, gen: torch.Generator) -> list:
    r = rotations(2 * n * k + 2 * m * (n + k))
    ws = [torch.randn(n, k, device=device, generator=gen).half() for _ in range(r)]
    xs = [torch.randn(m, k, device=device, generator=gen).half() for _ in range(r)]
    return [(lambda x=x, w=w: F.linear(x, w)) for x, w in zip(xs, ws, strict=True)]


def layer_walk(shapes, groups, ms, timer: Timer, device: str, gen: torch.Generator):
    """The benchmarks' walk: per shape, cuBLAS fp16 timed once per M for all groups, then each group's rotated
    weights; yields (n, k, group, layer, fp16 us by M), emptying CUDA's cache between layers (a layer is freed
    once the caller's loop moves on, so at most two are held at a time)."""
    for n, k in shapes:
        base = {m: timer.per_call(fp16_calls(n, k, m, device, gen)) for m in ms}
        for group in groups:
            yield n, k, group, Layer(n, k, group, device, seed=n + k + group), base
            if device == "cuda":
                torch.cuda.empty_cache()


# -- compiled metadata and parallel precompilation -----------------------------------------------------------------


def kernel_metadata(layer: Layer, m: int, config: C.KernelConfig) -> dict:
    """Registers, spills and shared memory of the compiled kernel for this layer and M (None: interpreter)."""
    x = torch.randn(m, layer.k, device=layer.device).half()
    if config.method == "gemv":
        _, handle = K.w4a16_gemv(x, layer.weights[0], config)
    else:
        _, handle = K.w4a16_gemm(x, layer.weights[0], config=config)
    if handle is None or not hasattr(handle, "metadata"):
        return {}
    if hasattr(handle, "_init_handles"):
        handle._init_handles()
    return {
        "n_regs": getattr(handle, "n_regs", None),
        "n_spills": getattr(handle, "n_spills", None),
        "shared_bytes": getattr(handle.metadata, "shared", None),
        "num_warps": getattr(handle.metadata, "num_warps", None),
    }


def _precompile(job: tuple) -> tuple[str, float, str | None]:
    """Worker (spawned process): compile one (config, group, split) variant into Triton's on-disk cache by running it
    once on a small layer whose integer arguments specialize exactly like the benchmark shapes (multiples of 16)."""
    cfg_dict, group, split = job
    cfg = C.KernelConfig(**cfg_dict)
    cfg = replace(cfg, split_waves=8 if split else 0)
    t0 = time.perf_counter()
    try:
        gen = torch.Generator(device="cuda").manual_seed(0)
        w = random_weight(max(512, 2 * cfg.block_n), 1024, group, "cuda", gen)
        x = torch.randn(1 if split else cfg.block_m, 1024, device="cuda").half()
        K.w4a16_linear(x, w, config=cfg)
        torch.cuda.synchronize()
        return cfg.name, time.perf_counter() - t0, None
    except Exception as e:  # reported by the parent; the timed run then fails on the same config and says so
        return cfg.name, time.perf_counter() - t0, f"{type(e).__name__}: {e}"


def precompile(cases: list[tuple], workers: int) -> None:
    """Compile, in parallel processes, every kernel variant that ``cases`` [(config, n, k, m, group)] will launch.

    A variant is (config, effective BLOCK_K, split or not); M, the group size and the split factor are runtime
    arguments, so the benchmark shapes need nothing else.
    """
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    jobs = {}
    for cfg, n, k, m, group in cases:
        if cfg.method != "dequant":
            plan = C.plan_launch(cfg, m, n, k, group, num_sms)
            jobs.setdefault((cfg, plan.block_k, plan.split_k > 1), (cfg.to_dict(), group, plan.split_k > 1))
    todo = [*jobs.values(), (C.KernelConfig("dequant").to_dict(), cases[0][4], False)]
    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    try:
        with ProcessPoolExecutor(max_workers=max(1, min(workers, len(todo))), mp_context=ctx) as pool:
            results = list(pool.map(_precompile, todo))
    except Exception as e:  # the pool itself failed: every kernel still compiles lazily where it is first timed
        print(f"precompile pool failed ({type(e).__name__}: {e}); compiling lazily instead")
        return
    print(f"precompiled {len(todo)} kernel variants in {time.perf_counter() - t0:.1f}s with {workers} processes")
    for name, _, err in results:
        if err:
            print(f"  compile FAILED {name}: {err[:300]}")


# -- the full table ------------------------------------------------------------------------------------------------


def parse_ints(flag: str, text: str, per_item: int = 1) -> list:
    """``--flag`` text as comma-separated integers (``per_item`` 2: N x K pairs), or a one-line exit."""
    try:
        items = [tuple(int(v) for v in item.split("x")) for item in text.split(",")]
    except ValueError:
        items = []
    if not items or any(len(i) != per_item for i in items):
        example = "4096x11008,3584x18944" if per_item == 2 else "1,16,64"
        raise SystemExit(f"--{flag}: expected a comma-separated list such as {example}, got {text!r}")
    return items if per_item == 2 else [i[0] for i in items]


def table_spec(args) -> dict:
    """Shapes, M values and groups of the table: the issue's (or --quick / --smoke's), each replaceable by
    --shapes / --ms / --groups (e.g. other models' layers: --shapes 4096x11008,3584x18944)."""
    spec = dict(SMOKE if args.smoke else QUICK if args.quick else {"shapes": SHAPES, "ms": MS, "groups": GROUPS})
    if args.shapes:
        spec["shapes"] = parse_ints("shapes", args.shapes, per_item=2)
    for key in ("ms", "groups"):
        if getattr(args, key):
            spec[key] = parse_ints(key, getattr(args, key))
    return spec


def run_table(args, timer: Timer, device: str, table: list | None) -> dict:
    spec = table_spec(args)
    choose = (lambda m, n: table_config(table, m)) if table else C.config_for
    if not args.smoke and not args.no_precompile:
        ms = sorted(set(spec["ms"]) | set(CHECK_MS))
        precompile(
            [(choose(m, n), n, k, m, g) for n, k in spec["shapes"] for g in spec["groups"] for m in ms], args.workers
        )
    # device-to-device copy, TB/s counting read + write bytes
    copy_bw = float("nan") if args.smoke else copy_bandwidth(device, warmup_ms=10, rep_ms=50) / 1e12
    print(f"device copy bandwidth: {copy_bw:.2f} TB/s (read + write)")
    rows, checks, meta = [], [], {}
    gen = torch.Generator(device=device).manual_seed(1)
    for n, k, group, layer, base in layer_walk(spec["shapes"], spec["groups"], spec["ms"], timer, device, gen):
        for m in CHECK_MS if not args.smoke else spec["ms"]:
            ws = None if table else gluon_choice(layer, m)
            checks.append({"n": n, "k": k, "group": group, **layer.check(m, None if ws else choose(m, n))})
            if not checks[-1]["ok"]:
                print(f"  CORRECTNESS FAILURE {n}x{k} g{group}: {checks[-1]}")
        for m in spec["ms"]:
            cfg = choose(m, n)
            ws = None if table else gluon_choice(layer, m)
            us = timer.per_call(layer.calls(m, None if ws else cfg))  # None: w4a16_linear's own dispatch
            name = ws or cfg.name
            row = {"n": n, "k": k, "group": group, "m": m, "config": name, "fp16_us": base[m], "w4a16_us": us}
            row["speedup"] = base[m] / us
            row["weight_tbps"] = layer.bytes / (us * 1e-6) / 1e12
            row["pct_copy_bw"] = 100 * row["weight_tbps"] / copy_bw
            if ws:  # the Triton regime table's config in the same run, for comparison
                row["triton_config"], row["triton_us"] = cfg.name, timer.per_call(layer.calls(m, cfg))
            if m >= DEQUANT_MIN_M and cfg.method != "dequant":
                row["dequant_us"] = timer.per_call(layer.calls(m, C.KernelConfig("dequant")))
            rows.append(row)
            key = (cfg.name, group)
            if cfg.method != "dequant" and key not in meta:
                meta[key] = {"config": cfg.name, "group": group, "m": m, **kernel_metadata(layer, m, cfg)}
    source = "sweep winners" if table else "committed CONFIG_TABLE"
    return {"table": source, "copy_tbps": copy_bw, "rows": rows, "checks": checks, "metadata": list(meta.values())}


def gluon_choice(layer: Layer, m: int) -> str | None:
    """Name and split-K of the Gluon kernel ``w4a16_linear`` runs for ``m`` rows of this layer without a config
    (the dispatch table's own decision, ``w4a16.choose``), or None where the Triton table decides."""
    x = torch.empty(m, layer.k, device=layer.device, dtype=torch.float16)
    plan = K.choose(K.Product.of(x, layer.weights[0]))
    return None if plan.path == "table" else f"{plan.config.name}-sk{plan.split}"


def table_config(table: list, m: int) -> C.KernelConfig:
    for max_m, cfg in table:
        if m <= max_m:
            return cfg
    return table[-1][1]


def markdown_table(result: dict) -> str:
    lines = [
        "| N x K | G | M | config | fp16 us | w4a16 us | speedup | weight TB/s | % copy BW | dequant+cuBLAS us "
        "| Triton table us |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        deq = f"{r['dequant_us']:.1f}" if "dequant_us" in r else ""
        tri = f"{r['triton_us']:.1f} ({r['triton_config']})" if "triton_us" in r else ""
        lines.append(
            f"| {r['n']}x{r['k']} | {r['group']} | {r['m']} | {r['config']} | {r['fp16_us']:.1f} | "
            f"{r['w4a16_us']:.1f} | {r['speedup']:.2f} | {r['weight_tbps']:.2f} | {r['pct_copy_bw']:.0f} | {deq} "
            f"| {tri} |"
        )
    lines += ["", "| config | G | regs | spills | shared bytes | warps |", "|---|---|---|---|---|---|"]
    for md in result["metadata"]:
        lines.append(
            f"| {md['config']} | {md['group']} | {md.get('n_regs')} | {md.get('n_spills')} | "
            f"{md.get('shared_bytes')} | {md.get('num_warps')} |"
        )
    return "\n".join(lines) + "\n"


def print_short_table(result: dict) -> None:
    ms = sorted({r["m"] for r in result["rows"]})
    print(f"\nspeedup over cuBLAS fp16 (w4a16, {result['table']}); '*' = below the issue-6 target")
    print(text_row(["N x K", "G", *ms], [12, 4] + [6] * len(ms)))
    targets = dict(TARGETS)
    by_key: dict = {}
    for r in result["rows"]:
        by_key.setdefault((r["n"], r["k"], r["group"]), {})[r["m"]] = r["speedup"]
    for (n, k, g), cells in by_key.items():
        out = []
        for m in ms:
            s = cells.get(m)
            target = targets.get(m)
            if m == 1 and (n, k) not in M1_TARGET_SHAPES:
                target = None
            out.append(f"{s:5.2f}{'*' if target and s < target else ' '}" if s is not None else "")
        print(text_row([f"{n}x{k}", g, *out], [12, 4] + [6] * len(ms)))
    for label, groups in (("geomean", None), ("geomean g128", {128})):
        out = []
        for m in ms:
            cells = [r["speedup"] for r in result["rows"] if r["m"] == m and (groups is None or r["group"] in groups)]
            out.append(f"{geomean(cells):5.2f} " if cells else "")
        print(text_row([label, *out], [17] + [6] * len(ms)))
    bad = [c for c in result["checks"] if not c["ok"]]
    print(f"correctness: {len(result['checks']) - len(bad)}/{len(result['checks'])} checks within 2x cuBLAS error")


# -- the sweep -----------------------------------------------------------------------------------------------------


def run_sweep(args, timer: Timer, device: str) -> dict:
    sweep = SMOKE_SWEEP if args.smoke else SWEEP
    shapes = SMOKE["shapes"] if args.smoke else SWEEP_SHAPES
    groups = SMOKE["groups"] if args.smoke else SWEEP_GROUPS
    if not args.smoke and not args.no_precompile:
        regimes = sweep.values()
        cases = [(c, n, k, m, g) for _, ms, cs in regimes for c in cs for m in ms for n, k in shapes for g in groups]
        precompile(cases, args.workers)
    gen = torch.Generator(device=device).manual_seed(2)
    base = {}
    timings = []  # (regime, candidate index, n, k, group, m, us, speedup) ; us None = failed
    for n, k in shapes:
        for group in groups:
            layer = Layer(n, k, group, device, seed=n + k + group)
            for regime, (_, ms, cands) in sweep.items():
                for i, cfg in enumerate(cands):
                    try:
                        ok = layer.check(ms[0], cfg)["ok"]
                        if not ok:
                            print(f"  {regime} {cfg.name} {n}x{k} g{group}: WRONG RESULT, disqualified")
                        for m in ms:
                            if (n, k, m) not in base:
                                base[(n, k, m)] = timer.per_call(fp16_calls(n, k, m, device, gen))
                            us = timer.per_call(layer.calls(m, cfg)) if ok else None
                            sp = base[(n, k, m)] / us if us else None
                            timings.append({"regime": regime, "cand": i, "config": cfg.name, "n": n, "k": k,
                                            "group": group, "m": m, "us": us, "speedup": sp})  # fmt: skip
                    except Exception as e:  # a candidate that does not compile or launch is reported and skipped
                        print(f"  {regime} {cfg.name} {n}x{k} g{group}: {type(e).__name__}: {str(e)[:200]}")
                        timings.append({"regime": regime, "cand": i, "config": cfg.name, "n": n, "k": k,
                                        "group": group, "m": None, "us": None, "speedup": None})  # fmt: skip
            del layer
            if device == "cuda":
                torch.cuda.empty_cache()
    winners = []
    for regime, (max_m, _, cands) in sweep.items():
        scores = []
        for i, cfg in enumerate(cands):
            sp = [t["speedup"] for t in timings if t["regime"] == regime and t["cand"] == i]
            valid = sp and all(s is not None for s in sp)
            score = geomean(sp) if valid else None
            scores.append({"config": cfg.to_dict(), "name": cfg.name, "geomean_speedup": score})
        best = max((s for s in scores if s["geomean_speedup"]), key=lambda s: s["geomean_speedup"], default=None)
        if best is None:
            raise SystemExit(f"sweep: no candidate of regime {regime} ran correctly; nothing to commit")
        winners.append({"regime": regime, "max_m": max_m, **best, "scores": scores})
    return {"winners": winners, "timings": timings}


def print_sweep(sweep: dict) -> None:
    print("\nsweep: geomean speedup over cuBLAS fp16 per candidate (over shapes x groups x M of the regime)")
    for w in sweep["winners"]:
        print(f"  {w['regime']} (M <= {w['max_m']}):")
        for s in w["scores"]:
            mark = "  <- winner" if s["name"] == w["name"] else ""
            score = f"{s['geomean_speedup']:.3f}" if s["geomean_speedup"] else "failed"
            print(f"    {s['name']:<32} {score}{mark}")
    print("\nCONFIG_TABLE literal (the winners, to commit in the W4A16 configs):")
    print(config_table_literal(sweep))


def config_table_literal(sweep: dict) -> str:
    lines = ["CONFIG_TABLE: tuple[tuple[int, KernelConfig], ...] = ("]
    for w in sweep["winners"]:
        c = w["config"]
        default = C.KernelConfig().to_dict()
        extra = "".join(f", {f}={c[f]!r}" for f in KEYWORD_FIELDS if c[f] != default[f])
        head = f'"{c["method"]}", {c["block_m"]}, {c["block_n"]}, {c["block_k"]}, {c["num_warps"]}, {c["num_stages"]}'
        max_m = "2**31" if w["max_m"] >= 2**31 else str(w["max_m"])
        lines.append(f"    ({max_m}, KernelConfig({head}{extra})),")
    return "\n".join([*lines, ")"])


def load_table(path: Path) -> list:
    winners = json.loads(path.read_text())["sweep"]["winners"]
    return [(w["max_m"], C.KernelConfig(**w["config"])) for w in winners]


# -- main ----------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--table", action="store_true", help="with --sweep: run the full table with the winners after")
    ap.add_argument("--configs", type=Path, help="sweep.json whose winners replace CONFIG_TABLE for this run")
    ap.add_argument("--smoke", action="store_true", help="CPU plumbing check (needs TRITON_INTERPRET=1)")
    ap.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1), help="precompile processes")
    ap.add_argument("--no-precompile", action="store_true", help="compile lazily in this process instead")
    ap.add_argument("--summary", type=Path, help="print the speedups and per-M geomeans of a JSON this benchmark wrote")
    ap.add_argument("--shapes", help="N x K pairs instead of the issue's six, e.g. 4096x11008,3584x18944")
    ap.add_argument("--ms", help="comma-separated M values instead of the table's")
    ap.add_argument("--groups", help="comma-separated group sizes instead of the table's (128,64)")
    add_out_argument(ap, "w4a16")
    args = ap.parse_args(argv)
    if args.summary:
        print_short_table(json.loads(args.summary.read_text()))
        return
    device = kernel_device(args.smoke)
    out_dir = out_folder(args.out)
    env = environment(device)
    print(f"{env['device']}  torch {env['torch']}  triton {env['triton']}  {env['date']}")
    timer = Timer(smoke=args.smoke)
    t0 = time.perf_counter()
    table = load_table(args.configs) if args.configs else None
    if args.sweep:
        sweep = run_sweep(args, Timer(smoke=args.smoke, warmup_ms=5, rep_ms=25), device)  # ~550 timings: shorter
        (out_dir / "sweep.json").write_text(json.dumps({"env": env, "sweep": sweep}, indent=1))
        print_sweep(sweep)
        print(f"sweep took {time.perf_counter() - t0:.0f}s; wrote {out_dir / 'sweep.json'}")
        if not args.table:
            return
        table = [(w["max_m"], C.KernelConfig(**w["config"])) for w in sweep["winners"]]
    result = run_table(args, timer, device, table)
    tag = "smoke" if args.smoke else "quick" if args.quick else "full"
    tag += "-custom" if args.shapes or args.ms or args.groups else ""
    (out_dir / f"w4a16_{tag}.json").write_text(json.dumps({"env": env, **result}, indent=1))
    header = f"# W4A16 vs cuBLAS fp16 -- {env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}\n"
    header += f"\nCommit {env['commit']}. Device copy bandwidth {result['copy_tbps']:.2f} TB/s (read + write).\n\n"
    (out_dir / f"w4a16_{tag}.md").write_text(header + markdown_table(result))
    print("\ncompiled kernels (registers, spills, shared memory):")
    for md in result["metadata"]:
        print(f"  {md}")
    print(f"took {time.perf_counter() - t0:.0f}s; wrote {out_dir}/w4a16_{tag}.json and .md")
    print_short_table(result)


if __name__ == "__main__":
    main()
