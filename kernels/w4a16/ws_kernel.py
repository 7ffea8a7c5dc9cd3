"""Warp-specialized W4A16 GEMM for Hopper (sm_90), written in Gluon: y = x @ W.T + bias for M ~ 65-512 rows.

What it computes
    The product of ``gemm.py`` (same GPTQ-v2 buffers in the kernel layout, ``W4A16Weight``; 4-bit codes, groups of
    64 or 128 contiguous along K, fp16 scales, packed zeros, optional bias of any float dtype) with W rounded once
    as PyTorch's dequantize does (fp16: (q - z) * s in fp16; bf16: the exact q - z times the fp32 scale, rounded to
    bf16), fp32 accumulation in the tensor cores, y in x's dtype.

How (one CTA per output tile [BLOCK_M, BLOCK_N] and K slice; three warp partitions on mbarriers)
    - loader (1 warp): TMA copies of x tiles [BLOCK_M, BLOCK_K] and packed-word tiles [BLOCK_K / 8, BLOCK_N] into a
      ring of STAGES slots; a slot is refilled once both consumers released it.
    - dequantizer (DQ_WARPS warps): unpacks a slot's words in inline PTX (per word: LOP3 with the 16-bit magic
      1024 + code (fp16) or 128 + code (bf16), subtraction of the zero pair, multiplication by the scale, PRMT to
      k-adjacent pairs) and stores the tile K-major into one of DQ swizzled shared buffers. Zeros and scales are
      loaded once per group, a group ahead (the K loop is unrolled over the GROUP // BLOCK_K tiles of a group).
    - MMA (the default partition, num_warps warps): asynchronous wgmma of x (shared, A) by the dequantized tile
      (shared, B); after issuing tile t it waits for wgmma t - 1 only, then releases t - 1's slot and buffer. So
      unpacking, copying and MMA overlap, which a single-partition kernel (``gemm.py``'s swap-AB tile, and the
      Gluon probe without partitions) could not do: there dequantization and MMA add up.
    - split-K (``SPLIT_K`` > 1, picked so that narrow layers still fill the GPU): each CTA stores its fp32 partial
      tile into a workspace; the last of the tile's CTAs (a counter in ``W4A16Weight.locks``, reset by that CTA)
      adds the partials in split order (deterministic) and stores y.

Layouts: x [M, K] fp16/bf16, unit column stride, 16-byte aligned rows (TMA); qweight int32 [K / 8, N] (N % 4 == 0 for
its TMA descriptor); y [M, N] with unit column stride. ``ws_unsupported_reason`` names what does not fit; the
dispatcher (``dispatch.w4a16_linear``) then runs the Triton path instead.

Measured (H200): at M = 128-256 0.6-1.07x cuBLAS fp16 where the committed
Triton path ran 0.55-0.75x; dequantize + cuBLAS stays ahead from M ~ 1024.

Limits: CUDA sm_90 only (TMA, wgmma, setmaxnreg); Gluon has no interpreter mode, so CPU tests cover the dispatch
rules and the Triton kernels, and the GPU tests (``tests/kernels/w4a16/test_ws.py``) this kernel. Written for
Triton 3.6 (the default partition cannot return a tensor there, so it stores the tile itself). int32 offsets.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


def ptx_pairs(magic: int, kind: str) -> str:
    """PTX lines: t_j = codes (j, j + 4) of word $4 as two 16-bit floats magic + code, minus the zero pair $5."""
    lines = [f"lop3.b32 t0, $4, 0x000F000F, {magic:#010x}, 0xea;"]
    for j in (1, 2, 3):
        lines += [f"shr.u32 u, $4, {4 * j};", f"lop3.b32 t{j}, u, 0x000F000F, {magic:#010x}, 0xea;"]
    lines += [f"sub.rn.{kind}x2 t{j}, t{j}, $5;" for j in range(4)]
    return "\n".join(lines)


# fp16: the product with the scale pair $6 rounded once, then PRMTs put k-adjacent values into one register.
_F16_ASM = gl.constexpr(
    "{\n.reg .b32 t0, t1, t2, t3, u;\n"
    + ptx_pairs(0x64006400, "f16")
    + "".join(f"\nmul.rn.f16x2 t{j}, t{j}, $6;" for j in range(4))
    + "\nprmt.b32 $0, t0, t1, 0x5410;\nprmt.b32 $1, t2, t3, 0x5410;"
    + "\nprmt.b32 $2, t0, t1, 0x7632;\nprmt.b32 $3, t2, t3, 0x7632;\n}"
)

# bf16: the exact difference q - z in bf16, then each value widened to fp32 (low half: shift, high half: mask),
# multiplied by the fp32 scale $6 (exact: 4-bit integer x 11-bit scale) and rounded once per pair by cvt (high
# operand first).
_BF16_ASM = gl.constexpr(
    "{\n.reg .b32 t0, t1, t2, t3, u, l0, l1, l2, l3, h0, h1, h2, h3;\n"
    + ptx_pairs(0x43004300, "bf16")
    + "".join(f"\nshl.b32 l{j}, t{j}, 16;\nand.b32 h{j}, t{j}, 0xFFFF0000;" for j in range(4))
    + "".join(f"\nmul.rn.f32 l{j}, l{j}, $6;\nmul.rn.f32 h{j}, h{j}, $6;" for j in range(4))
    + "\ncvt.rn.bf16x2.f32 $0, l1, l0;\ncvt.rn.bf16x2.f32 $1, l3, l2;"
    + "\ncvt.rn.bf16x2.f32 $2, h1, h0;\ncvt.rn.bf16x2.f32 $3, h3, h2;\n}"
)


@gluon.jit
def _dequant_words(words, zz, ss, BF16: gl.constexpr):
    """int32 words [R, BN] (8 codes along K each), zero pairs and scales -> four int32 [R, BN]: dequantized
    (k0, k1), (k2, k3), (k4, k5), (k6, k7) of each word, two 16-bit values per register, low half first."""
    if BF16:
        return gl.inline_asm_elementwise(_BF16_ASM, "=r,=r,=r,=r,r,r,f", [words, zz, ss],
                                         (gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)  # fmt: skip
    else:
        return gl.inline_asm_elementwise(_F16_ASM, "=r,=r,=r,=r,r,r,r", [words, zz, ss],
                                         (gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)  # fmt: skip


@gluon.jit
def operand_pairs(zw, sv, z_shift, BF16: gl.constexpr):
    """A group's packed zero words and scales for BLOCK_N columns -> the [1, BLOCK_N] zero pairs (two 16-bit
    magic + zero values) and scale operands (a 16-bit pair for fp16, fp32 for bf16) of ``unpack_tile``."""
    MAGIC: gl.constexpr = 0x4300 if BF16 else 0x6400
    zv = ((zw >> z_shift) & 0xF) | MAGIC
    zz = gl.expand_dims(zv | (zv << 16), 0)
    if BF16:
        ss = gl.expand_dims(sv, 0)
    else:
        ss = gl.expand_dims(sv | (sv << 16), 0)
    return zz, ss


@gluon.jit
def unpack_tile(words, zz, ss, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, BF16: gl.constexpr):
    """Packed words [BLOCK_K / 8, BLOCK_N] with their zero pairs and scales ([1, BLOCK_N]) -> int32
    [BLOCK_N, BLOCK_K / 2], two k-adjacent 16-bit weights per element: the tile K-major, each word's four pairs
    in its own thread (one 16-byte store)."""
    zb, _ = gl.broadcast(zz, words)
    sb, _ = gl.broadcast(ss, words)
    p0, p1, p2, p3 = _dequant_words(words, zb, sb, BF16)
    pairs = gl.reshape(gl.join(gl.join(p0, p2), gl.join(p1, p3)), [BLOCK_K // 8, BLOCK_N, 4])
    return gl.reshape(gl.permute(pairs, (1, 0, 2)), [BLOCK_N, BLOCK_K // 2])


@gluon.jit
def _group_params(qz_ptr, s_ptr, g, cols, col_mask, stride_qzg, stride_sg, BF16: gl.constexpr):
    """Packed zero words and scales (fp32 for bf16, the fp16 bits as int32 otherwise) of group g for ``cols``."""
    zw = gl.load(qz_ptr + g * stride_qzg + cols // 8, mask=col_mask, other=0)
    if BF16:
        sv = gl.load(s_ptr + g * stride_sg + cols, mask=col_mask, other=0.0).to(gl.float32)
    else:
        sv = gl.load(s_ptr + g * stride_sg + cols, mask=col_mask, other=0).to(gl.int32) & 0xFFFF
    return zw, sv


@gluon.jit
def _ws_loader(x_desc, qw_desc, x_smem, w_smem, ready, empty, off_m, off_n, k_tiles, k_start,
               BLOCK_K: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """One warp: TMA copies of x [BLOCK_M, BLOCK_K] and packed words [BLOCK_K / 8, BLOCK_N] into slot t % STAGES
    once the MMA and the dequantizer have both released it (``empty``, two arrivals)."""
    nbytes: gl.constexpr = x_desc.block_type.nbytes + qw_desc.block_type.nbytes
    for t in range(k_tiles):
        s = t % STAGES
        mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)  # a fresh barrier's "previous phase" is complete
        mbarrier.expect(ready.index(s), nbytes)
        k0 = k_start + t * BLOCK_K
        tma.async_copy_global_to_shared(x_desc, [off_m, k0], ready.index(s), x_smem.index(s))
        tma.async_copy_global_to_shared(qw_desc, [k0 // 8, off_n], ready.index(s), w_smem.index(s))


@gluon.jit
def _ws_dequant_tile(w_smem, d_smem, ready, empty, d_ready, d_empty, t, zz, ss, w_layout: gl.constexpr,
                     BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, DQ: gl.constexpr,
                     BF16: gl.constexpr):  # fmt: skip
    """Tile t: wait for its words, unpack them, wait for its dequantized buffer, store, signal both barriers."""
    d32_layout: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=d_smem.type.layout.swizzle_byte_width, element_bitwidth=32, rank=2
    )
    s = t % STAGES
    d = t % DQ
    mbarrier.wait(ready.index(s), (t // STAGES) & 1)
    pairs = unpack_tile(w_smem.index(s).load(w_layout), zz, ss, BLOCK_N, BLOCK_K, BF16)
    mbarrier.wait(d_empty.index(d), ((t // DQ) & 1) ^ 1)
    d_smem.index(d)._reinterpret(gl.int32, [BLOCK_N, BLOCK_K // 2], d32_layout).store(pairs)
    fence_async_shared()
    mbarrier.arrive(empty.index(s))  # (Triton puts a barrier of this warp group before each arrive)
    mbarrier.arrive(d_ready.index(d))


@gluon.jit
def _ws_dequant(w_smem, d_smem, ready, empty, d_ready, d_empty, qz_ptr, s_ptr, off_n, N, k_tiles, stride_qzg,
                stride_sg, k_start, GROUP: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                STAGES: gl.constexpr, DQ: gl.constexpr, BF16: gl.constexpr, DQ_WARPS: gl.constexpr):  # fmt: skip
    """DQ_WARPS warps: unpack slot t % STAGES's words into the 16-bit tile d_smem[t % DQ] ([BLOCK_N, BLOCK_K],
    K-major) once the MMA has released that buffer; then release the words' slot and signal the tile. Walks K a
    group at a time (GROUP // BLOCK_K tiles, unrolled): zeros and scales are loaded once per group, a group ahead."""
    TPG: gl.constexpr = GROUP // BLOCK_K
    w_layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [DQ_WARPS, 1], [1, 0])
    cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, w_layout))
    col_mask = cols < N
    z_shift = (cols % 8) * 4
    g0 = k_start // GROUP
    n_groups = k_tiles // TPG
    zw, sv = _group_params(qz_ptr, s_ptr, g0, cols, col_mask, stride_qzg, stride_sg, BF16)
    for gi in range(n_groups):
        g_next = g0 + gl.minimum(gi + 1, n_groups - 1)
        zw_next, sv_next = _group_params(qz_ptr, s_ptr, g_next, cols, col_mask, stride_qzg, stride_sg, BF16)
        zz, ss = operand_pairs(zw, sv, z_shift, BF16)
        for j in gl.static_range(TPG):
            _ws_dequant_tile(w_smem, d_smem, ready, empty, d_ready, d_empty, gi * TPG + j, zz, ss, w_layout,
                             BLOCK_N, BLOCK_K, STAGES, DQ, BF16)  # fmt: skip
        zw, sv = zw_next, sv_next


