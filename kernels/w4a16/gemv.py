"""Skinny-M W4A16 / W8A16 product without tensor cores: y = x @ W.T + bias for a few rows of x (decode).

What it computes
    y[m, n] = sum_k x[m, k] * s[g(k), n] * (q[k, n] - z[g(k), n]) + bias[n] for M rows (any M; meant for M <= ~8),
    fp32 accumulation, y in x's dtype. Same buffers as ``gemm.py`` (``W4A16Weight``: GPTQ-v2 qweight int32
    [ceil(K/32)*b, N] packed along K lowest bits first, qzeros int32 [n_g, ceil(N/32)*b], scales fp16 [n_g, N],
    groups contiguous along K).

How
    A CTA owns BLOCK_N output columns (threads and warps only along N, 16-byte loads of packed words: BLOCK_N =
    128 * num_warps keeps 4 columns per thread, so every thread holds whole columns of a K tile and the K
    reduction never leaves the thread) and a K slice of whole tiles (split-K over grid axis 1, fixed up by
    ``epilogue.finish_tile``). x (the same address in every thread) is read straight from L1, four
    activations per 8-byte load with ``vector_x`` (folded path, aligned rows; ``_x_lane`` splits them exactly).
    A tile is BLOCK_K codes of one group, so the scale is applied once per tile and column:
    sum_k x_k s (q_k - z) = s * sum_k x_k (q_k - z).
    Unpacking is exact and needs no int->float conversion: for the i-th code of a 16-bit half word,
    (w & (mask << b*i)) | 0x4B000000 read as fp32 is 2**23 + q * 2**(b*i) (one LOP3); subtracting
    2**23 + z * 2**(b*i) leaves (q - z) * 2**(b*i) exactly (one FADD); one FFMA per row of x accumulates it, and
    the per-position factor 2**-(b*i) is applied once per tile to the per-position sums: 4.2 SASS instructions
    per 4-bit weight at M = 1 (Triton 3.6, sm_90). fold_zero (4-bit) takes the FADD and the zero out of the
    inner loop (``_tile_mac_folded``): 3.7. Magic constants are run-time arguments (see the kernel's signature).
    Rows of x are a tensor dimension, so each weight is loaded once for all rows; each extra row costs one FFMA
    per weight, which is why tensor cores (``gemm.py``) take over from M ~ 4.

Why it looks like this (H200)
    M = 1 streams 2.3 TB/s of weight bytes on 28672 x 8192 (55% of the copy bandwidth; 2.3-2.4x cuBLAS fp16),
    1.7 TB/s on 8192 x 8192. The loop is bound by load latency and instruction issue together, not by either alone
    (Nsight Compute: issue slots 63% busy, 5.8 cycles between a warp's instructions, 2.3 of them waiting on global
    loads, 5 CTAs of 4 warps per SM). ptxas issues each word row's load just before its use (96 registers), so
    each carries an exposed memory latency. What was tried and dropped:
    - num_stages >= 2 (Triton pipelines the loads through shared memory, cp.async): 10-25% slower (two CTA
      barriers per tile, 36-71 KB of shared memory per CTA), so the table runs num_stages = 1.
    - a K-major weight layout (32 codes of one column per 16-byte load): 4.6-6.0 instructions per weight, 25-35%
      slower on the large shapes.
    - forcing every weight load of a tile to issue first (``prefetch`` alone: ptxas sinks the prefetched loads to
      the last ~15% of the loop body): registers 96 -> 128, 0.89-1.04x per cell, most variants slower.
    - 16-bit pair arithmetic (two codes per LOP3, HSUB2 and HFMA2, each word's 8 products summed in 16 bits before
      fp32): 3.0 instead of 3.6 SASS instructions per weight, 80 registers, yet 0.80-0.89x at M = 1 (geomean)
      and 1.03x at M = 2, at 1.1-1.4x PyTorch's same-dtype error: a third instruction cut that bought nothing.
    - asking L2 for the tile 1, 2 or 4 steps ahead (``prefetch.global.L2``): 7-23% slower at M = 1, the farther
      ahead the slower: with the whole grid resident, every CTA's look-ahead adds up to the size of the L2; splits
      that fill exactly one wave of resident CTAs gained nothing either.
    Kept: fold_zero (12% fewer instructions, ~2%), vector_x (x loads 3x fewer, 0-7%, so x's L1 latency was not the
    limit either) and ``fixup_unroll``: the M = 1 plan splits K until ~4 x SMs CTAs exist (a 4096 x 4096 layer: 8
    output tiles x 32 splits of one 128-deep tile), and the last CTA of each tile summed the 32 partials four per
    round, eight dependent L2 round trips; loading all 32 at once made the small layers 10-20% faster. Small
    layers still pay ~7 us of fixed cost (launch, first loads, split-K fix-up).

Limits: 4 or 8 bits; BLOCK_K must divide the group size (``configs.plan_launch`` sees to it); int32 offsets.
Hardware: written for the H200 (sm_90, 132 SMs); register and SASS counts from offline sm_90 compiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from quantkit.kernels._device import interpreting, num_sms
from quantkit.kernels.w4a16.configs import KernelConfig, fixup_unroll, plan_launch
from quantkit.kernels.w4a16.epilogue import finish_tile
from quantkit.kernels.w4a16.weight import W4A16Weight, check_operands, unpack_gptq_codes

MAGIC_F32 = 0x4B000000  # an integer v < 2**23 OR-ed into it reads as the fp32 2**23 + v


def w4a16_gemv_reference(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                         group_size: int, bits: int, bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Plain PyTorch in float64, groups contiguous (``group_size`` 0: one group): y = x @ W (+ bias), x's dtype."""
    k, n = x.shape[-1], qweight.shape[1]
    q = unpack_gptq_codes(qweight, bits, k).double()  # [K, N]
    z = unpack_gptq_codes(qzeros.t().contiguous(), bits, n).t().double()  # [n_g, N]
    g = torch.arange(k, device=x.device) // (group_size or k)
    y = x.double() @ ((q - z[g]) * scales.double()[g])
    return (y if bias is None else y + bias.double()).to(x.dtype)


