"""Output epilogue shared by the Triton W4A16 kernels (``gemm.py``, ``gemv.py``): cast, bias, split-K fix-up.

What it does
    ``finish_tile`` takes a CTA's fp32 accumulator [BLOCK_M, BLOCK_N] and either stores it (+ bias, cast to the
    output dtype) or, when K is split over grid axis 1, runs the serial fix-up: every CTA writes its partial tile
    to ``part`` [split, M, N] fp32, then counts itself in on a per-output-tile semaphore (``lock``); the last
    arrival sums the partials in split order (deterministic: the same bits on every run), adds the bias, stores
    y and resets the semaphore to 0 for the next launch. One launch, no memset, no second reduction kernel; the
    split factor is read from the grid, so one compiled kernel serves every factor.

Why not fp32 atomics into a zeroed buffer: they need a memset and a cast kernel around the product (three
launches, ~2-3 us of launch gaps at decode sizes, where the whole product takes 5-40 us) and their sum order
changes from run to run. The fix-up costs one extra fp32 write + read of [split, M, N], a few % of the weight
bytes at the split factors the launch plans pick.

Limits: semaphores live in the prepared weight (``W4A16Weight.locks``): one weight must not run on two streams
at once. ``EMULATE_BF16`` is for Triton's interpreter only (its bf16 cast truncates; this rounds to nearest even).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def to_act(v, ACT: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """fp32 -> ACT. EMULATE_BF16 (interpreter only) rounds to nearest even by hand: its own cast truncates."""
    if EMULATE_BF16:
        bits = v.to(tl.int32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(ACT)


@triton.jit
def _store_tile(acc, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, stride_on, HAS_BIAS: tl.constexpr,
                EMULATE_BF16: tl.constexpr):  # fmt: skip
    """y[offs_m, offs_n] = acc (+ bias) in the output's dtype, masked to [M, N]."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(ptrs, to_act(acc, out_ptr.dtype.element_ty, EMULATE_BF16), mask=mask)


@triton.jit
def finish_tile(acc, bias_ptr, out_ptr, part_ptr, lock_ptr, tile_id, offs_m, offs_n, M, N, stride_om, stride_on,
                 SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, EMULATE_BF16: tl.constexpr,
                 UNROLL: tl.constexpr = 4):  # fmt: skip
    """Store acc [BLOCK_M, BLOCK_N], or (SPLIT) add it to the other K splits' partials with the serial fix-up.

    ``tile_id`` indexes the output tile's semaphore in ``lock_ptr``; ``part_ptr`` holds [split, M, N] fp32.
    The last arrival loads ``UNROLL`` partials per round (all in flight at once: each round costs one L2 round
    trip) and adds them in split order, so the sum does not depend on ``UNROLL``.
    """
    if not SPLIT:
        _store_tile(acc, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, stride_on, HAS_BIAS, EMULATE_BF16)
    else:
        pid_k = tl.program_id(1)
        part_offs = offs_m[:, None] * N + offs_n[None, :]
        part_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        tl.store(part_ptr + pid_k * M * N + part_offs, acc, mask=part_mask)
        tl.debug_barrier()  # all partial stores of this CTA happen before its release below
        lock = lock_ptr + tile_id
        arrived = tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
        split_k = tl.num_programs(1)  # a runtime value: one compiled kernel serves every split factor
        if arrived == split_k - 1:
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for s0 in range(0, split_k, UNROLL):
                for j in tl.static_range(UNROLL):
                    mask = part_mask & (part_offs * 0 + s0 + j < split_k)
                    p = tl.load(part_ptr + (s0 + j) * M * N + part_offs, mask=mask, other=0.0, cache_modifier=".cg")
                    total += p
            tl.atomic_xchg(lock, 0)  # ready for the next launch
            _store_tile(total, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, stride_on, HAS_BIAS, EMULATE_BF16)
