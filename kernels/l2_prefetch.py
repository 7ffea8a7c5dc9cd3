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


# -- whole buffers, from a kernel of their own -----------------------------------------------------------------------
# ``prefetch_buffers_l2`` asks L2 for every line of up to four buffers in one launch. The runtime issues it on a side
# stream ahead of a weight-streaming GEMM whose predecessors are small kernels that leave DRAM idle (batch-1 decode:
# the o_proj weight while rotary, KV store and attention run), so that GEMM reads its weight from L2.
MAX_BUFFERS = 4


@triton.jit
def _lines(base, n_lines, touched, pid, nprog, ISSUE: tl.constexpr, BLOCK: tl.constexpr):
    for start in range(pid * BLOCK, n_lines, nprog * BLOCK):
        line = start + tl.arange(0, BLOCK)
        on = line < n_lines
        if ISSUE:
            prefetch_l2(base + line.to(tl.int64) * LINE_BYTES, on.to(tl.int32))
        else:  # the interpreter cannot run the PTX: record which lines would be asked for instead
            tl.atomic_add(touched + line, 1, mask=on)


@triton.jit
def _prefetch_buffers_kernel(p0, n0, p1, n1, p2, n2, p3, n3, t0, t1, t2, t3, ISSUE: tl.constexpr,
                             BLOCK: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    _lines(p0, n0, t0, pid, nprog, ISSUE, BLOCK)
    _lines(p1, n1, t1, pid, nprog, ISSUE, BLOCK)
    _lines(p2, n2, t2, pid, nprog, ISSUE, BLOCK)
    _lines(p3, n3, t3, pid, nprog, ISSUE, BLOCK)


def buffer_lines(t) -> int:
    """128-byte lines spanned by a contiguous tensor (from its first byte; a partial last line counts)."""
    return -(-t.numel() * t.element_size() // int(LINE_BYTES))


def prefetch_buffers_l2(buffers: list, programs: int = 132, num_warps: int = 2, touched: list | None = None) -> None:
    """Ask L2 for every 128-byte line of each contiguous CUDA tensor of ``buffers`` (at most ``MAX_BUFFERS``): one
    launch of ``programs`` CTAs striding over the lines. Nothing waits for the lines and no result changes.

    ``touched`` (one int32 tensor of ``buffer_lines(b)`` zeros per buffer): instead of prefetching, count in it how
    often each line is named (the only way to test the kernel where inline PTX cannot run: Triton's interpreter)."""
    import torch

    if not 1 <= len(buffers) <= MAX_BUFFERS:
        raise ValueError(f"prefetch_buffers_l2: 1 to {MAX_BUFFERS} buffers, got {len(buffers)}")
    for b in buffers:
        if not b.is_contiguous():
            raise ValueError(f"prefetch_buffers_l2: buffers must be contiguous, got strides {b.stride()}")
    if touched is not None and [tuple(t.shape) for t in touched] != [(buffer_lines(b),) for b in buffers]:
        raise ValueError("prefetch_buffers_l2: touched needs one [lines] counter per buffer")
    if touched is None and not buffers[0].is_cuda:
        raise ValueError("prefetch_buffers_l2: L2 prefetch needs CUDA tensors (inline PTX)")
    raw = [b.view(-1).view(torch.uint8) if b.numel() else b.new_empty(0, dtype=torch.uint8) for b in buffers]
    lines = [buffer_lines(b) for b in buffers]
    counters = list(touched) if touched is not None else [raw[0]] * len(buffers)  # unused unless touched
    while len(raw) < MAX_BUFFERS:
        raw.append(raw[0])
        lines.append(0)
        counters.append(counters[0])
    args = [a for pair in zip(raw, lines, strict=True) for a in pair]
    _prefetch_buffers_kernel[(programs,)](*args, *counters, ISSUE=touched is None, BLOCK=32 * num_warps,
                                          num_warps=num_warps)  # fmt: skip


# The same, with plain loads instead of prefetch hints: every 32-bit word of the buffers is read (16 KB per program,
# all loads in flight at once) and dropped, so L2 holds the buffers whether or not the hardware honours hints.
LOAD_BLOCK = 4096  # int32 words per program


@triton.jit
def _load_chunk(base, n_words, chunk, sink, BLOCK: tl.constexpr):
    offs = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    w = tl.load(base + offs, mask=offs < n_words, other=0, eviction_policy="evict_last")
    s = tl.sum(w, axis=0)
    tl.store(sink, s, mask=s == 0x5EED)  # a use the compiler cannot drop; writes only on that exact sum


@triton.jit
def _load_buffers_kernel(p0, n0, c0, p1, n1, c1, p2, n2, c2, p3, n3, sink, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if pid < c0:
        _load_chunk(p0, n0, pid, sink, BLOCK)
    elif pid < c0 + c1:
        _load_chunk(p1, n1, pid - c0, sink, BLOCK)
    elif pid < c0 + c1 + c2:
        _load_chunk(p2, n2, pid - c0 - c1, sink, BLOCK)
    else:
        _load_chunk(p3, n3, pid - c0 - c1 - c2, sink, BLOCK)


def load_buffers_l2(buffers: list, sink, num_warps: int = 4) -> None:
    """Read every 32-bit word of each contiguous tensor of ``buffers`` (at most ``MAX_BUFFERS``, each a whole number
    of words) and drop the values: one launch of 16 KB per program. ``sink``: an int32 tensor the kernel may write
    (only when a chunk's words sum to a magic value)."""
    import torch

    if not 1 <= len(buffers) <= MAX_BUFFERS:
        raise ValueError(f"load_buffers_l2: 1 to {MAX_BUFFERS} buffers, got {len(buffers)}")
    words = []
    for b in buffers:
        if not b.is_contiguous() or (b.numel() * b.element_size()) % 4:
            raise ValueError("load_buffers_l2: buffers must be contiguous and a whole number of 32-bit words")
        words.append(b.view(-1).view(torch.int32) if b.numel() else b.new_empty(0, dtype=torch.int32))
    chunks = [-(-w.numel() // LOAD_BLOCK) for w in words]
    while len(words) < MAX_BUFFERS:
        words.append(words[0])
        chunks.append(0)
    if sum(chunks):
        args = [a for w, c in zip(words, chunks, strict=True) for a in (w, w.numel(), c)]
        _load_buffers_kernel[(sum(chunks),)](*args[:-1], sink, BLOCK=LOAD_BLOCK, num_warps=num_warps)