@triton.jit
def load_tile(qw_ptr, qz_ptr, s_ptr, t, offs_n, N, K, group_size, stride_qwk, stride_qwn, stride_qzg,
              stride_qzn, stride_sg, stride_sn, BITS: tl.constexpr, BLOCK_K: tl.constexpr,
              EVEN_K: tl.constexpr):  # fmt: skip
    """Weight loads of K tile t: words [BKW, BN], scales and integer zeros [BN]."""
    PF: tl.constexpr = 32 // BITS
    BKW: tl.constexpr = BLOCK_K // PF
    offs_r = t * BKW + tl.arange(0, BKW)
    n_mask = offs_n < N
    w_mask = n_mask[None, :] if EVEN_K else (offs_r * PF < K)[:, None] & n_mask[None, :]
    words = tl.load(qw_ptr + offs_r[:, None] * stride_qwk + offs_n[None, :] * stride_qwn, mask=w_mask, other=0,
                    eviction_policy="evict_first")  # fmt: skip
    grp = (t * BLOCK_K) // group_size
    scales = tl.load(s_ptr + grp * stride_sg + offs_n * stride_sn, mask=n_mask, other=0.0)
    zw = tl.load(qz_ptr + grp * stride_qzg + (offs_n // PF) * stride_qzn, mask=n_mask, other=0)
    zeros = (zw >> ((offs_n % PF) * BITS)) & ((1 << BITS) - 1)
    return words, scales, zeros


@triton.jit
def _tile_mac(acc, words, scales, zeros, x_ptr, t, m0, M, K, stride_xm, stride_xk, magic, sixteen,
              BITS: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):  # fmt: skip
    """acc [BM, BN] += scales * sum over K tile t of x[m0:m0+BM] * (q - z), in fp32 (exact unpacking, see header).

    Word rows are taken one at a time ([BN] vectors, all in registers already) so that each code's product
    accumulates with one FFMA into a per-position partial sum p_i [BM, BN] (a tl.sum over the tile's rows compiles
    to a tree: half the products become FMUL + FADD). x comes as [BM] vectors, one per k: the same address in
    every thread, one broadcast load per warp (wider vector loads of x made Triton spread them over lanes).
    """
    PF: tl.constexpr = 32 // BITS
    H: tl.constexpr = PF // 2
    QM: tl.constexpr = (1 << BITS) - 1
    offs_bm = tl.minimum(m0 + tl.arange(0, acc.shape[0]), M - 1)  # rows past M repeat row M-1 (their output is masked)
    x_rows = x_ptr + offs_bm * stride_xm
    k0 = t * BLOCK_K
    zf0 = (zeros | magic).to(tl.float32, bitcast=True)[None, :]  # 2**23 + z
    zf1 = ((zeros << BITS) | magic).to(tl.float32, bitcast=True)[None, :]  # 2**23 + z 2**b
    if BITS == 4:
        zf2 = ((zeros << 8) | magic).to(tl.float32, bitcast=True)[None, :]
        zf3 = ((zeros << 12) | magic).to(tl.float32, bitcast=True)[None, :]
    p0 = tl.zeros(acc.shape, tl.float32)
    p1 = tl.zeros(acc.shape, tl.float32)
    p2 = tl.zeros(acc.shape, tl.float32)
    p3 = tl.zeros(acc.shape, tl.float32)
    for r in tl.static_range(words.shape[0]):
        w = _row(words, r)
        k_r = k0 + r * PF
        for h in tl.static_range(2):
            src = w if h == 0 else w >> sixteen
            for i in tl.static_range(H):
                x = _x_at(x_rows, offs_bm, k_r + h * H + i, K, stride_xk, EVEN_K)[:, None]
                f = ((src & (QM << (BITS * i))) | magic).to(tl.float32, bitcast=True)[None, :]
                if i == 0:
                    p0 = tl.fma(x, f - zf0, p0)
                elif i == 1:
                    p1 = tl.fma(x, f - zf1, p1)
                elif i == 2:
                    p2 = tl.fma(x, f - zf2, p2)
                else:
                    p3 = tl.fma(x, f - zf3, p3)
    if BITS == 4:
        t_sum = p0 + p1 * (1.0 / 16) + p2 * (1.0 / 256) + p3 * (1.0 / 4096)
    else:
        t_sum = p0 + p1 * (1.0 / 256)
    return acc + scales.to(tl.float32)[None, :] * t_sum


@triton.jit
def _tile_mac_folded(acc, words, scales, zeros, x_ptr, t, m0, M, K, stride_xm, stride_xk, magic, sixteen,
                     BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, X_VEC: tl.constexpr):  # fmt: skip
    """``_tile_mac`` for 4-bit codes with the zero point and the magic offset folded out of the inner loop.

    Every code is moved to mantissa bits 12-15 (even k) or 16-19 (odd k) of its own copy of the word (four shifts
    per word, each serving two codes), so (s & mask) | MAGIC reads as 2**23 + q * 2**12 (or 2**16) and is
    multiplied into the sum as it is: one LOP3 + one FFMA per code, no FADD. The offsets come off once per tile
    and column: sum x (2**23 + q 2**p) - (2**23 + z 2**p) sum x = 2**p sum x (q - z), with sum x accumulated
    per row of x in fp32. Rounding: partial sums carry the 2**23 offsets, so each FFMA rounds at ~2**-24 of
    sum |x| 2**23 = sum |x| / 2, i.e. 2**-13 (bits 12-15) or 2**-17 (bits 16-19) of one unit of q: below a
    quarter of fp16's own rounding of W = s (q - z) (2**-12 of |q - z| <= 15 units), far below bf16's.
    """
    offs_bm = tl.minimum(m0 + tl.arange(0, acc.shape[0]), M - 1)
    x_rows = x_ptr + offs_bm * stride_xm
    k0 = t * BLOCK_K
    four = sixteen >> 2  # run-time shift amounts: constant ones let LLVM fold each shift into its code's mask
    twelve = sixteen - four
    p_even = tl.zeros(acc.shape, tl.float32)  # sum x (2**23 + q 2**12) over even k
    p_odd = tl.zeros(acc.shape, tl.float32)  # sum x (2**23 + q 2**16) over odd k
    x_even = tl.zeros((acc.shape[0],), tl.float32)
    x_odd = tl.zeros((acc.shape[0],), tl.float32)
    for r in tl.static_range(words.shape[0]):
        w = _row(words, r)
        k_r = k0 + r * 8
        if X_VEC:  # the word's 8 activations in two 8-byte loads
            q_lo = tl.load(x_rows.to(tl.pointer_type(tl.int64)) + k_r // 4)
            q_hi = tl.load(x_rows.to(tl.pointer_type(tl.int64)) + k_r // 4 + 1)
        for i in tl.static_range(4):
            fa, fb = _folded_pair(w, i, magic, four, twelve)
            if X_VEC:
                quad = q_lo if i < 2 else q_hi
                xa = _x_lane(quad, 2 * (i % 2), x_ptr.dtype.element_ty)
                xb = _x_lane(quad, 2 * (i % 2) + 1, x_ptr.dtype.element_ty)
            else:
                xa = _x_at(x_rows, offs_bm, k_r + 2 * i, K, stride_xk, EVEN_K)
                xb = _x_at(x_rows, offs_bm, k_r + 2 * i + 1, K, stride_xk, EVEN_K)
            p_even = tl.fma(xa[:, None], fa[None, :], p_even)
            p_odd = tl.fma(xb[:, None], fb[None, :], p_odd)
            x_even += xa
            x_odd += xb
    zf_even = ((zeros << 12) | magic).to(tl.float32, bitcast=True)[None, :]  # 2**23 + z 2**12
    zf_odd = ((zeros << 16) | magic).to(tl.float32, bitcast=True)[None, :]  # 2**23 + z 2**16
    t_even = tl.fma(-x_even[:, None], zf_even, p_even)  # 2**12 sum x (q - z), one rounding
    t_odd = tl.fma(-x_odd[:, None], zf_odd, p_odd)
    t_sum = t_even * (1.0 / 4096) + t_odd * (1.0 / 65536)
    return acc + scales.to(tl.float32)[None, :] * t_sum


@triton.jit
def _folded_pair(w, i: tl.constexpr, magic, four, twelve):
    """Codes 2i and 2i + 1 of 4-bit words w as fp32 2**23 + q * 2**12 and 2**23 + q * 2**16 (``_tile_mac_folded``):
    one shift moves code 2i to bits 12-15 and code 2i + 1 to bits 16-19, one LOP3 each masks and ORs the magic."""
    if i == 0:
        src = w << twelve
    elif i == 1:
        src = w << four
    elif i == 2:
        src = w >> four
    else:
        src = w >> twelve
    fa = ((src & 0xF000) | magic).to(tl.float32, bitcast=True)
    fb = ((src & 0xF0000) | magic).to(tl.float32, bitcast=True)
    return fa, fb


@triton.jit
def _x_at(x_rows, offs_bm, kk, K, stride_xk, EVEN_K: tl.constexpr):
    """x[rows, kk] as fp32 [BM]: the same address in every thread (one broadcast load per warp)."""
    if EVEN_K:
        x = tl.load(x_rows + kk * stride_xk)
    else:
        x = tl.load(x_rows + kk * stride_xk, mask=offs_bm * 0 + kk < K, other=0.0)
    return x.to(tl.float32)


@triton.jit
def _x_lane(quad, j: tl.constexpr, act: tl.constexpr):
    """Activation j of four 16-bit ones loaded as one int64 (lowest address in the lowest bits), as fp32: exact."""
    half = (quad >> (32 * (j // 2))).to(tl.int32)  # a register of the pair: no instruction
    if act == tl.bfloat16:  # a bf16 is the high half of the fp32 of the same value
        return (half << 16 if j % 2 == 0 else half & -65536).to(tl.float32, bitcast=True)
    else:
        return (half >> (16 * (j % 2))).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _row(words, r: tl.constexpr):
    """Row r of words [R, BN] as a [BN] vector (a register selection: every thread holds all R rows)."""
    return tl.sum(tl.where(tl.arange(0, words.shape[0])[:, None] == r, words, 0), axis=0)


@triton.jit
def mac_tile(acc, words, scales, zeros, x_ptr, t, m0, M, K, stride_xm, stride_xk, magic, sixteen, BITS: tl.constexpr,
             BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, FOLD: tl.constexpr, X_VEC: tl.constexpr):  # fmt: skip
    """acc + K tile t's product (``_tile_mac_folded`` where FOLD, else ``_tile_mac``); also the MoE decode path's."""
    if FOLD:
        return _tile_mac_folded(acc, words, scales, zeros, x_ptr, t, m0, M, K, stride_xm, stride_xk, magic,
                                sixteen, BLOCK_K, EVEN_K, X_VEC)  # fmt: skip
    else:
        return _tile_mac(acc, words, scales, zeros, x_ptr, t, m0, M, K, stride_xm, stride_xk, magic, sixteen,
                         BITS, BLOCK_K, EVEN_K)  # fmt: skip


@triton.jit
def _program_tile(N, K, tiles_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's output tile and K slice: (tile id, first row, columns, K tiles in all, first and end K tile)."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    offs_n = (pid % num_pid_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    t_begin = tl.program_id(1) * tiles_per_split
    return pid, (pid // num_pid_n) * BLOCK_M, offs_n, k_tiles, t_begin, tl.minimum(t_begin + tiles_per_split, k_tiles)


@triton.jit(do_not_specialize=["M", "group_size", "tiles_per_split", "magic", "sixteen"])
def _w4a16_gemv_kernel(
    # pointers
    x_ptr, qw_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr,
    # sizes
    M, N, K, group_size, tiles_per_split,
    # constants passed at run time (MAGIC_F32, 16), so that the compiler keeps them in registers and the bit masks
    # become the immediates of single LOP3s (as compile-time constants they were re-materialized at every use)
    magic, sixteen,
    # strides
    stride_xm, stride_xk, stride_qwk, stride_qwn, stride_qzg, stride_qzn, stride_sg, stride_sn, stride_om, stride_on,
    # meta-parameters
    BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, STAGES: tl.constexpr, FOLD: tl.constexpr, PREFETCH: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr, EMULATE_BF16: tl.constexpr, X_VEC: tl.constexpr, FIXUP: tl.constexpr,
):  # fmt: skip
    pid, m0, offs_n, k_tiles, t_begin, t_end = _program_tile(N, K, tiles_per_split, BLOCK_M, BLOCK_N, BLOCK_K)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PREFETCH:  # software pipelining in registers: tile t + 1's loads are in flight during tile t's arithmetic
        t_last = tl.minimum(t_end, k_tiles) - 1
        words, scales, zeros = load_tile(qw_ptr, qz_ptr, s_ptr, tl.minimum(t_begin, t_last), offs_n, N, K,
                                         group_size, stride_qwk, stride_qwn, stride_qzg, stride_qzn, stride_sg,
                                         stride_sn, BITS, BLOCK_K, EVEN_K)  # fmt: skip
        for t in tl.range(t_begin, t_end, num_stages=1):
            # the last tile reloads itself (an L2 hit) rather than reading past the split
            w_next, s_next, z_next = load_tile(qw_ptr, qz_ptr, s_ptr, tl.minimum(t + 1, t_last), offs_n, N, K,
                                               group_size, stride_qwk, stride_qwn, stride_qzg, stride_qzn,
                                               stride_sg, stride_sn, BITS, BLOCK_K, EVEN_K)  # fmt: skip
            acc = mac_tile(acc, words, scales, zeros, x_ptr, t, m0, M, K, stride_xm, stride_xk, magic,
                           sixteen, BITS, BLOCK_K, EVEN_K, FOLD, X_VEC)  # fmt: skip
            words, scales, zeros = w_next, s_next, z_next
    else:
        # STAGES >= 2: Triton pipelines the tile's loads through shared memory (cp.async, STAGES - 1 tiles ahead);
        # STAGES = 1: plain loads, each issued by ptxas just before its use
        for t in tl.range(t_begin, t_end, num_stages=STAGES):
            words, scales, zeros = load_tile(qw_ptr, qz_ptr, s_ptr, t, offs_n, N, K, group_size, stride_qwk,
                                             stride_qwn, stride_qzg, stride_qzn, stride_sg, stride_sn, BITS,
                                             BLOCK_K, EVEN_K)  # fmt: skip
            acc = mac_tile(acc, words, scales, zeros, x_ptr, t, m0, M, K, stride_xm, stride_xk, magic,
                           sixteen, BITS, BLOCK_K, EVEN_K, FOLD, X_VEC)  # fmt: skip
    finish_tile(acc, bias_ptr, out_ptr, part_ptr, lock_ptr, pid, offs_m, offs_n, M, N, stride_om, stride_on,
                 SPLIT, HAS_BIAS, EMULATE_BF16, FIXUP)  # fmt: skip


def w4a16_gemv(
    x: torch.Tensor,
    w: W4A16Weight,
    config: KernelConfig,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
):
    """y [M, N] = x [M, K] @ W.T + bias with the CUDA-core kernel; x is already in kernel channel order.

    Returns (y, compiled kernel handle).
    """
    check_operands(x, w, bias, out)
    if config.method != "gemv":
        raise ValueError(f"w4a16_gemv runs the gemv kernel; config {config.name} asks for {config.method!r}")
    m, k = x.shape
    n = w.out_features
    plan = plan_launch(config, m, n, k, w.group_size, num_sms(x.device))
    if out is None:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    part = out
    if plan.split_k > 1:
        part = torch.empty(plan.split_k, m, n, device=x.device, dtype=torch.float32)
    handle = _w4a16_gemv_kernel[plan.grid](
        x, w.qweight, w.qzeros, w.scales, bias if bias is not None else out, out, part, w.locks,
        m, n, k, w.group_size or 2**30, plan.tiles_per_split, MAGIC_F32, 16,
        x.stride(0), x.stride(1), w.qweight.stride(0), w.qweight.stride(1), w.qzeros.stride(0), w.qzeros.stride(1),
        w.scales.stride(0), w.scales.stride(1), out.stride(0), out.stride(1),
        BITS=w.bits, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=plan.block_k,
        SPLIT=plan.split_k > 1, STAGES=config.num_stages, FOLD=config.fold_zero and w.bits == 4,
        PREFETCH=config.prefetch,
        HAS_BIAS=bias is not None, EVEN_K=k % plan.block_k == 0,
        EMULATE_BF16=interpreting() and x.dtype == torch.bfloat16,
        X_VEC=reads_x_by_four(config, w.bits, x, plan.block_k),
        FIXUP=fixup_unroll(config),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out, handle


def reads_x_by_four(config: KernelConfig, bits: int, x: torch.Tensor, block_k: int) -> bool:
    """Whether the kernel may read x four activations per 8-byte load: asked for (``vector_x``, folded 4-bit
    path), whole K tiles, unit column stride and every row 8-byte aligned; otherwise one load per activation."""
    aligned = x.stride(1) == 1 and x.data_ptr() % 8 == 0 and (x.shape[0] == 1 or x.stride(0) % 4 == 0)
    return config.vector_x and config.fold_zero and bits == 4 and x.shape[1] % block_k == 0 and aligned
