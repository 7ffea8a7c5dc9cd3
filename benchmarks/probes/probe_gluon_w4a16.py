"""Probe: a W4A16 GEMM for M = 64-4096 written in Gluon, with the dequantization of weight tile t + 1 overlapping
the wgmma of tile t.

    python benchmarks/probes/probe_gluon_w4a16.py [--out DIR] [--ms 128,256,1024,4096] [--groups 128] [--ws-only]
    python benchmarks/probes/probe_gluon_w4a16.py --production [--ms ...] [--groups 128,64]
    PYTHONPATH=<triton 3.6> python benchmarks/probes/probe_gluon_w4a16.py --compile   (no GPU: sm_90 code only)

Second part (2026-12-03, later): the warp-specialized kernel (``quantkit/kernels/w4a16_ws_kernel.py``: a TMA warp,
dequantizing warps and an MMA warp group on mbarriers, split-K with a deterministic fix-up) as ``GluonConfig``s with
``dq`` > 0 (``--ws-only`` times those alone), and ``--production``: the committed ``w4a16_ws`` configs with their
automatic split, beside the Triton regime table's config (results/w4a16-ws-h200-2026-12-03.md).

Why: from M = 256 the committed path dequantizes the whole weight to fp16 and calls cuBLAS (0.59x cuBLAS fp16 at
M = 256: 2 bytes per weight written and read back); every fused Triton tile timed so far (swap-AB, register-A,
256-row tiles: results/w4a16-large-h200-2026-12-02.md, w4a16-rega-h200-2026-12-03.md) ran the tensor cores at
250-450 TFLOP/s because Triton 3.6 waits on each wgmma before dequantizing the next tile, so dequantization and
MMA add up. Gluon (Triton's lower-level dialect, in 3.6 on the GPU machine) lets the kernel say the schedule:

- TMA brings x tiles [BLOCK_M, BLOCK_K] and packed-word tiles [BLOCK_K / 8, BLOCK_N] into a ring of STAGES
  slots, STAGES - 2 tiles ahead, one mbarrier per slot.
- Every thread unpacks its words in inline PTX (per word: 4 x LOP3 with the fp16 magic 1024 + code, 4 x
  sub.f16x2 of the zero, 4 x mul.f16x2 of the scale -- the product of exact operands rounded once, as PyTorch's
  dequantize -- and 4 PRMTs that put k-adjacent values into one register; bf16: the difference in bf16, the
  scale product in fp32, one cvt per pair), and stores the [BLOCK_N, BLOCK_K] tile K-major into one of three
  swizzled shared buffers (16-byte stores), then fence + CTA barrier.
- wgmma (x from shared memory as A, the dequantized tile as B) is issued asynchronously and only the wgmma of the
  previous tile is waited for, so tile t + 1's unpacking runs while tile t's MMA does.
- Buffer reuse is safe by the barrier: once a warp is past tile t's barrier every warp has retired wgmma t - 2, so
  the TMA refill goes to tile t - 2's slot and the dequantized buffer of tile t - 3 is rewritten (three buffers).

Zeros and scales of the next tile's group are loaded one tile ahead. Result (H200, 2026-12-03): 0.56-0.67x cuBLAS
fp16 at M = 128-256 for the best single config, behind dequantize + cuBLAS from M = 256 and not adopted
(results/w4a16-gluon-h200-2026-12-03.md).

Each cell: cuBLAS fp16 (F.linear), the committed path and the Gluon variants in the same run (bench_w4a16.py's
method: CUDA graphs over rotated operands, L2 flushed, medians); every variant checked against float64 first
(within 2x cuBLAS fp16's own error). GPU only: Gluon has no interpreter mode.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_w4a16
from bench_w4a16 import SHAPES, Layer, Timer, layer_walk
from quantkit.kernels import w4a16 as K
from quantkit.kernels import w4a16_configs as C
from quantkit.kernels import w4a16_ws as WS
from quantkit.kernels.w4a16_ws_kernel import _group_params, _w4a16_ws_kernel, operand_pairs, unpack_tile
from quantkit.kernels.w4a16_ws_kernel import descriptors as ws_descriptors


@gluon.jit
def _w4a16_wgmma_kernel(
    x_desc, qw_desc, qz_ptr, s_ptr, bias_ptr, out_ptr,
    M, N, K, group_size, stride_qzg, stride_sg, stride_om,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
    BF16: gl.constexpr, HAS_BIAS: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    BKW: gl.constexpr = BLOCK_K // 8
    act: gl.constexpr = x_desc.dtype

    pid = gl.program_id(0)
    num_m = gl.cdiv(M, BLOCK_M)
    off_m = (pid % num_m) * BLOCK_M  # M fastest: the CTAs that share a weight tile run together
    off_n = (pid // num_m) * BLOCK_N

    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
    )
    w_layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [num_warps, 1], [1, 0])
    d_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], act)
    d32_layout: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=d_layout.swizzle_byte_width, element_bitwidth=32, rank=2
    )

    x_smem = gl.allocate_shared_memory(act, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BKW, BLOCK_N], qw_desc.layout)
    d_smem = gl.allocate_shared_memory(act, [3, BLOCK_N, BLOCK_K], d_layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)

    k_tiles = K // BLOCK_K
    gl.assume(k_tiles > 0)  # no zero-trip path: ptxas serializes the wgmma when one defines the accumulator
    nbytes: gl.constexpr = x_desc.block_type.nbytes + qw_desc.block_type.nbytes
    for i in gl.static_range(STAGES - 2):
        pred = i < k_tiles
        mbarrier.expect(bars.index(i), nbytes, pred=pred)
        tma.async_copy_global_to_shared(x_desc, [off_m, i * BLOCK_K], bars.index(i), x_smem.index(i), pred=pred)
        tma.async_copy_global_to_shared(qw_desc, [i * BKW, off_n], bars.index(i), w_smem.index(i), pred=pred)

    cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, w_layout))
    col_mask = cols < N
    z_shift = (cols % 8) * 4
    # zeros and scales of tile t + 1's group are loaded during tile t (a load's latency is not waited for in line)
    zw, sv = _group_params(qz_ptr, s_ptr, 0, cols, col_mask, stride_qzg, stride_sg, BF16)
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=acc_layout)
    for t in range(k_tiles):
        slot = t % STAGES
        g_next = (gl.minimum(t + 1, k_tiles - 1) * BLOCK_K) // group_size
        zw_next, sv_next = _group_params(qz_ptr, s_ptr, g_next, cols, col_mask, stride_qzg, stride_sg, BF16)
        zz, ss = operand_pairs(zw, sv, z_shift, BF16)
        zw, sv = zw_next, sv_next

        mbarrier.wait(bars.index(slot), (t // STAGES) & 1)
        pairs = unpack_tile(w_smem.index(slot).load(w_layout), zz, ss, BLOCK_N, BLOCK_K, BF16)
        d = d_smem.index(t % 3)
        d._reinterpret(gl.int32, [BLOCK_N, BLOCK_K // 2], d32_layout).store(pairs)
        fence_async_shared()
        gl.thread_barrier()

        # every warp is past this barrier, so wgmma t - 2 has retired everywhere: refill its slot
        nt = t + STAGES - 2
        ns = nt % STAGES
        pred = nt < k_tiles
        mbarrier.expect(bars.index(ns), nbytes, pred=pred)
        tma.async_copy_global_to_shared(x_desc, [off_m, nt * BLOCK_K], bars.index(ns), x_smem.index(ns), pred=pred)
        tma.async_copy_global_to_shared(qw_desc, [nt * BKW, off_n], bars.index(ns), w_smem.index(ns), pred=pred)

        acc = warpgroup_mma(x_smem.index(slot), d.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
    ocols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
    if HAS_BIAS:
        acc = acc + gl.expand_dims(gl.load(bias_ptr + ocols, mask=ocols < N, other=0.0).to(gl.float32), 0)
    mask = gl.expand_dims(rows < M, 1) & gl.expand_dims(ocols < N, 0)
    ptrs = out_ptr + gl.expand_dims(rows, 1) * stride_om + gl.expand_dims(ocols, 0)
    gl.store(ptrs, acc.to(act), mask=mask)


@dataclass(frozen=True)
class GluonConfig:
    block_m: int
    block_n: int
    block_k: int = 64
    stages: int = 4
    num_warps: int = 4
    dq: int = 0  # > 0: the warp-specialized kernel with this many dequantized-tile buffers
    dq_regs: int = 160  # registers per thread of its dequantizing warps
    dq_warps: int = 4  # warps that dequantize
    split_k: int = 1  # CTAs per output tile along K, fixed up by the last one to finish (fp32 workspace)

    @property
    def name(self) -> str:
        base = f"gluon-m{self.block_m}n{self.block_n}k{self.block_k}w{self.num_warps}s{self.stages}"
        if not self.dq:
            return base
        return (
            base + f"-ws{self.dq}d{self.dq_warps}r{self.dq_regs}" + (f"-sk{self.split_k}" if self.split_k > 1 else "")
        )

    def kernel_args(self) -> tuple:
        """The kernel and its trailing constexpr arguments after BF16, HAS_BIAS."""
        if self.dq:
            return _w4a16_ws_kernel, dict(DQ=self.dq, DQ_REGS=self.dq_regs, DQ_WARPS=self.dq_warps,
                                          SPLIT_K=self.split_k)  # fmt: skip
        return _w4a16_wgmma_kernel, {}


def _gl_dtype(dtype: torch.dtype):
    return gl.float16 if dtype == torch.float16 else gl.bfloat16


def descriptors(x: torch.Tensor, w: K.W4A16Weight, cfg: GluonConfig):
    return ws_descriptors(x, w.qweight, cfg.block_m, cfg.block_n, cfg.block_k)


_WORKSPACE: dict = {}


def _split_workspace(device, numel: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 workspace for the partial tiles and zeroed int32 tile counters, kept between calls (the kernel
    leaves the counters zeroed)."""
    ws, cnt = _WORKSPACE.get(device, (None, None))
    if ws is None or ws.numel() < numel or cnt.numel() < tiles:
        ws = torch.empty(max(numel, 1 << 20), device=device, dtype=torch.float32)
        cnt = torch.zeros(max(tiles, 4096), device=device, dtype=torch.int32)
        _WORKSPACE[device] = (ws, cnt)
    return ws, cnt


