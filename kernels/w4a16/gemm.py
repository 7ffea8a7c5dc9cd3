"""Tensor-core W4A16 / W8A16 GEMM (Triton): y = x @ W.T + bias with W dequantized from GPTQ-v2 buffers in registers.

What it computes
    y[m, n] = sum_k x[m, k] * scales[g(k), n] * (q[k, n] - zeros[g(k), n]) + bias[n], accumulated in fp32 and
    returned in x's dtype (fp16 or bf16). Groups must be contiguous along K, g(k) = k // G; act-order checkpoints are
    permuted once at load time (``prepare_gptq_weight``) so that this holds, and x's columns are permuted per call.

Layouts consumed (GPTQ-v2, ``quantkit.quant.packing``; b = 4 or 8 bits, pf = 32 / b codes per word)
    qweight int32 [ceil(K/32)*b, N]  codes packed along K, lowest bits first: word r holds k = r*pf .. r*pf+pf-1
    qzeros  int32 [n_g, ceil(N/32)*b] zero points packed along N, stored as they are (v2)
    scales  fp16  [n_g, N]
    x [M, K] fp16/bf16 (any strides), bias [N] (any float dtype), y [M, N] in x's dtype.
    Kernel layout: ``KERNEL_LAYOUT`` v``KERNEL_LAYOUT_VERSION`` (``weight.py``) is gptq_v2 with K permuted
    so groups are contiguous (identity without act-order). It lives only in memory; checkpoints stay gptq_v2.

Kernels (this file: the tensor-core GEMM and the dequantize kernel; ``gemv.py``: the CUDA-core decode kernel;
``epilogue.py``: the store and split-K fix-up they share)
    ``_w4a16_gemm_kernel`` tiles [BLOCK_M, BLOCK_N] outputs and walks K in BLOCK_K steps, each K tile inside one
    group (``plan_launch`` caps BLOCK_K); tl.dot on fp16/bf16 operands, fp32 accumulation. Each tile of packed words
    [BLOCK_K/pf, BLOCK_N] is loaded once and unpacked two codes per 32-bit operation: (w >> s) & 0x000F000F |
    0x64006400 holds two codes as two fp16 values 1024 + code (bf16: 0x4300, 128 + code), the "magic number" trick,
    so no int->float conversion instruction runs; tl.join keeps a word's codes in its own thread; the tile is
    reshaped to [BLOCK_K, BLOCK_N] in natural k order, so x tiles are read contiguously. Two scale modes:
    - tile (FUSE_SCALE=False): tl.dot gets the exact integers q - z and its fp32 result is scaled per column once
      per tile; W is never rounded.
    - fused (FUSE_SCALE=True): W = (q - z) * s rounded once to the activation dtype, exactly PyTorch's
      dequantize-then-matmul (fp16: one fp16 multiply of exact operands; bf16: in fp32, as scales are fp16),
      accumulated inside tl.dot so the accumulator stays in the MMA pipeline and no per-tile scale is moved into
      the accumulator's layout.
    SWAP_AB computes y.T = W.T @ x.T: the weight tile becomes the MMA's M side, so a few rows of x (BLOCK_M 16)
    still run Hopper's wgmma (64 x 16 x 16) with the dequantized tile as the A operand, where tl.dot would fall
    back to mma.sync for M < 64.
    Split-K (grid axis 1 > 1): ``epilogue.finish_tile``'s deterministic serial fix-up, one launch.
    ``_w4a16_dequant_kernel`` writes W as [N, K] in x's dtype for the dequantize-then-cuBLAS path (large M):
    ``F.linear(x, W)`` then runs the same cuBLAS kernel as the fp16 baseline.

Where it runs (``dispatch.py``): the Triton regime table (``configs.CONFIG_TABLE``) gives this kernel M 3-128 with
SWAP_AB (BLOCK_M 16-128, 3 stages, split-K to fill the SMs; twice the split for 3-4 rows of the widest layers,
``WIDE_M4``), the gemv kernel M <= 2 and dequantize + cuBLAS larger M; on Hopper with Triton 3.6 the Gluon kernels
take the products their rules claim first (the mma.sync gemv M <= 16, the register-A wgmma M 17-128 of the larger
layers, the warp-specialized GEMM M 65-512).
Why these tiles: 16 x 128 x 128 tiles with 4 stages were latency bound at ~0.45 TB/s (162 registers and 71 KB of
shared memory: 3 CTAs of 4 warps per SM, a synchronous scale load per tile); small BLOCK_K = 64 tiles with the scale
fused into the tile and 3 stages run at 0.7-1.3 TB/s of weight bytes for M <= 16 (72-96 registers). Still far from
the memory roofline: the dequantized tile makes a round trip through shared memory for the wgmma A operand (STS +
LDSM). ptxas serialized the wgmma of the 64- and 128-row tiles (C7515, from the K loop's possible zero-trip path);
``tl.assume`` in the kernel removes it (+6% at M = 64 and +8% at M = 128, geomean). Keeping the tile in registers as
the wgmma's A operand through a fragment-ordered copy of the weight ran 11-18% faster at M = 4-128 but 31% slower
than the gemv at M = 1, whose layout it cannot share; not adopted, as a second copy of every weight would double
W4A16's weight memory (the register-A kernel, ``rega.py``, later did it on the GPTQ layout itself).

Limits: 4 or 8 bits; G a multiple of 32, or one group per column; int32 offsets (tensors < 2**31 elements);
interpreter mode (TRITON_INTERPRET=1) computes bf16 tiles in fp32 and rounds to bf16 by hand, because the
interpreter has no bf16 arithmetic and its bf16 cast truncates. Split-K semaphores live in the prepared weight:
one weight must not run on two streams at once.
Hardware: tuned on the H200 (sm_90, 132 SMs, 60 MB L2); SASS checked offline with Triton 3.6 for sm_90.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from quantkit.kernels._device import interpreting, num_sms
from quantkit.kernels.w4a16.configs import KernelConfig, config_for, fixup_unroll, plan_launch
from quantkit.kernels.w4a16.epilogue import finish_tile, to_act
from quantkit.kernels.w4a16.weight import ACT_DTYPES, W4A16Weight, check_operands, unpack_gptq_codes

MAGIC_F32 = tl.constexpr(0x4B000000)  # code | MAGIC_F32 read as fp32 is 2**23 + code
MAGIC_16 = {torch.float16: 0x6400, torch.bfloat16: 0x4300}  # 1024 + code, 128 + code (exact for code < 128)


# ---------------------------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------------------------
def w4a16_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    bits: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch: dequantize W [K, N] in fp32, y = x @ W (+ bias) in fp32, returned in x's dtype."""
    k, n = x.shape[-1], qweight.shape[1]
    q = unpack_gptq_codes(qweight, bits, k).float()  # [K, N]
    zeros = unpack_gptq_codes(qzeros.t().contiguous(), bits, n).t().float()  # [n_g, N]
    g = g_idx.long()
    w = (q - zeros[g]) * scales.float()[g]  # [K, N]
    y = x.float() @ w
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def _join8(c0, c1, c2, c3, c4, c5, c6, c7):
    """Eight [R, BN] tensors -> [R, BN, 8] with c_j at [..., j]. tl.join adds a dimension held by the same thread,
    so a word's codes never leave its thread (the first join's selector ends up the most significant index bit)."""
    a = tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7)))
    return tl.reshape(a, (c0.shape[0], c0.shape[1], 8))


