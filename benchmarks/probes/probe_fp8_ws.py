"""Probe: a warp-specialized fp8 GEMM in Gluon whose promotion overlaps the tensor cores (M >= 1024, H200).

    python benchmarks/probes/probe_fp8_ws.py [--out DIR] [--ms 1024,4096,16384] [--variants ...]

Why: the promoted fp8 path (DeepSeek-V3's recipe: each 128-deep partial sum leaves Hopper's reduced-precision
tensor-core adder for a full fp32 accumulator) runs ~1.3x bf16 against ~1.6x for fast accumulation. In Triton's
single-partition loop every promotion waits for the tile's wgmma and the tensor cores idle meanwhile (offline SASS,
benchmarks/probes/sass_fp8_promote.py). Here the promotion stays the same, but the tile's rows are split between
NCONS consumer warp groups in their own partitions (64 rows each) and a one-warp TMA loader fills a ring of STAGES
slots: while one group adds its partial sums, the other's wgmma runs.

Kernel (``_fp8_ws_kernel``): CTA tile [64 * NCONS, NSUB * 128], K tiles of 128. Per K tile each consumer issues a
fresh m64n128k32 wgmma chain per 128-column sub-tile (``use_acc=False``: the 128-long partial sum), waits for it and
adds it to its fp32 accumulator of that sub-tile; sub-tiles run one after the other so a group holds NSUB + 1
register tiles of 64 (NSUB = 2: 192 registers). Epilogue in registers: per-token x per-channel scales, bias, one
masked store. The same arithmetic as the committed promoted path (each 128-long partial in the tensor core, the sum
of partials in fp32), so its error should match (~1.3e-4 relative).

Each point: bf16 cuBLAS, the committed promoted config and fast accumulation (``w8a8_linear``), and the Gluon
variants, end to end (the committed quantizer + GEMM), bench_w8a8.py's method (CUDA graphs over rotated operands,
medians); errors as probe_fp8_promote.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch
from quantkit.kernels.w8a8_ws_kernel import _scaled_store  # the committed kernel's epilogue
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_w8a8


@gluon.jit
def _tile_offsets(tile, M, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """tile number -> (row, column) of its first element, GROUP_M row tiles at a time (their weight tiles are
    reused from L2)."""
    num_m = gl.cdiv(M, BLOCK_M)
    per_group = GROUP_M * gl.cdiv(N, BLOCK_N)
    first_m = (tile // per_group) * GROUP_M
    group_rows = gl.minimum(num_m - first_m, GROUP_M)
    return (first_m + (tile % per_group) % group_rows) * BLOCK_M, ((tile % per_group) // group_rows) * BLOCK_N


@gluon.jit
def _loader(a_desc, w_desc, a_smem, w_smem, ready, empty, M, N, K, NCONS: gl.constexpr, NSUB: gl.constexpr,
            BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr):  # fmt: skip
    """One warp: for each of the program's tiles, TMA copies of the NCONS 64-row activation tiles and the weight
    tile into slot it % STAGES once every consumer released it (it counts K steps over all the program's tiles, so
    the next tile's first slots fill while the consumers store the current one)."""
    nbytes: gl.constexpr = NCONS * a_desc.block_type.nbytes + w_desc.block_type.nbytes
    num_tiles = gl.cdiv(M, 64 * NCONS) * gl.cdiv(N, 128 * NSUB)
    k_tiles = gl.cdiv(K, BLOCK_K)
    it = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m, off_n = _tile_offsets(tile, M, N, 64 * NCONS, 128 * NSUB, GROUP_M)
        for t in range(k_tiles):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            k0 = t * BLOCK_K
            for c in gl.static_range(NCONS):
                tma.async_copy_global_to_shared(a_desc, [off_m + c * 64, k0], ready.index(s),
                                                a_smem.index(s * NCONS + c))  # fmt: skip
            tma.async_copy_global_to_shared(w_desc, [off_n, k0], ready.index(s), w_smem.index(s))
            it += 1


@gluon.jit
def _consumer(a_smem, w_smem, ready, empty, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, K, stride_cm,
              ROLE: gl.constexpr, NCONS: gl.constexpr, NSUB: gl.constexpr, BLOCK_K: gl.constexpr,
              STAGES: gl.constexpr, GROUP_M: gl.constexpr, HAS_BIAS: gl.constexpr, REG_A: gl.constexpr):  # fmt: skip
    """Four warps (one warp group): rows ROLE * 64 ... of each tile. Per K step and 128-column sub-tile: a fresh
    wgmma chain (the 128-long partial sum in the tensor core), wait, add to the fp32 accumulator; then release the
    slot. After the tile's last step: scales, bias, store."""
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    zero = gl.zeros([64, 128], gl.float32, layout)
    num_tiles = gl.cdiv(M, 64 * NCONS) * gl.cdiv(N, 128 * NSUB)
    k_tiles = gl.cdiv(K, BLOCK_K)
    it = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m, off_n = _tile_offsets(tile, M, N, 64 * NCONS, 128 * NSUB, GROUP_M)
        acc0 = zero
        acc1 = zero
        for _t in range(k_tiles):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            a = a_smem.index(s * NCONS + ROLE)
            if REG_A:  # read once into registers for both sub-tiles: the wgmma then reads only W from shared memory
                a = a.load(gl.DotOperandLayout(operand_index=0, parent=layout, k_width=4))
            w = w_smem.index(s)
            acc0 += warpgroup_mma(a, w.slice(0, 128, dim=0).permute((1, 0)), zero, use_acc=False)
            if NSUB == 2:
                acc1 += warpgroup_mma(a, w.slice(128, 128, dim=0).permute((1, 0)), zero, use_acc=False)
            mbarrier.arrive(empty.index(s))
            it += 1
        rows = off_m + ROLE * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
        sa = gl.load(a_scale_ptr + rows, mask=rows < M, other=0.0)
        _scaled_store(acc0, rows, sa, off_n, c_ptr, w_scale_ptr, bias_ptr, M, N, stride_cm, layout, HAS_BIAS)
        if NSUB == 2:
            _scaled_store(acc1, rows, sa, off_n + 128, c_ptr, w_scale_ptr, bias_ptr, M, N, stride_cm, layout,
                          HAS_BIAS)  # fmt: skip


@gluon.jit
def _fp8_ws_kernel(a_desc, w_desc, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, K, stride_cm,
                   NCONS: gl.constexpr, NSUB: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                   GROUP_M: gl.constexpr, HAS_BIAS: gl.constexpr, CONS_REGS: gl.constexpr,
                   REG_A: gl.constexpr):  # fmt: skip
    """Grid: one program per tile, or fewer (persistent: each walks the tiles num_programs apart)."""
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES * NCONS, 64, BLOCK_K], a_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 128 * NSUB, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=NCONS)
    fence_async_shared()

    if NCONS == 2:
        gl.warp_specialize([
            (_consumer, (a_smem, w_smem, ready, empty, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, K, stride_cm,
                         0, NCONS, NSUB, BLOCK_K, STAGES, GROUP_M, HAS_BIAS, REG_A)),
            (_consumer, (a_smem, w_smem, ready, empty, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, K, stride_cm,
                         1, NCONS, NSUB, BLOCK_K, STAGES, GROUP_M, HAS_BIAS, REG_A)),
            (_loader, (a_desc, w_desc, a_smem, w_smem, ready, empty, M, N, K, NCONS, NSUB, BLOCK_K, STAGES, GROUP_M)),
        ], [4, 1], [CONS_REGS, 24])  # fmt: skip
    else:
        gl.warp_specialize([
            (_consumer, (a_smem, w_smem, ready, empty, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, K, stride_cm,
                         0, NCONS, NSUB, BLOCK_K, STAGES, GROUP_M, HAS_BIAS, REG_A)),
            (_consumer, (a_smem, w_smem, ready, empty, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, K, stride_cm,
                         1, NCONS, NSUB, BLOCK_K, STAGES, GROUP_M, HAS_BIAS, REG_A)),
            (_consumer, (a_smem, w_smem, ready, empty, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, K, stride_cm,
                         2, NCONS, NSUB, BLOCK_K, STAGES, GROUP_M, HAS_BIAS, REG_A)),
            (_loader, (a_desc, w_desc, a_smem, w_smem, ready, empty, M, N, K, NCONS, NSUB, BLOCK_K, STAGES, GROUP_M)),
        ], [4, 4, 1], [CONS_REGS, CONS_REGS, 24])  # fmt: skip


