"""W4A8 GEMM with one flat K loop (Triton): the same product as ``gemm.py``, software-pipelined by Triton.

What it computes
    The product of ``gemm.py`` (see its docstring): y = a_scale[m] * sum_g s[g, n] * sum_{k in g} qa[m, k] * (q - z)
    (+ bias), int8 or e4m3 activations, 4-bit GPTQ weights in ``KERNEL_LAYOUT``, one rounding to the output dtype.

Why a second kernel
    ``gemm.py`` loops over the groups and, inside each, over BLOCK_K steps with bounds known only at run time.
    Triton pipelines the inner loop only: its compiled sm_90 code (Triton 3.6) issues the first ``num_stages``
    tiles' loads at every group's start and drains them (wait for all) at its end, so with one or two K tiles per
    g128 group every group waits out a full memory latency. Here one loop runs over the K tiles of a program's
    range; each tile lies in one group (``plan_launch`` caps BLOCK_K to divide the group), whose zero points and
    scales it loads with the tile. Triton's pipeliner then keeps the next tiles' loads (cp.async into shared
    memory) in flight across group boundaries while the current tile is unpacked and multiplied.

How
    Per K tile: the weight tile is unpacked to int8 / e4m3 q - z in registers (``gemm.byte_tile`` or word by
    word), multiplied into a fresh int32 (fp32 for fp8) partial, converted and scaled by its group's s into the
    fp32 accumulator. One group (per-channel weights): one accumulator over all of K, chained through the MMA
    (int32 for int8, exact: |sum| <= 127 * 15 * K < 2**31 for K < 2**20; longer K converts per tile), scaled
    once at the end. SWAP_AB
    computes y.T = W @ qa.T: the unpacked weight tile is the MMA's left operand, which sm_90's wgmma reads from
    registers (the activation tile, the right operand, from shared memory): with the byte unpacking, Triton 3.6 reads
    the staged weight bytes from shared memory straight into the layout whose unpacked codes are wgmma's register
    operand, with no shared-memory round trip of the unpacked tile (``gemm.py`` stores it back before each MMA).
    Tiles, grouping, split-K and the epilogue as in ``gemm.py``.

Limits: those of ``gemm.py``; each tile's partial is waited for before its conversion (the MMA does not overlap its
own warp group's unpacking of the next tile; the second warp group's can). Hardware: compiled offline for sm_90 with
Triton 3.6 (IGMMA s8.s8 with the left operand in registers when SWAP_AB, no spills for ``dispatch.FLAT_TABLE``'s
tiles); opt-in (``W4A8Config.flat``) until timed on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from quantkit.kernels._device import interpreting
from quantkit.kernels.w4a8.gemm import byte_tile, codes_along_k, fixup_unroll, tile_operands
from quantkit.kernels.w4a16.epilogue import finish_tile
from quantkit.kernels.w4a16.weight import W4A16Weight


@triton.jit
def _group_zeros(qz_ptr, g, stride_qzg, stride_qzn, cols, cols_b, BYTES: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):  # fmt: skip
    """Zero points of group ``g``: (z [BN] int32, 128 - z per byte column [BK / 8, BN * 4] uint8) when BYTES, else
    (z, z)."""
    if BYTES:
        zw = tl.load(qz_ptr + g * stride_qzg + (cols_b // 8) * stride_qzn)
        zb = (128 - ((zw >> ((cols_b % 8) * 4)) & 15)).to(tl.uint8)
        return cols, tl.broadcast_to(zb[None, :], (BLOCK_K // 8, BLOCK_N * 4))
    else:
        zw = tl.load(qz_ptr + g * stride_qzg + (cols // 8) * stride_qzn)
        z = (zw >> ((cols % 8) * 4)) & 15
        return z, z


@triton.jit
def _weight_tile(qw_ptrs, qb_ptrs, z, zb, t, K, stride_qwk, offs_kw, IS_FP8: tl.constexpr, EVEN_K: tl.constexpr,
                 BYTES: tl.constexpr, USE_ASM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """K tile ``t`` of the weight as the MMA's 8-bit q - z [BLOCK_N, BLOCK_K] (int8, or e4m3 when IS_FP8)."""
    BLOCK_KW: tl.constexpr = BLOCK_K // 8
    if BYTES:
        wq = byte_tile(qb_ptrs, zb, t, K, stride_qwk * 4, offs_kw, EVEN_K, USE_ASM, BLOCK_N, BLOCK_K)
    else:
        if EVEN_K:
            words = tl.load(qw_ptrs + t * BLOCK_KW * stride_qwk)
        else:  # codes past K (padding of the last word) meet zero activations
            words = tl.load(qw_ptrs + t * BLOCK_KW * stride_qwk, mask=((t * BLOCK_KW + offs_kw) * 8 < K)[None, :],
                            other=0)  # fmt: skip
        wq = codes_along_k(words) - z[:, None]  # [BN, BK] in [-15, 15]
    if IS_FP8:
        return wq.to(tl.float16).to(tl.float8e4nv)  # exact: small integers
    else:
        return wq.to(tl.int8)