def gluon_w4a16(x: torch.Tensor, w: K.W4A16Weight, config: GluonConfig, bias=None, out=None) -> torch.Tensor:
    m, k = x.shape
    n = w.out_features
    group = w.group_size or k
    split = config.split_k
    if w.bits != 4 or k % (group * split) or group % config.block_k or w.perm is not None:
        raise ValueError(f"{config.name}: 4-bit, K a multiple of {split} groups, the group of {config.block_k}, "
                         "no act-order")  # fmt: skip
    if out is None:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    x_desc, qw_desc = descriptors(x, w, config)
    scales = w.scales if x.dtype == torch.bfloat16 else w.scales.view(torch.int16)
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    grid = (tiles, split)
    fn, extra = config.kernel_args()
    if config.dq:
        ws, cnt = _split_workspace(x.device, split * m * n, tiles) if split > 1 else (out, out)
        extra = dict(extra, GROUP=group)
        sizes = (ws, cnt, m, n, k)
    else:
        sizes = (m, n, k, group)
    fn[grid](
        x_desc, qw_desc, w.qzeros, scales, bias if bias is not None else out, out,
        *sizes, w.qzeros.stride(0), w.scales.stride(0), out.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, STAGES=config.stages,
        BF16=x.dtype == torch.bfloat16, HAS_BIAS=bias is not None, num_warps=config.num_warps, **extra,
    )  # fmt: skip
    return out