@triton.jit
def _join4(c0, c1, c2, c3):
    a = tl.join(tl.join(c0, c2), tl.join(c1, c3))
    return tl.reshape(a, (c0.shape[0], c0.shape[1], 4))


@triton.jit
def _unpack_codes(words, BITS: tl.constexpr):
    """int32 words [R, BN] -> int32 codes [R, BN, 32/BITS], code j of each word at [..., j]."""
    QM: tl.constexpr = (1 << BITS) - 1
    if BITS == 4:
        return _join8(words & QM, (words >> 4) & QM, (words >> 8) & QM, (words >> 12) & QM,
                      (words >> 16) & QM, (words >> 20) & QM, (words >> 24) & QM, (words >> 28) & QM)  # fmt: skip
    else:
        return _join4(words & QM, (words >> 8) & QM, (words >> 16) & QM, (words >> 24) & QM)


@triton.jit
def _lanes(p, ACT: tl.constexpr):
    """An int32 holding two 16-bit patterns -> (low, high) read as ACT."""
    return p.to(tl.int16).to(ACT, bitcast=True), (p >> 16).to(tl.int16).to(ACT, bitcast=True)


@triton.jit
def _unpack_magic(words, pair, BITS: tl.constexpr, ACT: tl.constexpr):
    """int32 words [R, BN] -> ACT values MAGIC's value + code, [R, BN, 32/BITS], code j at [..., j].

    Two codes per 32-bit operation: (w >> s) & 0x000F000F | pair holds codes j and j + 4 (4-bit; j and j + 2 for
    8-bit) as two 16-bit floats; the compiler then only splits the lanes. ``pair`` (MAGIC:MAGIC) is a run-time
    value so that it stays in a register and the mask is the LOP3's immediate: as a compile-time constant it was
    re-materialized, two LOP3s per pair (sm_90 SASS).
    """
    if BITS == 4:
        l0, h0 = _lanes((words & 0x000F000F) | pair, ACT)
        l1, h1 = _lanes(((words >> 4) & 0x000F000F) | pair, ACT)
        l2, h2 = _lanes(((words >> 8) & 0x000F000F) | pair, ACT)
        l3, h3 = _lanes(((words >> 12) & 0x000F000F) | pair, ACT)
        return _join8(l0, l1, l2, l3, h0, h1, h2, h3)
    else:
        l0, h0 = _lanes((words & 0x00FF00FF) | pair, ACT)
        l1, h1 = _lanes(((words >> 8) & 0x00FF00FF) | pair, ACT)
        return _join4(l0, l1, h0, h1)


