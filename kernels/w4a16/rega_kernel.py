"""W4A16 product for M = 17-128 rows, written in Gluon for Hopper: each thread unpacks packed 4-bit words straight
into the register A operand of an asynchronous wgmma (weights as A, "swap AB"), so that unpacking tile t + 1 runs
while the tensor cores multiply tile t. y = x @ W.T + bias.

What it computes
    y[m, n] = sum_k x[m, k] * w[n, k] + bias[n] with w = (q - z) * s rounded once as PyTorch's dequantize does
    (fp16: in fp16; bf16: the exact q - z times the fp32 scale, rounded to bf16), fp32 accumulation in the tensor
    cores, y in x's dtype. Same GPTQ buffers as the other W4A16 kernels (``W4A16Weight``: qweight int32 [K / 8, N],
    packed zeros, fp16 scales, groups contiguous along K), read in place.

How (``rega.py`` is the launch side)
    - The wgmma's A operand is a [BLOCK_N, BLOCK_K] tile of weight rows; its N is BLOCK_M = M rounded up to 16, 32,
      64 or 128 rows of x (x is padded with zero rows to BLOCK_M: TMA's out-of-bounds fill was 15-35% slower).
      Thread (warp w, lane 4 g + c) holds A rows 16 w + g and 16 w + g + 8 (and the same + 16 num_warps for taller
      tiles); it loads, per 32-deep K block b, word row 4 b + c of those rows with plain loads, one tile
      ahead. ``layouts`` writes that distribution out (``DistributedLinearLayout``) and ``_fragment`` ends in
      ``convert_layout(..., assert_trivial=True)``: the unpacked tile reaches the wgmma without moving between threads.
    - A word's eight codes are eight K positions of one row, but a fragment register holds positions (2c, 2c + 1),
      (2c + 8, 2c + 9) of each 16. The product over K does not care about order, so x is permuted instead
      (``rega.permute_x``, once per call): logical 16 t + 8 h + 2 c + e of each 32-block holds physical
      8 c + 4 e + 2 t + h. Then codes (j, j + 4) of word c, j = 2 t + h, are one fragment register: one LOP3 with the
      16-bit magic (1024 + code in fp16, 128 + code in bf16, Marlin's trick: Frantar et al. 2024), minus the zero
      pair, times the scale pair (fp16) or, for bf16, times the fp32 scale and one cvt per pair.
    - x tiles [BLOCK_M, BLOCK_K] come by TMA into a ring of STAGES slots. wgmma t is issued asynchronously and only
      wgmma t - 1 is waited for, then t - 1's slot is refilled after a CTA barrier.
    - The packed words, zero words and scales of tile t + AHEAD are loaded while tile t is unpacked (AHEAD 0: the
      words one tile ahead, zeros and scales at their use). They stay as loaded until their tile: arithmetic right
      after a load waits for it (a first version unpacked the zeros on arrival and ran up to 50% slower than AHEAD 0).
      Two tiles ahead gained -2% to +4% (fp16) and 10-15% (bf16) at M = 65-128 and made 64-row tiles the better
      choice on 4096-wide layers at M = 33-64; one tile ahead (more registers than AHEAD 0, fewer than 2 in flight)
      gained nothing.
    - Register hazard: PTX leaves rewriting the A registers of a wgmma before the wait that retires it undefined, and
      ptxas 12.8 (Triton 3.6's) does rewrite them when the next tile's fragment is computed (triton-lang/triton#9433;
      measured: NaN / wrong results at M > 16 with a single fragment).
      So the loop is unrolled by two, one fragment for even and one for odd tiles, and ``_keep`` puts a use of each
      fragment's registers (a store predicated on N < 0) after the wait that retires its wgmma.
    - split-K (grid axis 1): fp32 partial tiles in a workspace [split, M, N]; the last CTA of a column tile (a counter
      in ``W4A16Weight.locks``, reset by that CTA) adds them in split order (deterministic), adds the bias, stores y.

Measured (H200, Triton 3.6): at M = 64,
1.45-1.49x / 1.55-1.60x / 1.45-1.50x cuBLAS fp16 on 28672 x 8192 / 8192 x 28672 / 8192 x 8192 (the Triton tiles:
0.89-1.25x), 1.66-1.84x at M = 32, 1.01-1.13x at M = 128 (the warp-specialized kernel: 0.89-1.10x); 3.3-3.9 SASS
instructions per weight (fp16; bf16 5.2-5.8), 127-255 registers. Behind the mma.sync gemv at M <= 16 and on
4096-wide layers at M 17-32 and 65-128.

Limits: 4-bit codes; groups a multiple of BLOCK_K (or one group); K a multiple of BLOCK_K (an odd tile count gets a
zero tile of x past K), at least one pair of tiles per split part; N a multiple of BLOCK_N; M <= 128 (the
launcher's bound: 256-row tiles compile and were timed, but lost); CUDA sm_90 (wgmma, TMA). Gluon has no
interpreter mode: the CPU tests cover the launcher's rules and ``permute_x``, the GPU tests the kernel. Written for
Triton 3.6's Gluon.
"""

