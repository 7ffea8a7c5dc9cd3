"""Software prefetch into L2 for the weight-streaming kernels: PTX ``prefetch.global.L2``, one 128-byte line each.

What it does
    ``prefetch_l2(ptrs, on)`` asks L2 for the line holding each address of ``ptrs`` where ``on`` is non-zero. Nothing
    is written to a register and nothing waits for it: the line travels from DRAM to L2 while the kernel goes on.
    ``prefetch_block_l2`` covers a [ROWS, COLS] block of a row-major buffer with one address per line, spread so that
    every thread of the CTA issues at most a few (a block smaller than the CTA gets one address per thread, the rest
    predicated off, instead of Triton's copies of each element in several threads: no duplicate requests).

Why
    The skinny products of decode (W4A16 gemv and M <= 64 tiles, W8A8 M <= 64) stream their weights once. What bounds
    them is how many of those bytes are in flight, and the kernels keep few: the W4A16 gemv issues each word row's load
    just before its use (results in ``w4a16_gemv.py``'s header), the pipelined tiles hold two or three K tiles in
    shared memory. A prefetch of the tile ``L2_AHEAD`` steps ahead costs an instruction per line and no register or
    shared memory, and the load that later finds the line in L2 waits for L2, not DRAM.

Limits: CUDA only (inline PTX). Triton's interpreter cannot run inline assembly, so the launchers pass
``L2_AHEAD = 0`` there; prefetching changes no result, only timing. Addresses are clamped into the buffer (the last
valid row and column), so a block at the edge never names memory outside it.
"""

from __future__ import annotations

import triton
import triton.language as tl

LINE_BYTES = tl.constexpr(128)


@triton.jit
def prefetch_l2(ptrs, on):
    """Ask L2 for the line of each address in ``ptrs`` whose ``on`` (int32, same shape or scalar) is non-zero."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, on], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def prefetch_block_l2(base, row0, n_rows, stride_row, col0, n_cols, on, ROWS: tl.constexpr, COLS: tl.constexpr,
                      THREADS: tl.constexpr):  # fmt: skip
    """Prefetch rows row0 .. row0 + ROWS and columns col0 .. col0 + COLS of a buffer with unit column stride and
    ``n_rows`` x ``n_cols`` valid elements (indices are clamped to the last valid one); ``on``: a scalar condition.
    ``THREADS``: the CTA's threads (num_warps * 32), so that each address is issued by one thread only."""
    LINE: tl.constexpr = LINE_BYTES * 8 // base.dtype.element_ty.primitive_bitwidth  # elements per line
    PER_ROW: tl.constexpr = (COLS + LINE - 1) // LINE
    LINES: tl.constexpr = ROWS * PER_ROW
    SIZE: tl.constexpr = LINES if LINES > THREADS else THREADS
    i = tl.arange(0, SIZE)
    row = tl.minimum(row0 + i // PER_ROW, n_rows - 1)
    col = tl.minimum(col0 + (i % PER_ROW) * LINE, n_cols - 1)
    prefetch_l2(base + row * stride_row + col, ((i < LINES) & on).to(tl.int32))


def threads(num_warps: int) -> int:
    """THREADS for ``prefetch_block_l2``."""
    return num_warps * 32


@triton.jit
def prefetch_gptq_tile_l2(qw_ptr, qz_ptr, s_ptr, t, on, n0, N, K, group_size, stride_qwk, stride_qzg, stride_sg,
                          BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          THREADS: tl.constexpr):  # fmt: skip
    """Prefetch K tile ``t`` of a GPTQ-v2 weight (``w4a16_weight.W4A16Weight``) for output columns n0 .. n0 +
    BLOCK_N: its packed word rows [BLOCK_K / pf, BLOCK_N], and its group's row of scales and of packed zeros."""
    PF: tl.constexpr = 32 // BITS
    BKW: tl.constexpr = BLOCK_K // PF
    prefetch_block_l2(qw_ptr, t * BKW, tl.cdiv(K, PF), stride_qwk, n0, N, on, BKW, BLOCK_N, THREADS)
    grp = (t * BLOCK_K) // group_size
    n_groups = tl.cdiv(K, group_size)
    prefetch_block_l2(s_ptr, grp, n_groups, stride_sg, n0, N, on, 1, BLOCK_N, THREADS)
    prefetch_block_l2(qz_ptr, grp, n_groups, stride_qzg, n0 // PF, tl.cdiv(N, PF), on, 1, BLOCK_N // PF, THREADS)