@triton.jit
def dequant_tile(words, zeros, scales, pair, ACT: tl.constexpr, COMPUTE: tl.constexpr, BITS: tl.constexpr,
                  MAGIC: tl.constexpr, FUSE_SCALE: tl.constexpr, HALF_SCALE: tl.constexpr,
                  EMULATE_BF16: tl.constexpr):  # fmt: skip
    """words int32 [R, BN], zeros int32 and scales fp16 [R or 1, BN] -> W [R * 32/BITS, BN] in COMPUTE (k = r*pf + j).

    Not FUSE_SCALE: the exact integer q - z (the caller scales the dot's result), from MAGIC patterns when MAGIC != 0.
    FUSE_SCALE: (q - z) * s rounded once to ACT, as PyTorch's dequantize does: in fp16 directly (HALF_SCALE: q - z
    is exact, so the one rounding is the product's), else in fp32.
    """
    PF: tl.constexpr = 32 // BITS
    if MAGIC != 0 and (HALF_SCALE or not FUSE_SCALE):
        v = tl.permute(_unpack_magic(words, pair, BITS, ACT), (0, 2, 1)).to(COMPUTE)  # [R, PF, BN]
        z = (zeros | MAGIC).to(tl.int16).to(ACT, bitcast=True).to(COMPUTE)
        w = v - z[:, None, :]
        if FUSE_SCALE:
            w = w * scales.to(COMPUTE)[:, None, :]
    else:
        q = tl.permute(_unpack_codes(words, BITS), (0, 2, 1))  # [R, PF, BN]
        qf = (q | MAGIC_F32).to(tl.float32, bitcast=True)
        zf = (zeros | MAGIC_F32).to(tl.float32, bitcast=True)[:, None, :]
        if FUSE_SCALE:
            w = to_act((qf - zf) * scales.to(tl.float32)[:, None, :], ACT, EMULATE_BF16).to(COMPUTE)
        else:
            w = (qf - zf).to(COMPUTE)
    return tl.reshape(w, (words.shape[0] * PF, words.shape[1]))