from __future__ import annotations

import functools

import torch
from quantkit.kernels.w4a16.ws_kernel import ptx_pairs
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


def _pairs_ptx(bf16: bool) -> str:
    """PTX: word $4, zero pair $5 (two 16-bit magic + z), scale $6 (fp16 pair, or fp32 for bf16) -> $0..$3, the
    dequantized codes (j, j + 4) of the word as one 16-bit pair each (low half code j): the warp-specialized kernel's
    unpacking (``ptx_pairs``), then the scale product without its re-pairing into k-adjacent values."""
    kind, magic = ("bf16", 0x43004300) if bf16 else ("f16", 0x64006400)
    lines = ["{", ".reg .b32 t0, t1, t2, t3, u, l, h;", ptx_pairs(magic, kind)]
    for j in range(4):
        if bf16:  # exact q - z widened to fp32, times the fp32 scale, rounded once per value
            lines += [f"shl.b32 l, t{j}, 16;", f"and.b32 h, t{j}, 0xFFFF0000;", "mul.rn.f32 l, l, $6;",
                      "mul.rn.f32 h, h, $6;", f"cvt.rn.bf16x2.f32 ${j}, h, l;"]  # fmt: skip
        else:
            lines.append(f"mul.rn.f16x2 ${j}, t{j}, $6;")
    return "\n".join([*lines, "}"])


_F16_PAIRS = gl.constexpr(_pairs_ptx(False))
_BF16_PAIRS = gl.constexpr(_pairs_ptx(True))


