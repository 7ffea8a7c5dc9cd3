"""Probe, not part of the package: a K-major M = 1 W4A16 gemv, weight words stored [N, K/8].

Same codes as the GPTQ layout (word w holds k = 8*kw + i at bits 4i), transposed so that one thread's 16-byte
load holds 32 consecutive codes of one output column; threads along K, one tl.sum over K at the end; the zero
point and the magic-number offset folded out as in ``w4a16_gemv._tile_mac_folded``. Measured 25-35% slower than
the committed N-major gemv on the large H200 shapes (results/w4a16-h200-2026-12-02.md): every code needs its own
activation, 4.6-6.0 instructions per weight against 3.7. Checked against the float64 reference by probe_gemv.py
on every run (and in Triton's interpreter: ``TRITON_INTERPRET=1``, M = 1, any K and group).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from quantkit.kernels.w4a16_epilogue import _finish_tile
from quantkit.kernels.w4a16_gemv import _folded_pair

MAGIC_F32 = 0x4B000000


@triton.jit
def _xk(x_ptr, kw, i: tl.constexpr, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        x = tl.load(x_ptr + kw * 8 + i)
    else:
        x = tl.load(x_ptr + kw * 8 + i, mask=kw * 8 + i < K, other=0.0)
    return x.to(tl.float32)


@triton.jit
def _load_w(qw_ptr, offs_n, n_mask, kw, K, stride_qwn, EVEN_K: tl.constexpr):
    if EVEN_K:
        mask = n_mask[:, None]
    else:
        mask = n_mask[:, None] & (kw * 8 < K)[None, :]
    return tl.load(qw_ptr + offs_n[:, None] * stride_qwn + kw[None, :], mask=mask, other=0,
                   eviction_policy="evict_first")  # fmt: skip


@triton.jit
def _tile(acc, w, x_ptr, qz_ptr, s_ptr, t, offs_n, n_mask, offs_w, K, group_size, stride_qzg, stride_sg, magic,
          four, twelve, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, XPAIR: tl.constexpr,
          X_BF16: tl.constexpr):  # fmt: skip
    BKW: tl.constexpr = BLOCK_K // 8
    kw = t * BKW + offs_w
    grp = (t * BLOCK_K) // group_size
    s = tl.load(s_ptr + grp * stride_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    zw = tl.load(qz_ptr + grp * stride_qzg + offs_n // 8, mask=n_mask, other=0)
    z = (zw >> ((offs_n % 8) * 4)) & 0xF
    p_even = tl.zeros(acc.shape, tl.float32)
    p_odd = tl.zeros(acc.shape, tl.float32)
    x_even = tl.zeros((BKW,), tl.float32)
    x_odd = tl.zeros((BKW,), tl.float32)
    for i in tl.static_range(4):
        fa, fb = _folded_pair(w, i, magic, four, twelve)
        if XPAIR:  # x_ptr is x viewed as int32: one 4-byte load holds x[8kw + 2i] (low half) and x[8kw + 2i + 1]
            if EVEN_K:
                xw = tl.load(x_ptr + kw * 4 + i)
            else:
                xw = tl.load(x_ptr + kw * 4 + i, mask=kw * 8 + 2 * i < K, other=0)
            if X_BF16:
                xa = (xw << 16).to(tl.float32, bitcast=True)
                xb = (xw & -65536).to(tl.float32, bitcast=True)
            else:
                xa = (xw & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
                xb = (xw >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        else:
            xa = _xk(x_ptr, kw, 2 * i, K, EVEN_K)
            xb = _xk(x_ptr, kw, 2 * i + 1, K, EVEN_K)
        p_even = tl.fma(xa[None, :], fa, p_even)
        p_odd = tl.fma(xb[None, :], fb, p_odd)
        x_even += xa
        x_odd += xb
    zf_even = ((z << 12) | magic).to(tl.float32, bitcast=True)[:, None]
    zf_odd = ((z << 16) | magic).to(tl.float32, bitcast=True)[:, None]
    t_even = tl.fma(-x_even[None, :], zf_even, p_even)
    t_odd = tl.fma(-x_odd[None, :], zf_odd, p_odd)
    return tl.fma(s[:, None], t_even * (1.0 / 4096) + t_odd * (1.0 / 65536), acc)


@triton.jit(do_not_specialize=["group_size", "tiles_per_split", "magic", "sixteen"])
def _gemv_k_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr,
    N, K, group_size, tiles_per_split, magic, sixteen,
    stride_qwn, stride_qzg, stride_sg,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr, EMULATE_BF16: tl.constexpr, XPAIR: tl.constexpr, X_BF16: tl.constexpr,
):  # fmt: skip
    BKW: tl.constexpr = BLOCK_K // 8
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_w = tl.arange(0, BKW)
    k_tiles = tl.cdiv(K, BLOCK_K)
    t_begin = tl.program_id(1) * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, k_tiles)
    four = sixteen >> 2
    twelve = sixteen - four
    acc = tl.zeros((BLOCK_N, BKW), tl.float32)
    if PREFETCH:
        t_last = t_end - 1
        w = _load_w(qw_ptr, offs_n, n_mask, tl.minimum(t_begin, t_last) * BKW + offs_w, K, stride_qwn, EVEN_K)
        for t in tl.range(t_begin, t_end, num_stages=1):
            w_next = _load_w(qw_ptr, offs_n, n_mask, tl.minimum(t + 1, t_last) * BKW + offs_w, K, stride_qwn, EVEN_K)
            acc = _tile(acc, w, x_ptr, qz_ptr, s_ptr, t, offs_n, n_mask, offs_w, K, group_size, stride_qzg,
                        stride_sg, magic, four, twelve, BLOCK_K, EVEN_K, XPAIR, X_BF16)  # fmt: skip
            w = w_next
    else:
        for t in tl.range(t_begin, t_end, num_stages=1):
            w = _load_w(qw_ptr, offs_n, n_mask, t * BKW + offs_w, K, stride_qwn, EVEN_K)
            acc = _tile(acc, w, x_ptr, qz_ptr, s_ptr, t, offs_n, n_mask, offs_w, K, group_size, stride_qzg,
                        stride_sg, magic, four, twelve, BLOCK_K, EVEN_K, XPAIR, X_BF16)  # fmt: skip
    y = tl.sum(acc, axis=1)[None, :]
    offs_m = tl.arange(0, 1)
    _finish_tile(y, bias_ptr, out_ptr, part_ptr, lock_ptr, pid_n, offs_m, offs_n, 1, N, N, 1, SPLIT, HAS_BIAS,
                 EMULATE_BF16)  # fmt: skip


def kmajor_words(qweight: torch.Tensor) -> torch.Tensor:
    """GPTQ qweight int32 [K/8, N] -> [N, K/8] contiguous (the same words, transposed)."""
    return qweight.t().contiguous()


def gemv_k(x, qw_t, qzeros, scales, group_size, locks, block_n=64, block_k=128, num_warps=4, split_waves=4,
           num_sms=132, bias=None, prefetch=False, xpair=False):  # fmt: skip
    m, k = x.shape
    assert m == 1
    n = qw_t.shape[0]
    g = group_size or k
    while g % block_k:
        block_k //= 2
    k_tiles = triton.cdiv(k, block_k)
    tiles = triton.cdiv(n, block_n)
    split = max(1, min(triton.cdiv(split_waves * num_sms, tiles), k_tiles)) if split_waves else 1
    tps = triton.cdiv(k_tiles, split)
    split = triton.cdiv(k_tiles, tps)
    out = torch.empty(1, n, device=x.device, dtype=x.dtype)
    part = torch.empty(split, 1, n, device=x.device, dtype=torch.float32) if split > 1 else out
    _gemv_k_kernel[(tiles, split)](
        x.view(torch.int32) if xpair else x, qw_t, qzeros, scales, bias if bias is not None else out, out, part, locks,
        n, k, group_size or 2**30, tps, MAGIC_F32, 16, qw_t.stride(0), qzeros.stride(0), scales.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, PREFETCH=prefetch, SPLIT=split > 1, HAS_BIAS=bias is not None,
        EVEN_K=k % block_k == 0,
        EMULATE_BF16=False, XPAIR=xpair, X_BF16=x.dtype == torch.bfloat16, num_warps=num_warps, num_stages=1,
    )  # fmt: skip
    return out