@triton.jit
def _mma(wq, a, acc, IS_FP8: tl.constexpr, SWAP_AB: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc += the tile's product: wq [BN, BK] @ a.T [BK, BM] when SWAP_AB, else a [BM, BK] @ wq.T, chained in the
    accumulator's type (int32 for int8; fp32 for e4m3, promoted every BLOCK_K of products on sm_90)."""
    if SWAP_AB:
        lhs = wq
        rhs = tl.trans(a)
    else:
        lhs = a
        rhs = tl.trans(wq)
    if IS_FP8:
        return tl.dot(lhs, rhs, acc, max_num_imprecise_acc=BLOCK_K)
    else:
        return tl.dot(lhs, rhs, acc, out_dtype=tl.int32)


@triton.jit
def _small_int_to_float(part):
    """int32 -> fp32, exact for |part| < 2**22: the bits of 1.5 * 2**23 plus part, read as a float, minus 1.5 * 2**23.
    An integer add and a float add, both full-rate, in place of I2F, which the CUDA guide's throughput table rates
    at a fraction of the float add's: 64 conversions per thread per 128 x 128 tile of a g128 weight."""
    return (part + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0


@triton.jit(do_not_specialize=["M", "group_tiles", "tiles_per_split"])
def _w4a8_flat_kernel(
    # pointers
    a_ptr, a_scale_ptr, qw_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr,
    # sizes
    M, N, K, group_tiles, tiles_per_split,
    # strides
    stride_am, stride_ak, stride_qwk, stride_qwn, stride_qzg, stride_qzn, stride_sg, stride_sn, stride_om, stride_on,
    # meta-parameters
    IS_FP8: tl.constexpr, SWAP_AB: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BYTES: tl.constexpr, USE_ASM: tl.constexpr, EMULATE_BF16: tl.constexpr, ONE_GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, FIXUP: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m, offs_n, offs_k, offs_kw, rows, cols, cols_b, a_ptrs, qw_ptrs, qb_ptrs = tile_operands(
        pid, a_ptr, qw_ptr, M, N, stride_am, stride_ak, stride_qwk, stride_qwn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M
    )

    k_tiles = tl.cdiv(K, BLOCK_K)
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, k_tiles)
    PART_DTYPE: tl.constexpr = tl.float32 if IS_FP8 else tl.int32
    ACC_DTYPE: tl.constexpr = PART_DTYPE if ONE_GROUP else tl.float32
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=ACC_DTYPE)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
    z, zb = _group_zeros(qz_ptr, 0, stride_qzg, stride_qzn, cols, cols_b, BYTES, BLOCK_N, BLOCK_K)
    for t in range(t_begin, t_end):
        k0 = t * BLOCK_K
        if EVEN_K:
            a = tl.load(a_ptrs + k0 * stride_ak)
        else:
            a = tl.load(a_ptrs + k0 * stride_ak, mask=(k0 + offs_k < K)[None, :], other=0.0)
        g = t // group_tiles
        if not ONE_GROUP:
            z, zb = _group_zeros(qz_ptr, g, stride_qzg, stride_qzn, cols, cols_b, BYTES, BLOCK_N, BLOCK_K)
        wq = _weight_tile(qw_ptrs, qb_ptrs, z, zb, t, K, stride_qwk, offs_kw, IS_FP8, EVEN_K, BYTES, USE_ASM, BLOCK_N,
                          BLOCK_K)  # fmt: skip
        if ONE_GROUP:
            acc = _mma(wq, a, acc, IS_FP8, SWAP_AB, BLOCK_K)
        else:
            s = tl.load(s_ptr + g * stride_sg + cols * stride_sn).to(tl.float32)  # [BN]
            if SWAP_AB:
                part = _mma(wq, a, tl.zeros((BLOCK_N, BLOCK_M), dtype=PART_DTYPE), IS_FP8, SWAP_AB, BLOCK_K)
            else:
                part = _mma(wq, a, tl.zeros((BLOCK_M, BLOCK_N), dtype=PART_DTYPE), IS_FP8, SWAP_AB, BLOCK_K)
            if not IS_FP8:  # |part| <= 127 * 15 * BLOCK_K < 2**22
                tl.static_assert(BLOCK_K * 127 * 15 < 2**22)
                part = _small_int_to_float(part)
            if SWAP_AB:
                acc += part * s[:, None]
            else:
                acc += part * s[None, :]
    if ONE_GROUP:
        s = tl.load(s_ptr + cols * stride_sn).to(tl.float32)
        if SWAP_AB:
            acc = acc.to(tl.float32) * s[:, None]
        else:
            acc = acc.to(tl.float32) * s[None, :]
    if SWAP_AB:
        acc = tl.trans(acc)  # [BM, BN]

    y = acc * tl.load(a_scale_ptr + rows)[:, None]
    finish_tile(y, bias_ptr, out_ptr, part_ptr, lock_ptr, pid, offs_m, offs_n, M, N, stride_om, stride_on, SPLIT,
                HAS_BIAS, EMULATE_BF16, FIXUP)  # fmt: skip


def launch_flat(qa, a_scale, w: W4A16Weight, bias, out, cfg, plan) -> None:
    """Run the flat-loop GEMM with tile config ``cfg`` and launch plan ``plan`` (as ``gemm.launch``) on checked
    operands."""
    m, k = qa.shape
    n = w.out_features
    part = out
    if plan.split > 1:
        part = torch.empty(plan.split, m, n, dtype=torch.float32, device=qa.device)
    _w4a8_flat_kernel[plan.grid](
        qa, a_scale, w.qweight, w.qzeros, w.scales, bias if bias is not None else a_scale, out, part, w.locks,
        m, n, k, plan.group_tiles, plan.tiles_per_split,
        qa.stride(0), qa.stride(1), w.qweight.stride(0), w.qweight.stride(1), w.qzeros.stride(0), w.qzeros.stride(1),
        w.scales.stride(0), w.scales.stride(1), out.stride(0), out.stride(1),
        IS_FP8=qa.dtype == torch.float8_e4m3fn, SWAP_AB=cfg.swap_ab, SPLIT=plan.split > 1, HAS_BIAS=bias is not None,
        EVEN_K=k % plan.block_k == 0, BYTES=cfg.byte_unpack and w.qweight.stride(1) == 1,
        USE_ASM=not interpreting(), EMULATE_BF16=interpreting() and out.dtype == torch.bfloat16,
        ONE_GROUP=plan.group_tiles >= -(-k // plan.block_k) and k < 2**20, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=plan.block_k, GROUP_M=cfg.group_m, FIXUP=fixup_unroll(cfg.block_m, cfg.block_n),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