@gluon.jit
def _fragment(words, zz, ss, BN: gl.constexpr, BK: gl.constexpr, a_layout: gl.constexpr, BF16: gl.constexpr):
    """words [BN, BK / 8] (word row 4 b + c of each weight row), zero pairs and scales [BN, 1] -> the A tile
    [BN, BK] in the wgmma's register layout, K in the permuted order (16 t + 8 h + 2 c + e <- code 2 t + h + 4 e of
    word c)."""
    zb, _ = gl.broadcast(zz, words)
    sb, _ = gl.broadcast(ss, words)
    asm: gl.constexpr = _BF16_PAIRS if BF16 else _F16_PAIRS
    scale: gl.constexpr = "f" if BF16 else "r"  # fp32 scale for bf16, an fp16 pair otherwise
    p0, p1, p2, p3 = gl.inline_asm_elementwise(
        asm, "=r,=r,=r,=r,r,r," + scale, [words, zb, sb], [gl.int32, gl.int32, gl.int32, gl.int32], is_pure=True, pack=1
    )
    v = gl.join(gl.join(p0, p1), gl.join(p2, p3))  # [BN, BK / 8, h, t]
    v = gl.join(v & 0xFFFF, v >> 16)  # [BN, BK / 8, h, t, e]
    v = gl.reshape(v, [BN, BK // 32, 4, 2, 2, 2])  # [n, b, c, h, t, e]
    v = gl.permute(v, [0, 1, 4, 3, 2, 5])  # [n, b, t, h, c, e]
    v = gl.reshape(v, [BN, BK]).to(gl.int16)
    if BF16:
        v = v.to(gl.bfloat16, bitcast=True)
    else:
        v = v.to(gl.float16, bitcast=True)
    return gl.convert_layout(v, a_layout, assert_trivial=True)


# eight 16-bit values ($4-$7) stored if $8 < 0, never true: a use of the registers ptxas cannot remove
_KEEP_ASM = gl.constexpr(
    "{\n.reg .pred p;\nsetp.lt.s32 p, $8, 0;\n@p st.global.v4.b32 [$16], {$4, $5, $6, $7};\n"
    "mov.b32 $0, 0;\nmov.b32 $1, 0;\nmov.b32 $2, 0;\nmov.b32 $3, 0;\n}"
)
_KEEP_CONSTRAINTS = gl.constexpr("=r,=r,=r,=r,r,r,r,r," + ",".join(["r"] * 8) + "," + ",".join(["l"] * 8))


@gluon.jit
def _keep(a, N, ptr):
    """A use of every register of fragment ``a`` that ptxas cannot drop (a store predicated on N < 0, never true; not
    on M, which Triton turns into the constant 1 for one-row calls, and ptxas then drops the store; N >= 64 here):
    placed after the wgmma_wait that retires the wgmma reading ``a``, it keeps those registers from being handed to
    the next fragment while that wgmma may still read them. PTX leaves rewriting them before the wait undefined, and
    ptxas 12.8 does rewrite them (triton-lang/triton#9433; measured here: wrong results at M > 16 without it)."""
    mb = gl.full(a.shape, 0, gl.int32, layout=a.type.layout) + N
    pb = gl.full(a.shape, 0, gl.int64, layout=a.type.layout) + ptr.to(gl.int64, bitcast=True)
    gl.inline_asm_elementwise(_KEEP_ASM, _KEEP_CONSTRAINTS, [a, mb, pb], a.dtype, is_pure=False, pack=8)


@gluon.jit
def _group_words(qz_ptr, s_ptr, rows, g, stride_qzg, stride_sg):
    """Group g's packed zero words and scales as loaded, [BN] each (``_group_pairs`` turns them into operands: kept
    apart so that a load issued a tile ahead is not waited for by arithmetic placed right after it)."""
    return gl.load(qz_ptr + g * stride_qzg + rows // 8), gl.load(s_ptr + g * stride_sg + rows)


@gluon.jit
def _group_pairs(zw, sv, z_shift, BF16: gl.constexpr):
    """A group's loaded zero words and scales -> zero pairs (two 16-bit magic + z) and scales (fp16 pair, or fp32
    for bf16) as [BN, 1]."""
    MAGIC: gl.constexpr = 0x4300 if BF16 else 0x6400
    zv = ((zw >> z_shift) & 0xF) | MAGIC
    zz = gl.expand_dims(zv | (zv << 16), 1)
    if BF16:
        ss = gl.expand_dims(sv.to(gl.float32), 1)
    else:
        sp = sv.to(gl.int32) & 0xFFFF
        ss = gl.expand_dims(sp | (sp << 16), 1)
    return zz, ss


@gluon.jit
def _refill(x_desc, x_smem, bars, nt, k0, k_tiles, BK: gl.constexpr, STAGES: gl.constexpr):
    """After a CTA barrier (every warp group past the wgmma that read it): x tile nt into its slot."""
    gl.thread_barrier()
    ns = nt % STAGES
    pred = nt < k_tiles
    mbarrier.expect(bars.index(ns), x_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(x_desc, [0, k0 + nt * BK], bars.index(ns), x_smem.index(ns), pred=pred)


@gluon.jit
def _operands(w_ptrs, qz_ptr, s_ptr, rows, t, k0, w_tiles, stride_qwk, stride_qzg, stride_sg, BK: gl.constexpr,
              GROUP: gl.constexpr):  # fmt: skip
    """Tile t's packed words and its group's zero words and scales, as loaded (t past ``w_tiles`` reads the last
    tile again)."""
    t = gl.minimum(t, w_tiles - 1)
    words = gl.load(w_ptrs + t * (BK // 8) * stride_qwk)
    zw, sv = _group_words(qz_ptr, s_ptr, rows, (k0 + t * BK) // GROUP, stride_qzg, stride_sg)
    return words, zw, sv


@gluon.jit
def _tile(t, words, zw, sv, words2, zw2, sv2, w_ptrs, acc, a_prev, x_desc, x_smem, bars, qz_ptr, s_ptr, rows,
          z_shift, k0, k_tiles, w_tiles, N, out_ptr, stride_qzg, stride_sg, stride_qwk, BN: gl.constexpr,
          BK: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr, BF16: gl.constexpr, AHEAD: gl.constexpr,
          a_layout: gl.constexpr):  # fmt: skip
    """One K tile of the overlapped loop: unpack tile t (its operands loaded ``AHEAD`` tiles ago: (words, zw, sv),
    then (words2, zw2, sv2) for tile t + 1 when AHEAD == 2) while wgmma t - 1 runs, issue wgmma t, wait for t - 1
    only, keep t - 1's fragment ``a_prev`` alive up to that wait. AHEAD == 0: the words come a tile ahead, the zeros
    and scales are loaded here, where they are used. The part has ``k_tiles`` tiles of x and ``w_tiles`` real weight
    tiles (one fewer when its last tile lies past K). Returns the accumulator, this tile's fragment and the operands
    of the next AHEAD tiles."""
    if AHEAD == 0:
        nz, ns = zw, sv  # unused, carried unchanged
        zw, sv = _group_words(qz_ptr, s_ptr, rows, (k0 + gl.minimum(t, w_tiles - 1) * BK) // GROUP, stride_qzg,
                              stride_sg)  # fmt: skip
        nw = gl.load(w_ptrs + gl.minimum(t + 1, w_tiles - 1) * (BK // 8) * stride_qwk)
    else:
        nw, nz, ns = _operands(w_ptrs, qz_ptr, s_ptr, rows, t + AHEAD, k0, w_tiles, stride_qwk, stride_qzg, stride_sg,
                               BK, GROUP)  # fmt: skip
    zz, ss = _group_pairs(zw, sv, z_shift, BF16)
    a = _fragment(words, zz, ss, BN, BK, a_layout, BF16)
    slot = t % STAGES
    mbarrier.wait(bars.index(slot), (t // STAGES) & 1)
    acc = warpgroup_mma(a, x_smem.index(slot).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
    _keep(a_prev, N, out_ptr)
    _refill(x_desc, x_smem, bars, t + STAGES - 1, k0, k_tiles, BK, STAGES)
    if AHEAD == 2:
        return acc, a, words2, zw2, sv2, nw, nz, ns
    else:
        return acc, a, nw, nz, ns, words2, zw2, sv2


@gluon.jit
def _epilogue(acc, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, off_n, stride_om, acc_layout: gl.constexpr,
              BM: gl.constexpr, BN: gl.constexpr, HAS_BIAS: gl.constexpr, SPLIT_K: gl.constexpr,
              num_warps: gl.constexpr):  # fmt: skip
    """acc [BN, BM] (weight rows x rows of x) -> y[m, off_n + n] (+ bias); with split-K, the partial goes to the
    workspace and the tile's last CTA adds the SPLIT_K partials in split order."""
    rows = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, BM, layout=gl.SliceLayout(0, acc_layout))
    mask = gl.expand_dims(cols < M, 0) & gl.expand_dims(rows < N, 1)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc = acc + gl.expand_dims(gl.load(bias_ptr + rows).to(gl.float32), 1)
        ptrs = out_ptr + gl.expand_dims(cols, 0) * stride_om + gl.expand_dims(rows, 1)
        gl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = gl.expand_dims(cols, 0) * N + gl.expand_dims(rows, 1)
        gl.store(ws_ptr + gl.program_id(1) * M * N + part, acc, mask=mask)
        gl.thread_barrier()
        done = gl.atomic_add(cnt_ptr + gl.program_id(0), 1, sem="acq_rel")
        gl.thread_barrier()
        if done == SPLIT_K - 1:
            fix: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [1, num_warps], [0, 1])  # lanes along N: coalesced
            frows = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, fix))
            fcols = gl.arange(0, BM, layout=gl.SliceLayout(0, fix))
            fmask = gl.expand_dims(fcols < M, 0) & gl.expand_dims(frows < N, 1)
            fpart = gl.expand_dims(fcols, 0) * N + gl.expand_dims(frows, 1)
            total = gl.load(ws_ptr + fpart, mask=fmask, other=0.0, cache_modifier=".cg")
            for i in gl.static_range(1, SPLIT_K):
                total += gl.load(ws_ptr + i * M * N + fpart, mask=fmask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total = total + gl.expand_dims(gl.load(bias_ptr + frows).to(gl.float32), 1)
            fptrs = out_ptr + gl.expand_dims(fcols, 0) * stride_om + gl.expand_dims(frows, 1)
            gl.store(fptrs, total.to(out_ptr.dtype.element_ty), mask=fmask)
            gl.store(cnt_ptr + gl.program_id(0), 0)


@gluon.jit
def w4a16_rega_kernel(
    x_desc, qw_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, stride_qwk, stride_qzg, stride_sg, stride_om,
    BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr,
    BF16: gl.constexpr, HAS_BIAS: gl.constexpr, SPLIT_K: gl.constexpr, OVERLAP: gl.constexpr, AHEAD: gl.constexpr,
    ODD_K: gl.constexpr, ACC_LAYOUT: gl.constexpr, A_LAYOUT: gl.constexpr, W_LAYOUT: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    """``OVERLAP`` False: each wgmma retired before the next tile is unpacked (the probe's ablation)."""
    KW: gl.constexpr = BK // 8
    act: gl.constexpr = x_desc.dtype
    acc_layout: gl.constexpr = ACC_LAYOUT
    a_layout: gl.constexpr = A_LAYOUT
    w_layout: gl.constexpr = W_LAYOUT

    # split-K in whole pairs of tiles (the loop's unit), as even as they go: parts differ by at most one pair, so K
    # need not split evenly (11008 = 43 pairs of 256). ODD_K (an odd number of tiles, 29568 = 231 x 128): the last
    # pair's second tile lies past K; its x tile is TMA's zero fill and its weight operands repeat the last real
    # tile's (finite), so it adds exact zeros. ``w_tiles``: the part's real tiles, where weight loads are clamped.
    tiles = K // BK  # the launcher checks: K a whole number of tiles, at least one pair per part
    pairs = (tiles + 1) // 2
    p0 = gl.program_id(1) * pairs // SPLIT_K
    k_tiles = 2 * ((gl.program_id(1) + 1) * pairs // SPLIT_K - p0)
    k0 = p0 * 2 * BK
    if ODD_K:
        w_tiles = gl.minimum(k_tiles, tiles - 2 * p0)
    else:
        w_tiles = k_tiles
    off_n = gl.program_id(0) * BN
    gl.assume(k_tiles > 0)

    rows = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, w_layout))
    wcols = gl.arange(0, KW, layout=gl.SliceLayout(0, w_layout))
    w_ptrs = qw_ptr + (gl.expand_dims(wcols, 0) + k0 // 8) * stride_qwk + gl.expand_dims(rows, 1)
    z_shift = (rows % 8) * 4

    x_smem = gl.allocate_shared_memory(act, [STAGES, BM, BK], x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(STAGES - 1):
        pred = i < k_tiles
        mbarrier.expect(bars.index(i), x_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(x_desc, [0, k0 + i * BK], bars.index(i), x_smem.index(i), pred=pred)

    acc = gl.zeros([BN, BM], gl.float32, layout=acc_layout)
    if OVERLAP:  # unpack tile t while wgmma t - 1 runs; two fragments, even and odd tiles
        w0, z0, s0 = _operands(w_ptrs, qz_ptr, s_ptr, rows, 0, k0, w_tiles, stride_qwk, stride_qzg, stride_sg, BK,
                               GROUP)  # fmt: skip
        w1, z1, s1 = w0, z0, s0  # tile 1's operands when AHEAD == 2, else unused
        if AHEAD == 2:
            w1, z1, s1 = _operands(w_ptrs, qz_ptr, s_ptr, rows, 1, k0, w_tiles, stride_qwk, stride_qzg, stride_sg,
                                   BK, GROUP)  # fmt: skip
        a1 = gl.zeros([BN, BK], act, layout=a_layout)
        for t in range(0, k_tiles, 2):
            acc, a0, w0, z0, s0, w1, z1, s1 = _tile(
                t, w0, z0, s0, w1, z1, s1, w_ptrs, acc, a1, x_desc, x_smem, bars, qz_ptr, s_ptr, rows, z_shift, k0,
                k_tiles, w_tiles, N, out_ptr, stride_qzg, stride_sg, stride_qwk, BN, BK, STAGES, GROUP, BF16, AHEAD,
                a_layout,
            )  # fmt: skip
            acc, a1, w0, z0, s0, w1, z1, s1 = _tile(
                t + 1, w0, z0, s0, w1, z1, s1, w_ptrs, acc, a0, x_desc, x_smem, bars, qz_ptr, s_ptr, rows, z_shift,
                k0, k_tiles, w_tiles, N, out_ptr, stride_qzg, stride_sg, stride_qwk, BN, BK, STAGES, GROUP, BF16, AHEAD,
                a_layout,
            )  # fmt: skip
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    else:
        words = gl.load(w_ptrs)
        for t in range(k_tiles):
            zw, sv = _group_words(qz_ptr, s_ptr, rows, (k0 + gl.minimum(t, w_tiles - 1) * BK) // GROUP, stride_qzg,
                                  stride_sg)  # fmt: skip
            zz, ss = _group_pairs(zw, sv, z_shift, BF16)
            words_next = gl.load(w_ptrs + gl.minimum(t + 1, w_tiles - 1) * KW * stride_qwk)
            a = _fragment(words, zz, ss, BN, BK, a_layout, BF16)
            slot = t % STAGES
            mbarrier.wait(bars.index(slot), (t // STAGES) & 1)
            acc = warpgroup_mma(a, x_smem.index(slot).permute((1, 0)), acc, is_async=True)
            acc, a = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a))
            words = words_next
            _refill(x_desc, x_smem, bars, t + STAGES - 1, k0, k_tiles, BK, STAGES)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    _epilogue(acc, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, off_n, stride_om, acc_layout, BM, BN, HAS_BIAS, SPLIT_K,
              num_warps)  # fmt: skip


@functools.cache
def layouts(bm: int, bn: int, bk: int, num_warps: int) -> tuple:
    """(accumulator [BN, BM], A operand [BN, BK], packed words [BN, BK / 8]) register layouts. Thread
    (warp w, lane 4 g + c) holds the words of rows 16 w + g, 16 w + g + 8 (+ 16 num_warps r) and word rows 4 b + c:
    the A fragment's rows and, in the permuted K order, its codes."""
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, bm, 16])
    a = gl.DotOperandLayout(operand_index=0, parent=acc, k_width=2)
    log2 = int.bit_length
    reg = [[8, 0]] + [[0, 4 << i] for i in range(log2(bk // 32) - 1)]
    reg += [[16 * num_warps << i, 0] for i in range(log2(bn // (16 * num_warps)) - 1)]
    words = gl.DistributedLinearLayout(reg_bases=reg, lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
                                       warp_bases=[[16 << i, 0] for i in range(log2(num_warps) - 1)], block_bases=[],
                                       shape=[bn, bk // 8])  # fmt: skip
    return acc, a, words


def x_descriptor(xp: torch.Tensor, block_m: int, block_k: int) -> TensorDescriptor:
    """TMA descriptor of the permuted x [M, K] in [block_m, block_k] tiles, swizzled for the wgmma's B operand."""
    act = gl.float16 if xp.dtype == torch.float16 else gl.bfloat16
    return TensorDescriptor.from_tensor(
        xp, [block_m, block_k], gl.NVMMASharedLayout.get_default_for([block_m, block_k], act)
    )
