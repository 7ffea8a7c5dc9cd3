"""Software prefetch into L2 for weight-streaming kernels: PTX ``prefetch.global.L2``, one 128-byte line each.

What it does
    ``prefetch_l2(ptrs, on)`` asks L2 for the line holding each address of ``ptrs`` where ``on`` is non-zero. Nothing
    is written to a register and nothing waits for it: the line travels from DRAM to L2 while the kernel goes on.
    ``prefetch_block_l2`` covers a [ROWS, COLS] block of a row-major buffer with one address per line, spread so that
    every thread of the CTA issues at most a few (a block smaller than the CTA gets one address per thread, the rest
    predicated off, instead of Triton's copies of each element in several threads: no duplicate requests).

Where it pays (H200, results/l2-ahead-h200-2026-12-03.md)
    The W8A8 GEMM with 64-row tiles (M 17-64) on layers of few output tiles: 4096 x 14336 runs 64 programs, each
    streaming 917 KB of weight rows through a 4-stage pipeline, and a prefetch 4 K tiles ahead lifted it from 1.26x to
    1.43x bf16 (int8; fp8 1.23x -> 1.38x). Where the grid covers the GPU several times it does not: every resident
    program's look-ahead adds up, and the W4A16 gemv (whole grid resident, 7-8 CTAs per SM) ran 7-23% slower with it
    (prefetched lines evicted from the 50 MB L2 before their use, most likely). The W4A16 path was measured and dropped
    (commit da0e855 has it); ``w8a8.l2_ahead_for`` is the rule.

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