WS_CANDIDATES = [
    GluonConfig(128, 128, 64, 4, 4, dq=2, dq_warps=8, dq_regs=128),
    GluonConfig(128, 128, 128, 3, 4, dq=2, dq_warps=8, dq_regs=128),
    GluonConfig(256, 128, 64, 4, 8, dq=2),
    GluonConfig(256, 128, 64, 5, 8, dq=2),
    GluonConfig(256, 128, 128, 2, 8, dq=2),
    GluonConfig(256, 128, 64, 4, 8, dq=2, split_k=2),
    GluonConfig(256, 128, 64, 4, 8, dq=2, split_k=4),
    GluonConfig(128, 128, 128, 3, 4, dq=2, dq_warps=8, dq_regs=128, split_k=2),
]
CANDIDATES = [
    *WS_CANDIDATES,
    GluonConfig(128, 64, 64, 6, 8),
    GluonConfig(64, 64, 64, 6, 4),
    GluonConfig(128, 128, 64, 5, 8),
    GluonConfig(64, 128, 64, 6, 4),
    GluonConfig(128, 256, 64, 4, 8),
    GluonConfig(256, 64, 64, 4, 8),
    GluonConfig(128, 64, 128, 4, 8),
    GluonConfig(128, 128, 128, 3, 8),
    GluonConfig(64, 128, 128, 4, 4),
]


