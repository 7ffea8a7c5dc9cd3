"""Progressive W4A8 at one row of x (decode): a CUDA-core GEMV on the int8 weight, four products per instruction.

What it computes
    ``progressive.py``'s product for M = 1: y[n] = a_scale * s1[n] * sum_k qa[k] * d[k, n] (+ bias[n]), d = q * s2 -
    sz the exact int8 weight, one int32 sum over all of K (exact; ``progressive.MAX_K``), converted and scaled once.
    The same value as the tile kernel's for the same operands, to the order of the split-K partials' fp32 sum.

How
    A program owns BLOCK_N output columns (threads only along N, four adjacent columns a thread: one 16-byte load per
    word row) and a K slice of whole tiles (split-K over grid axis 1, fixed up by ``epilogue.finish_tile``). Per word
    (eight codes of one column) seven instructions unpack the two int8 quads of ``progressive.py`` (and, IMAD with
    s2 and the addend 0x80808080 - sz * 0x01010101, xor; the high nibbles after a shift) and two ``dp4a`` add their
    products with the four activation bytes each meets: nine instructions for eight weights, where the W4A16 GEMV
    spends 3.7 a weight (``w4a16/gemv.py``). The activation words of a word row (4T + c of chunk T: bytes k = 32T +
    4c .. and 32T + 16 + 4c ..) are the same address in every thread (L1). The accumulator is elementwise [word rows,
    BLOCK_N] (each dp4a's addend), reduced over K once at the end, in the thread. No group scale inside K, so no
    per-tile float work at all.

Limits: one row of x; K a multiple of 4 and qa contiguous (its bytes read as int32 words); int32 offsets; the
split-K semaphores of the weight (one stream per weight). Triton's interpreter runs no PTX: the same sums byte by
byte. H100 (``benchmarks/bench_w4a8.py --prog-small-sweep``, variant prog-gemv, 2026-12-07): 2.11x bf16 cuBLAS at
M = 1 (geomean of six Llama shapes), ahead of the tile kernel launched plainly (2.05x) and behind it with
programmatic dependent launch (2.17x), which it then did not take; so ``dispatch.PROGRESSIVE_GEMV`` is off. It takes it
now (``pdl``: the first ``PDL_PREFETCH_TILES`` weight tiles to L2, then the wait), not yet timed so.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from quantkit.kernels._device import interpreting, prefetch_block_l2, threads
from quantkit.kernels.w4a8.progressive import PDL_PREFETCH_TILES
from quantkit.kernels.w4a16.epilogue import finish_tile

# The launch (``dispatch.GEMV_CONFIG`` plans its K split with the tiles' ``plan_launch``): W4A16's M = 1 GEMV's
# (``w4a16.configs.CONFIG_TABLE``): 512 columns a program (4 warps x 32 threads x 4 columns), 128 codes a K tile
# (16 word rows), K split until about 4 programs per SM exist
GEMV_BLOCK_N = 512
GEMV_BLOCK_K = 128
GEMV_WARPS = 4
GEMV_SPLIT_WAVES = 4
GEMV_FIXUP = 32  # partials the split-K fix-up loads per round: all of them at once (W4A16's M = 1 entry)
GEMV_STAGES = 1  # no shared-memory pipeline of the loads (W4A16's GEMV measured 10-25% slower with one)


@triton.jit
def _mac_words(acc, w, s2, sz, a_lo, a_hi, USE_ASM: tl.constexpr):
    """acc + the products of the eight codes of each word ``w`` (int32 [R, C]; s2, sz its column's, int32 [1, C])
    with the activation bytes of a_lo (low nibbles) and a_hi (high nibbles), int32 [R, 1] words of four int8."""
    if USE_ASM:
        addend = -2139062144 - sz * 16843009  # 0x80808080 - sz * 0x01010101 mod 2**32
        acc = tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t, u, v;
            and.b32 t, $1, 0x0F0F0F0F;
            mad.lo.u32 t, t, $2, $3;
            xor.b32 t, t, 0x80808080;
            dp4a.s32.s32 v, t, $4, $6;
            shr.u32 u, $1, 4;
            and.b32 u, u, 0x0F0F0F0F;
            mad.lo.u32 u, u, $2, $3;
            xor.b32 u, u, 0x80808080;
            dp4a.s32.s32 $0, u, $5, v;
            }""",
            constraints="=r,r,r,r,r,r,r",
            args=[w, s2, addend, a_lo, a_hi, acc],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    else:  # byte by byte: d = q * s2 - sz times the sign-extended activation byte
        for j in tl.static_range(4):
            d_lo = ((w >> (8 * j)) & 15) * s2 - sz
            d_hi = ((w >> (8 * j + 4)) & 15) * s2 - sz
            x_lo = (a_lo << (24 - 8 * j)) >> 24
            x_hi = (a_hi << (24 - 8 * j)) >> 24
            acc += d_lo * x_lo + d_hi * x_hi
    return acc


@triton.jit(do_not_specialize=["tiles_per_split"])
def _progressive_gemv_kernel(
    # pointers
    a_ptr, a_scale_ptr, qw_ptr, s1_ptr, s2_ptr, sz_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr,
    # sizes
    N, K, tiles_per_split,
    # strides
    stride_qwk, stride_sg, stride_on,
    # meta-parameters
    SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, USE_ASM: tl.constexpr, EMULATE_BF16: tl.constexpr,
    GROUP_TILES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FIXUP: tl.constexpr,
    EVEN_N4: tl.constexpr, PDL: tl.constexpr, PREFETCH_TILES: tl.constexpr, THREADS: tl.constexpr,
):  # fmt: skip
    BLOCK_KW: tl.constexpr = BLOCK_K // 8
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = offs_n % N  # columns past N wrap; the store drops them
    if EVEN_N4:  # four adjacent columns a thread: one 16-byte load per word row
        cols = tl.max_contiguous(tl.multiple_of(cols, 4), 4)
    offs_r = tl.arange(0, BLOCK_KW)
    KW = tl.cdiv(K, 32) * 4  # word rows
    KA = K // 4  # activation words
    a_words = a_ptr.to(tl.pointer_type(tl.int32))
    k_tiles = tl.cdiv(K, BLOCK_K)
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, k_tiles)
    if PDL:  # launched while the quantizer may still run: this split's first weight tiles to L2, then wait for it
        if PREFETCH_TILES > 0:
            prefetch_block_l2(qw_ptr, t_begin * BLOCK_KW, KW, stride_qwk, pid_n * BLOCK_N, N, t_begin < t_end,
                              PREFETCH_TILES * BLOCK_KW, BLOCK_N, THREADS)  # fmt: skip
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros((BLOCK_KW, BLOCK_N), dtype=tl.int32)
    for t in range(t_begin, t_end):
        r = t * BLOCK_KW + offs_r  # word row 4T + c: activation words 8T + c (low nibbles) and 8T + 4 + c (high)
        w = tl.load(qw_ptr + r[:, None] * stride_qwk + cols[None, :], mask=(r < KW)[:, None], other=0)
        lo = (r // 4) * 8 + r % 4
        a_lo = tl.load(a_words + lo, mask=lo < KA, other=0)  # words past K: zero, whatever their codes decode to
        a_hi = tl.load(a_words + lo + 4, mask=lo + 4 < KA, other=0)
        g = t // GROUP_TILES if GROUP_TILES else 0
        s2 = tl.load(s2_ptr + g * stride_sg + cols).to(tl.int32)
        sz = tl.load(sz_ptr + g * stride_sg + cols).to(tl.int32)
        acc = _mac_words(acc, w, s2[None, :], sz[None, :], a_lo[:, None], a_hi[:, None], USE_ASM)
    y = tl.sum(acc, axis=0).to(tl.float32) * tl.load(s1_ptr + cols) * tl.load(a_scale_ptr)
    offs_m = tl.arange(0, 1)
    finish_tile(tl.reshape(y, (1, BLOCK_N)), bias_ptr, out_ptr, part_ptr, lock_ptr, pid_n, offs_m, offs_n, 1, N, 0,
                stride_on, SPLIT, HAS_BIAS, EMULATE_BF16, FIXUP)  # fmt: skip


def gemv_fits(qa, w) -> bool:
    """Whether the GEMV serves qa [M, K] @ W.T: one row, whole int32 words of activations, and a BLOCK_K of at
    least 32 (the group size a multiple of 32, as the format requires)."""
    return qa.shape[0] == 1 and qa.is_contiguous() and w.in_features % 4 == 0 and qa.data_ptr() % 4 == 0


def launch_progressive_gemv(qa, a_scale, w, bias, out, plan, pdl: bool = False) -> None:
    """Run the GEMV on checked operands (``progressive.check_progressive_operands``) that ``gemv_fits``, with the
    K split of ``plan`` (``dispatch.plan_launch`` for ``dispatch.GEMV_CONFIG``); ``pdl``: with programmatic dependent
    launch after a quantizer launched with ``pdl=True`` (as the tile kernel's)."""
    n, k = w.out_features, w.in_features
    part = out
    if plan.split > 1:
        part = torch.empty(plan.split, 1, n, dtype=torch.float32, device=qa.device)
    _progressive_gemv_kernel[plan.grid](
        qa, a_scale, w.qweight, w.s1, w.s2, w.sz, bias if bias is not None else a_scale, out, part, w.locks,
        n, k, plan.tiles_per_split, w.qweight.stride(0), w.s2.stride(0), out.stride(1),
        SPLIT=plan.split > 1, HAS_BIAS=bias is not None, USE_ASM=not interpreting(),
        EMULATE_BF16=interpreting() and out.dtype == torch.bfloat16, EVEN_N4=n % 4 == 0,
        GROUP_TILES=plan.group_tiles if w.group_size else 0, BLOCK_N=GEMV_BLOCK_N, BLOCK_K=plan.block_k,
        FIXUP=GEMV_FIXUP, PDL=pdl, PREFETCH_TILES=PDL_PREFETCH_TILES, THREADS=threads(GEMV_WARPS),
        num_warps=GEMV_WARPS, num_stages=GEMV_STAGES, **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