@gluon.jit
def _ws_mma(x_smem, d_smem, ready, empty, d_ready, d_empty, k_tiles, bias_ptr, out_ptr, ws_ptr, cnt_ptr, tile, M, N,
            off_m, off_n, stride_om, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
            DQ: gl.constexpr, HAS_BIAS: gl.constexpr, SPLIT_K: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """The default warp group: wgmma of tile t (x from its slot, the dequantized tile) while tile t + 1 is being
    dequantized; when wgmma t - 1 has retired, its x slot and dequantized buffer are released. Then the store
    (Triton 3.6 cannot return a tensor from the default partition)."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
    )
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=acc_layout)
    for t in range(k_tiles):
        s = t % STAGES
        d = t % DQ
        mbarrier.wait(ready.index(s), (t // STAGES) & 1)
        mbarrier.wait(d_ready.index(d), (t // DQ) & 1)
        acc = warpgroup_mma(x_smem.index(s), d_smem.index(d).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        mbarrier.arrive(empty.index((t + STAGES - 1) % STAGES), pred=t > 0)
        mbarrier.arrive(d_empty.index((t + DQ - 1) % DQ), pred=t > 0)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
    ocols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
    mask = gl.expand_dims(rows < M, 1) & gl.expand_dims(ocols < N, 0)
    ptrs = out_ptr + gl.expand_dims(rows, 1) * stride_om + gl.expand_dims(ocols, 0)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc = acc + gl.expand_dims(gl.load(bias_ptr + ocols, mask=ocols < N, other=0.0).to(gl.float32), 0)
        gl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # each split stores its fp32 partial tile; the last of the tile's CTAs to finish adds the SPLIT_K partials
        # in split order (deterministic), stores the result and zeroes the tile's counter for the next call
        part = gl.expand_dims(rows, 1) * N + gl.expand_dims(ocols, 0)
        gl.store(ws_ptr + gl.program_id(1) * M * N + part, acc, mask=mask)
        gl.thread_barrier()
        done = gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        gl.thread_barrier()
        if done == SPLIT_K - 1:  # in chunks of 16 rows, in a plain layout: few registers beside the accumulator
            fix: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [num_warps, 1], [1, 0])
            fcols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, fix))
            fmask_n = gl.expand_dims(fcols < N, 0)
            if HAS_BIAS:
                b = gl.expand_dims(gl.load(bias_ptr + fcols, mask=fcols < N, other=0.0).to(gl.float32), 0)
            for r in range(0, BLOCK_M, 16):
                frows = off_m + r + gl.arange(0, 16, layout=gl.SliceLayout(1, fix))
                fmask = gl.expand_dims(frows < M, 1) & fmask_n
                fpart = gl.expand_dims(frows, 1) * N + gl.expand_dims(fcols, 0)
                total = gl.load(ws_ptr + fpart, mask=fmask, other=0.0, cache_modifier=".cg")
                for i in gl.static_range(1, SPLIT_K):
                    total += gl.load(ws_ptr + i * M * N + fpart, mask=fmask, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    total = total + b
                fptrs = out_ptr + gl.expand_dims(frows, 1) * stride_om + gl.expand_dims(fcols, 0)
                gl.store(fptrs, total.to(out_ptr.dtype.element_ty), mask=fmask)
            gl.store(cnt_ptr + tile, 0)


@gluon.jit
def w4a16_ws_kernel(
    x_desc, qw_desc, qz_ptr, s_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, stride_qzg, stride_sg, stride_om,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, DQ: gl.constexpr,
    BF16: gl.constexpr, HAS_BIAS: gl.constexpr, DQ_REGS: gl.constexpr, DQ_WARPS: gl.constexpr,
    SPLIT_K: gl.constexpr, GROUP: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    BKW: gl.constexpr = BLOCK_K // 8
    act: gl.constexpr = x_desc.dtype
    tile = gl.program_id(0)
    num_m = gl.cdiv(M, BLOCK_M)
    off_m = (tile % num_m) * BLOCK_M  # M fastest: the CTAs that share a weight tile run together
    off_n = (tile // num_m) * BLOCK_N
    # split-K in whole groups (zeros and scales are loaded per group), as even as they go: parts differ by at most
    # one group, so K need not split evenly (11008 = 86 groups of 128)
    n_groups = K // GROUP  # the launcher checks: whole groups, at least one per part
    g0 = gl.program_id(1) * n_groups // SPLIT_K
    k_tiles = ((gl.program_id(1) + 1) * n_groups // SPLIT_K - g0) * (GROUP // BLOCK_K)
    k_start = g0 * GROUP
    gl.assume(k_tiles > 0)

    d_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], act)
    x_smem = gl.allocate_shared_memory(act, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BKW, BLOCK_N], qw_desc.layout)
    d_smem = gl.allocate_shared_memory(act, [DQ, BLOCK_N, BLOCK_K], d_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    d_ready = gl.allocate_shared_memory(gl.int64, [DQ, 1], mbarrier.MBarrierLayout())
    d_empty = gl.allocate_shared_memory(gl.int64, [DQ, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # the MMA group (x read) and the dequantizer (words read)
    for i in gl.static_range(DQ):
        mbarrier.init(d_ready.index(i), count=1)
        mbarrier.init(d_empty.index(i), count=1)
    fence_async_shared()

    gl.warp_specialize([
        (_ws_mma, (x_smem, d_smem, ready, empty, d_ready, d_empty, k_tiles, bias_ptr, out_ptr, ws_ptr, cnt_ptr, tile,
                   M, N, off_m, off_n, stride_om, BLOCK_M, BLOCK_N, STAGES, DQ, HAS_BIAS, SPLIT_K, num_warps)),
        (_ws_loader, (x_desc, qw_desc, x_smem, w_smem, ready, empty, off_m, off_n, k_tiles, k_start, BLOCK_K, STAGES)),
        (_ws_dequant, (w_smem, d_smem, ready, empty, d_ready, d_empty, qz_ptr, s_ptr, off_n, N, k_tiles, stride_qzg,
                       stride_sg, k_start, GROUP, BLOCK_N, BLOCK_K, STAGES, DQ, BF16, DQ_WARPS)),
    ], [1, DQ_WARPS], [24, DQ_REGS])  # fmt: skip


def descriptors(x: torch.Tensor, qweight: torch.Tensor, block_m: int, block_n: int, block_k: int):
    """TMA descriptors of x [M, K] in [block_m, block_k] tiles (swizzled for wgmma) and of the packed words
    [K / 8, N] in [block_k / 8, block_n] tiles (unswizzled: the dequantizer reads them row by row)."""
    act = gl.float16 if x.dtype == torch.float16 else gl.bfloat16
    x_layout = gl.NVMMASharedLayout.get_default_for([block_m, block_k], act)
    w_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    x_desc = TensorDescriptor.from_tensor(x, [block_m, block_k], x_layout)
    qw_desc = TensorDescriptor.from_tensor(qweight, [block_k // 8, block_n], w_layout)
    return x_desc, qw_desc