# ---------------------------------------------------------------------------------------------------------------
# Offline compile for sm_90 (Triton 3.6 on PYTHONPATH, no GPU)
# ---------------------------------------------------------------------------------------------------------------
def compile_offline(cfg: GluonConfig, dtype: torch.dtype):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    x = torch.empty(256, 4096, dtype=dtype)
    qw = torch.empty(512, 4096, dtype=torch.int32)
    w = K.W4A16Weight(qw, torch.empty(32, 512, dtype=torch.int32), torch.empty(32, 4096, dtype=torch.float16),
                      4, 128, 4096, 4096)  # fmt: skip
    x_desc, qw_desc = descriptors(x, w, cfg)
    fn, extra = cfg.kernel_args()
    act = "fp16" if dtype == torch.float16 else "bf16"
    sig = dict.fromkeys(fn.arg_names, "i32")
    sig.update(x_desc=mangle_type(x_desc), qw_desc=mangle_type(qw_desc), qz_ptr="*i32", bias_ptr=f"*{act}",
               out_ptr=f"*{act}", s_ptr="*bf16" if dtype == torch.bfloat16 else "*i16")  # fmt: skip
    sig.update({a: t for a, t in (("ws_ptr", "*fp32"), ("cnt_ptr", "*i32")) if a in fn.arg_names})
    extra = dict(extra, GROUP=128) if "GROUP" in fn.arg_names else extra
    const = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, STAGES=cfg.stages,
                 BF16=dtype == torch.bfloat16, HAS_BIAS=False, num_warps=cfg.num_warps, **extra)  # fmt: skip
    sig.update(dict.fromkeys(const, "constexpr"))
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in
             ["qz_ptr", "s_ptr", "bias_ptr", "out_ptr", "N", "K", "stride_qzg", "stride_sg", "stride_om"]}  # fmt: skip
    src = GluonASTSource(fn, sig, const, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg.num_warps})


def report_compile() -> None:
    from collections import Counter

    from sass_w4a16 import loop_body, machine_code

    for dtype in (torch.float16, torch.bfloat16):
        for cfg in CANDIDATES:
            try:
                ck = compile_offline(cfg, dtype)
            except Exception as e:  # report every candidate
                print(f"{cfg.name} {dtype}: {type(e).__name__}: {str(e)[:2000]}")
                continue
            regs, stack, sass = machine_code(ck)
            body = loop_body(sass)
            ops = Counter(i.split()[0].split(".")[0] for i in body)
            top = " ".join(f"{op}:{c}" for op, c in ops.most_common(14))
            print(f"{cfg.name} {str(dtype)[6:]}: regs {regs} stack {stack} smem {ck.metadata.shared} "
                  f"loop {len(body)} instructions ({len(body) * cfg.num_warps * 32 / (cfg.block_n * cfg.block_k):.2f} "
                  f"thread-instructions per weight): {top}")  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# GPU probe
# ---------------------------------------------------------------------------------------------------------------
def check_bf16(layer: Layer, m: int, cfg, linear=None) -> bool:
    """bf16 activations: against the dequantize kernel's bf16 weight through F.linear (same rounding of W)."""
    x = torch.randn(m, layer.k, device="cuda", generator=layer.gen).bfloat16()
    w = layer.weights[0]
    ref = x.double() @ layer.w64()
    err = ((linear or gluon_w4a16)(x, w, config=cfg).double() - ref).abs().max().item()
    torch_err = ((x @ K.w4a16_dequantize(w, torch.bfloat16).t()).double() - ref).abs().max().item()
    ok = err <= 2 * torch_err + 2**-20 * ref.abs().max().item()
    if not ok:
        print(f"  {cfg.name} bf16 M={m}: err {err:.3g} vs cuBLAS {torch_err:.3g}", flush=True)
    return ok


def cells(shapes, groups, ms):
    """The probes' walk: per (shape, group, M) cell, cuBLAS fp16 and the Triton regime table's config timed; yields
    (timer, layer, row dict, printed line so far)."""
    timer = Timer(smoke=False)
    gen = torch.Generator(device="cuda").manual_seed(7)
    for n, k, group, layer, base in layer_walk(shapes, groups, ms, timer, "cuda", gen):
        for m in ms:
            committed = C.config_for(m, n)
            us = timer.per_call(layer.calls(m, committed))
            row = {"n": n, "k": k, "group": group, "m": m, "fp16_us": base[m], "committed": committed.name,
                   committed.name: us}  # fmt: skip
            yield (
                timer,
                layer,
                row,
                f"{n}x{k} g{group} M={m}: fp16 {base[m]:.1f} us | {committed.name} {base[m] / us:.2f}x",
            )