def fp8_ws_matmul(qa, a_scale, qw, w_scale, bias=None, out_dtype=torch.bfloat16, ncons=2, nsub=1, stages=4,
                  group_m=8, cons_regs=232, maxnreg=None, programs=None, reg_a=False):  # fmt: skip
    """qa [M, K] e4m3 (per-row scales a_scale [M]) x qw [N, K] e4m3 (per-channel w_scale [N]) -> [M, N]."""
    m, k = qa.shape
    n = qw.shape[0]
    assert qa.dtype == qw.dtype == torch.float8_e4m3fn and k % 16 == 0 and a_scale.numel() == m
    block_k = 128
    a_layout = gl.NVMMASharedLayout.get_default_for([64, block_k], gl.float8e4nv)
    w_layout = gl.NVMMASharedLayout.get_default_for([128 * nsub, block_k], gl.float8e4nv)
    a_desc = TensorDescriptor.from_tensor(qa, [64, block_k], a_layout)
    w_desc = TensorDescriptor.from_tensor(qw, [128 * nsub, block_k], w_layout)
    out = torch.empty(m, n, device=qa.device, dtype=out_dtype)
    tiles = triton_cdiv(m, 64 * ncons) * triton_cdiv(n, 128 * nsub)
    grid = (tiles if programs is None else min(tiles, programs),)
    _fp8_ws_kernel[grid](
        a_desc, w_desc, out, a_scale, w_scale, bias if bias is not None else w_scale, m, n, k, out.stride(0),
        NCONS=ncons, NSUB=nsub, BLOCK_K=block_k, STAGES=stages, GROUP_M=group_m, HAS_BIAS=bias is not None,
        CONS_REGS=cons_regs, REG_A=reg_a, num_warps=4, **({} if maxnreg is None else {"maxnreg": maxnreg}),
    )  # fmt: skip
    return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