@triton.jit
def load_group(qz_ptr, s_ptr, grp, offs_n, mask, stride_qzg, stride_qzn, stride_sg, stride_sn,
                BITS: tl.constexpr):  # fmt: skip
    """Integer zeros and fp16 scales of groups ``grp`` ([R, 1]) for columns ``offs_n`` ([1, BN]) -> [R, BN] each."""
    PF: tl.constexpr = 32 // BITS
    zw = tl.load(qz_ptr + grp * stride_qzg + (offs_n // PF) * stride_qzn, mask=mask, other=0)
    zeros = (zw >> ((offs_n % PF) * BITS)) & ((1 << BITS) - 1)
    scales = tl.load(s_ptr + grp * stride_sg + offs_n * stride_sn, mask=mask, other=0.0)
    return zeros, scales


@triton.jit(do_not_specialize=["M", "group_size", "tiles_per_split", "magic_pair"])
def _w4a16_gemm_kernel(
    # pointers
    x_ptr, qw_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr,
    # sizes
    M, N, K, group_size, tiles_per_split,
    # MAGIC:MAGIC as a run-time value (kept in a register; see _unpack_magic)
    magic_pair,
    # strides
    stride_xm, stride_xk, stride_qwk, stride_qwn, stride_qzg, stride_qzn, stride_sg, stride_sn, stride_om, stride_on,
    # meta-parameters
    BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT: tl.constexpr, FUSE_SCALE: tl.constexpr, SWAP_AB: tl.constexpr,
    MAGIC: tl.constexpr,
    COMPUTE: tl.constexpr, HALF_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    EMULATE_BF16: tl.constexpr, FIXUP: tl.constexpr,
):  # fmt: skip
    PF: tl.constexpr = 32 // BITS
    BLOCK_KW: tl.constexpr = BLOCK_K // PF
    ACT: tl.constexpr = x_ptr.dtype.element_ty

    # Output tile, grouped GROUP_M tiles at a time along M so neighbouring CTAs share weight tiles in L2.
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    tiles_in_group = GROUP_M * num_pid_n
    first_m = (pid // tiles_in_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % tiles_in_group) % group_rows
    pid_n = (pid % tiles_in_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_kw = tl.arange(0, BLOCK_KW)
    m_mask = offs_m < M
    n_mask = offs_n < N  # loop-invariant; K masks (the ones inside the loop) are dropped when EVEN_K

    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    qw_ptrs = qw_ptr + offs_kw[:, None] * stride_qwk + offs_n[None, :] * stride_qwn

    k_tiles = tl.cdiv(K, BLOCK_K)
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, k_tiles)
    if BLOCK_M >= 64:
        # No split is empty (plan_launch), but without this the loop may run zero times as far as ptxas knows, and the
        # zero accumulator of that path makes it serialize the wgmma (C7515: each wgmma waited for right after issue).
        # Saying so pipelines them: +3-12% at M = 64 and +5-10% at M = 128 on the H200. Not for 16-row tiles: the
        # pipelined loop takes 103 registers instead of 96 there, one CTA fewer per SM, and M = 4 ran up to 15% slower
        # with it; the 32-row tile has no serialized wgmma to begin with.
        tl.assume(t_end > t_begin)
    if SWAP_AB:  # y.T = W.T @ x.T: the weight tile is the MMA's M side (>= 64 rows: wgmma even for a few rows of x)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(t_begin, t_end):
        k0 = t * BLOCK_K
        kw = t * BLOCK_KW + offs_kw  # packed-word rows of this tile
        if EVEN_K:
            x = tl.load(x_ptrs + k0 * stride_xk, mask=m_mask[:, None], other=0.0)
            w_mask = n_mask[None, :]
        else:
            x = tl.load(x_ptrs + k0 * stride_xk, mask=m_mask[:, None] & (k0 + offs_k < K)[None, :], other=0.0)
            w_mask = (kw * PF < K)[:, None] & n_mask[None, :]
        words = tl.load(qw_ptrs + t * BLOCK_KW * stride_qwk, mask=w_mask, other=0)  # [BLOCK_KW, BLOCK_N]
        # the tile lies in one group (plan_launch caps BLOCK_K): one [1, BLOCK_N] row of zeros and scales
        zeros, scales = load_group(qz_ptr, s_ptr, k0 // group_size, offs_n[None, :], n_mask[None, :],
                                    stride_qzg, stride_qzn, stride_sg, stride_sn, BITS)  # fmt: skip
        if FUSE_SCALE:  # W = (q - z) * s rounded to ACT inside the tile; accumulate inside the dot
            w = dequant_tile(words, zeros, scales, magic_pair, ACT, COMPUTE, BITS, MAGIC, True, HALF_SCALE,
                              EMULATE_BF16)  # fmt: skip
            if SWAP_AB:
                acc = tl.dot(tl.trans(w), tl.trans(x.to(COMPUTE)), acc)
            else:
                acc = tl.dot(x.to(COMPUTE), w, acc)
        else:  # scale the exact integer product once per tile
            w = dequant_tile(words, zeros, scales, magic_pair, ACT, COMPUTE, BITS, MAGIC, False, HALF_SCALE,
                              EMULATE_BF16)  # fmt: skip
            if SWAP_AB:
                acc += tl.dot(tl.trans(w), tl.trans(x.to(COMPUTE))) * tl.trans(scales.to(tl.float32))
            else:
                acc += tl.dot(x.to(COMPUTE), w) * scales.to(tl.float32)
    if SWAP_AB:
        acc = tl.trans(acc)

    finish_tile(acc, bias_ptr, out_ptr, part_ptr, lock_ptr, pid_m * num_pid_n + pid_n, offs_m, offs_n, M, N,
                 stride_om, stride_on, SPLIT, HAS_BIAS, EMULATE_BF16, FIXUP)  # fmt: skip


@triton.jit(do_not_specialize=["magic_pair"])
def _w4a16_dequant_kernel(
    # pointers
    qw_ptr, qz_ptr, s_ptr, w_ptr,
    # sizes
    N, K, group_size, magic_pair,
    # strides
    stride_qwk, stride_qwn, stride_qzg, stride_qzn, stride_sg, stride_sn, stride_wk, stride_wn,
    # meta-parameters
    BITS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, MAGIC: tl.constexpr,
    HALF_SCALE: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):  # fmt: skip
    PF: tl.constexpr = 32 // BITS
    BLOCK_KW: tl.constexpr = BLOCK_K // PF
    ACT: tl.constexpr = w_ptr.dtype.element_ty
    offs_kw = tl.program_id(0) * BLOCK_KW + tl.arange(0, BLOCK_KW)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_kw * PF < K)[:, None] & (offs_n < N)[None, :]
    words = tl.load(qw_ptr + offs_kw[:, None] * stride_qwk + offs_n[None, :] * stride_qwn, mask=mask, other=0)
    grp = (offs_kw * PF) // group_size
    zeros, scales = load_group(qz_ptr, s_ptr, grp[:, None], offs_n[None, :], mask,
                                stride_qzg, stride_qzn, stride_sg, stride_sn, BITS)  # fmt: skip
    w = dequant_tile(words, zeros, scales, magic_pair, ACT, ACT, BITS, MAGIC, True, HALF_SCALE, EMULATE_BF16)
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    w_mask = (offs_k < K)[:, None] & (offs_n < N)[None, :]
    tl.store(w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn, w, mask=w_mask)


# ---------------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------------
def magic_pattern(bits: int, dtype: torch.dtype) -> int:
    """The 16-bit pattern that reads as 2**e + code in ``dtype`` for every code, or 0 (bf16 holds 8-bit codes from
    128 only up to 127)."""
    return MAGIC_16[dtype] if bits == 4 or dtype == torch.float16 else 0


def pattern_pair(magic: int) -> int:
    """MAGIC:MAGIC as the signed int32 the kernels take."""
    v = magic | (magic << 16)
    return v - (1 << 32) if v >= 1 << 31 else v


def w4a16_gemm(
    x: torch.Tensor,
    w: W4A16Weight,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: KernelConfig | None = None,
):
    """y [M, N] = x [M, K] @ W.T + bias with the fused kernel; x is already in kernel channel order.

    Returns (y, compiled kernel handle).
    """
    check_operands(x, w, bias, out)
    m, k = x.shape
    n = w.out_features
    cfg = config or config_for(m, n)
    if cfg.method != "fused":
        raise ValueError(f"w4a16_gemm runs the fused kernel; config {cfg.name} asks for {cfg.method!r}")
    plan = plan_launch(cfg, m, n, k, w.group_size, num_sms(x.device))
    if out is None:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    part, locks = out, w.locks
    if plan.split_k > 1:
        part = torch.empty(plan.split_k, m, n, device=x.device, dtype=torch.float32)
    emulate_bf16 = interpreting() and x.dtype == torch.bfloat16  # the interpreter has no bf16 arithmetic
    magic = magic_pattern(w.bits, x.dtype)
    compute = tl.float32 if emulate_bf16 else (tl.float16 if x.dtype == torch.float16 else tl.bfloat16)
    handle = _w4a16_gemm_kernel[plan.grid](
        x, w.qweight, w.qzeros, w.scales, bias if bias is not None else out, out, part, locks,
        m, n, k, w.group_size or 2**30, plan.tiles_per_split, pattern_pair(magic),
        x.stride(0), x.stride(1), w.qweight.stride(0), w.qweight.stride(1), w.qzeros.stride(0), w.qzeros.stride(1),
        w.scales.stride(0), w.scales.stride(1), out.stride(0), out.stride(1),
        BITS=w.bits, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=plan.block_k, GROUP_M=cfg.group_m,
        SPLIT=plan.split_k > 1, FUSE_SCALE=cfg.fuse_scale, SWAP_AB=cfg.swap_ab,
        MAGIC=magic, COMPUTE=compute,
        HALF_SCALE=x.dtype == torch.float16,
        HAS_BIAS=bias is not None, EVEN_K=k % plan.block_k == 0, EMULATE_BF16=emulate_bf16,
        FIXUP=fixup_unroll(cfg), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out, handle


def w4a16_dequantize(
    w: W4A16Weight, dtype: torch.dtype, block_k: int = 64, block_n: int = 128, out: torch.Tensor | None = None
) -> torch.Tensor:
    """W as [N, K] in ``dtype`` (kernel channel order): s * (q - z) rounded once, as PyTorch's fp32 dequantize.

    [N, K] (the nn.Linear layout) so that ``F.linear(x, W)`` runs the same cuBLAS kernel as the fp16 baseline.
    ``out``: an [N, K] buffer to write into (any strides), e.g. a scratch buffer reused so that it stays in L2.
    """
    if dtype not in ACT_DTYPES:
        raise ValueError(f"dtype must be float16 or bfloat16, got {dtype}")
    k, n = w.in_features, w.out_features
    if out is None:
        out = torch.empty(n, k, device=w.qweight.device, dtype=dtype)
    elif out.dtype != dtype or tuple(out.shape) != (n, k) or out.device != w.qweight.device:
        raise ValueError(f"out must be {dtype} [{n}, {k}] on {w.qweight.device}, got {out.dtype} {tuple(out.shape)}")
    magic = magic_pattern(w.bits, dtype)
    grid = (triton.cdiv(k, block_k), triton.cdiv(n, block_n))
    _w4a16_dequant_kernel[grid](
        w.qweight, w.qzeros, w.scales, out, n, k, w.group_size or 2**30, pattern_pair(magic),
        w.qweight.stride(0), w.qweight.stride(1), w.qzeros.stride(0), w.qzeros.stride(1),
        w.scales.stride(0), w.scales.stride(1), out.stride(1), out.stride(0),
        BITS=w.bits, BLOCK_K=block_k, BLOCK_N=block_n, MAGIC=magic,
        HALF_SCALE=dtype == torch.float16,
        EMULATE_BF16=interpreting() and dtype == torch.bfloat16,
    )  # fmt: skip
    return out