# configs beyond WS_TABLE for --production --extra: 64-row tiles, for M <= 64 (below WS_MIN_M)
EXTRA_WS = [
    WS.WSConfig(64, 128, 128, 3, 4, dq_warps=8, dq_regs=128),
    WS.WSConfig(64, 128, 128, 4, 4, dq_warps=8, dq_regs=128),
    WS.WSConfig(64, 64, 128, 4, 4, dq_regs=128),
]


def production(out: Path, ms: list[int], groups: list[int], extra: bool = False) -> None:
    """Every WS_TABLE config (and EXTRA_WS with ``extra``) at every M (fp16 checked against float64, bf16 against
    the dequantized weight) beside the Triton regime table's config, through ``w4a16_ws_gemm``."""
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for timer, layer, row, line in cells(SHAPES, groups, ms):
        n, k, group, m, fp16_us = row["n"], row["k"], row["group"], row["m"], row["fp16_us"]
        configs = [c for _, c in WS.WS_TABLE] + (EXTRA_WS if extra else [])
        for cfg in dict.fromkeys(WS.fit_group(c, group) for c in configs):
            split = WS.ws_split(cfg, m, n, k, group, 132)
            fp16 = layer.check(m, cfg, WS.w4a16_ws_gemm)
            ok = fp16["ok"] and check_bf16(layer, m, cfg, WS.w4a16_ws_gemm)
            us = timer.per_call(layer.calls(m, cfg, WS.w4a16_ws_gemm)) if ok else None
            row[cfg.name] = {"us": us, "ok": ok, "split": split, "err": fp16["err"], "torch_err": fp16["torch_err"]}
            line += f" | {cfg.name} sk{split} " + (f"{fp16_us / us:.2f}x" if us else "FAILED")
        print(line, flush=True)
        rows.append(row)
        (out / "probe_gluon_w4a16_production.json").write_text(json.dumps({"rows": rows}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    ap.add_argument("--ms", default="128,256,1024,4096")
    ap.add_argument("--groups", default="128")
    ap.add_argument("--shapes", default="all", help="'all' or NxK,NxK")
    ap.add_argument("--compile", action="store_true", help="compile every candidate for sm_90 and stop (no GPU)")
    ap.add_argument("--ws-only", action="store_true", help="time the warp-specialized candidates only")
    ap.add_argument("--production", action="store_true",
                    help="time quantkit.kernels.w4a16_ws (WS_TABLE's configs, automatic split-K) only")  # fmt: skip
    ap.add_argument("--extra", action="store_true", help="with --production: also EXTRA_WS")
    args = ap.parse_args()
    if args.production:
        ms = [int(v) for v in args.ms.split(",")]
        production(args.out, ms, [int(g) for g in args.groups.split(",")], args.extra)
        return
    candidates = WS_CANDIDATES if args.ws_only else CANDIDATES
    if args.compile:
        report_compile()
        return
    args.out.mkdir(parents=True, exist_ok=True)
    ms = [int(v) for v in args.ms.split(",")]
    groups = [int(g) for g in args.groups.split(",")]
    shapes = SHAPES if args.shapes == "all" else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows = []
    for timer, layer, row, line in cells(shapes, groups, ms):
        m, fp16_us = row["m"], row["fp16_us"]
        for cfg in candidates:
            try:
                fp16 = layer.check(m, cfg, gluon_w4a16)
                if not fp16["ok"]:
                    err, ref_err = fp16["err"], fp16["torch_err"]
                    print(f"  {cfg.name} M={m}: err {err:.3g} vs cuBLAS {ref_err:.3g}", flush=True)
                ok = fp16["ok"] and check_bf16(layer, m, cfg)
                us = timer.per_call(layer.calls(m, cfg, gluon_w4a16)) if ok else None
            except Exception as e:
                print(f"  {cfg.name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                ok, us = False, None
            row[cfg.name] = {"us": us, "ok": ok}
            line += f" | {cfg.name} " + (f"{fp16_us / us:.2f}x" if us else "FAILED")
        print(line, flush=True)
        rows.append(row)
        (args.out / "probe_gluon_w4a16.json").write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