# name -> fp8_ws_matmul keywords: consumer groups, 128-column sub-tiles, stages, consumer registers, kernel maxnreg
# (None: Triton's), programs (None: one per tile), activation tile in registers; shared memory per stage: 8 KB x
# ncons + 16 KB x nsub (the H200 allows 227 KB)
SMS = 132
_2X2 = dict(ncons=2, nsub=2, stages=4, cons_regs=232)
VARIANTS = {
    "ws_2x2_s4": _2X2,
    "ws_2x2_s4_p": dict(_2X2, programs=SMS),
    "ws_2x2_s4_ra": dict(_2X2, reg_a=True),
    "ws_2x2_s4_p_ra": dict(_2X2, programs=SMS, reg_a=True),
    "ws_3x1_s5_p_ra": dict(ncons=3, nsub=1, stages=5, cons_regs=160, maxnreg=128, programs=SMS, reg_a=True),
    "ws_2x1_s6_p_ra": dict(ncons=2, nsub=1, stages=6, cons_regs=232, programs=SMS, reg_a=True),
    "ws_2x2_s3_p": dict(_2X2, stages=3, programs=SMS),
    "ws_2x2_s4_p_g4": dict(_2X2, programs=SMS, group_m=4),
    "ws_2x2_s4_p_g16": dict(_2X2, programs=SMS, group_m=16),
}


def compile_offline(ncons: int, nsub: int, stages: int, cons_regs: int, maxnreg: int | None = None,
                    programs: int | None = None, reg_a: bool = False, group_m: int = 8):  # fmt: skip
    """Compile for sm_90 without a GPU (Triton 3.6 on PYTHONPATH): registers, spills and the consumers' loop."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    qa = torch.empty(1024, 4096, dtype=torch.float8_e4m3fn)
    qw = torch.empty(4096, 4096, dtype=torch.float8_e4m3fn)
    a_desc = TensorDescriptor.from_tensor(qa, [64, 128], gl.NVMMASharedLayout.get_default_for([64, 128], gl.float8e4nv))
    w_layout = gl.NVMMASharedLayout.get_default_for([128 * nsub, 128], gl.float8e4nv)
    w_desc = TensorDescriptor.from_tensor(qw, [128 * nsub, 128], w_layout)
    fn = _fp8_ws_kernel
    sig = dict.fromkeys(fn.arg_names, "i32")
    sig.update(a_desc=mangle_type(a_desc), w_desc=mangle_type(w_desc), c_ptr="*bf16", a_scale_ptr="*fp32",
               w_scale_ptr="*fp32", bias_ptr="*fp32")  # fmt: skip
    const = dict(NCONS=ncons, NSUB=nsub, BLOCK_K=128, STAGES=stages, GROUP_M=group_m, HAS_BIAS=False,
                 CONS_REGS=cons_regs, REG_A=reg_a)  # fmt: skip
    sig.update(dict.fromkeys(const, "constexpr"))
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in ["c_ptr", "N", "K", "stride_cm"]}
    src = GluonASTSource(fn, sig, const, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": maxnreg})


def report_compile() -> None:
    from collections import Counter

    from sass_w4a16 import loop_body, machine_code

    for name, kw in VARIANTS.items():
        try:
            ck = compile_offline(**kw)
        except Exception as e:  # report every variant
            print(f"{name}: {type(e).__name__}: {str(e)[:3000]}")
            continue
        regs, stack, sass = machine_code(ck)
        body = loop_body(sass)
        ops = Counter(i.split()[0].split(".")[0] for i in body)
        print(f"{name}: regs {regs} stack {stack} smem {ck.metadata.shared} loop {len(body)}: "
              + " ".join(f"{op}:{c}" for op, c in ops.most_common(14)))  # fmt: skip
        Path(f"/tmp/{name}.sass").write_text(sass)


def main() -> None:
    if "--compile" in sys.argv:
        return report_compile()
    import bench_w8a8 as B8

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    ap.add_argument("--ms", default="1024,4096,16384")
    ap.add_argument("--variants", default="ws_2x2_s4_p", help=f"subset of {','.join(VARIANTS)}")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "probe_fp8_ws.json"
    timer, rows = B8.Timer(False, 10, 40), []
    for n, k, m, p, bf16 in B8.probe_points(args.ms, timer):
        row = {"n": n, "k": k, "m": m, "bf16_us": bf16}
        line = f"fp8 {n}x{k} M={m}: bf16 {bf16:.1f}"
        for name, (error, calls) in point_calls(p, args.variants.split(",")).items():
            try:
                err = error()
                us = timer.per_call(calls) * 1e6
            except Exception as e:  # a variant that fails must not end the probe
                print(f"  {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                err, us = float("nan"), float("nan")
            row[name] = {"us": us, "max_err": err}
            line += f" | {name} {bf16 / us:.2f}x err {err:.1e}"
        print(line, flush=True)
        rows.append(row)
        out.write_text(json.dumps(rows, indent=1))


def point_calls(p, names: list[str]) -> dict:
    """name -> (max |error| / max |exact| of the fp32 output on the first 1024 rows, one end-to-end call per
    rotation) for the committed promoted path, fast accumulation and the Gluon variants ``names``."""
    from quantkit.kernels import w8a8 as W

    rows = min(p.m, 1024)
    qa, sa = p.qa["fp8"][0][:rows], p.a_scale["fp8"][0][:rows].contiguous()
    wq, ws = p.wq["fp8"][0], p.w_scale["fp8"][0]
    exact = (qa.double() @ wq.double().t()) * sa.double()[:, None] * ws.double()[None, :]

    def error(matmul) -> callable:
        return lambda: ((matmul(qa, sa, wq, ws).double() - exact).abs().max() / exact.abs().max()).item()

    def committed(fast: bool, config: dict | None):
        calls = [partial(W.w8a8_linear, p.x[i], p.wq["fp8"][i], p.w_scale["fp8"][i], config=config, fp8_fast_accum=fast)
                 for i in range(p.r)]  # fmt: skip
        return error(partial(W.w8a8_matmul, out_dtype=torch.float32, config=config, fp8_fast_accum=fast)), calls

    def gluon_linear(x, wq, ws, kw):
        q, s = W.quantize_activations(x, "fp8")
        return fp8_ws_matmul(q, s, wq, ws, out_dtype=x.dtype, **kw)

    triton_promoted = W.pick_config(p.m, "fp8", False, p.n)  # given explicitly: the default is now the Gluon kernel
    out = {
        "promoted": committed(False, triton_promoted),
        "default": committed(False, None),
        "fast": committed(True, None),
    }
    for name in names:
        kw = VARIANTS[name]
        calls = [partial(gluon_linear, p.x[i], p.wq["fp8"][i], p.w_scale["fp8"][i], kw) for i in range(p.r)]
        out[name] = error(partial(fp8_ws_matmul, out_dtype=torch.float32, **kw)), calls
    return out


if __name__ == "__main__":
    main()
