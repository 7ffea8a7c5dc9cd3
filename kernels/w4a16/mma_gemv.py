"""Skinny-M W4A16 product on the tensor cores of one warp at a time (mma.sync), written in Gluon: y = x @ W.T + bias
for M = 1-16 rows (decode), reading the GPTQ buffers in place.

What it computes
    y[m, n] = sum_k x[m, k] * s[g(k), n] * (q[k, n] - z[g(k), n]) + bias[n], fp32 accumulation, y in x's dtype.
    Same buffers as ``w4a16_gemv.py`` (``W4A16Weight``: qweight int32 [K / 8, N] packed along K lowest bits first,
    qzeros int32 [n_g, N / 8], scales fp16 [n_g, N], groups contiguous along K). The difference q - z is exact in
    fp16 / bf16, the tensor cores add the products x (q - z) in fp32, and each group's partial sum is multiplied by
    its fp32 scale: no rounding of the weight at all (PyTorch's dequantize rounds (q - z) s to 16 bits first).

Why
    The CUDA-core gemv spends ~3.7 instructions per weight (unpack, FFMA per row of x) and keeps few loads in flight
    (results/w4a16-h200-2026-12-03b.md: 1.0-1.9 TB/s of the 4.25 TB/s copy bandwidth at M = 1). Here unpacking costs
    ~1.1 instructions per weight (per packed word of eight fp16 codes: 1 shift, 4 LOP3 with the magic exponent, 2
    subtractions and 2 FMAs of the zero pairs), plus one mma per 32 codes of a thread.
    This is Marlin's idea (Frantar et al., 2024: dequantize in registers straight into mma fragments) without its
    re-laid-out weight: the product over K does not care in which order the K positions meet, so each thread takes
    whole packed words of the ordinary GPTQ layout and feeds x to the mma in the same permuted K order.

How (one warp = 32 output columns; a CTA = num_warps warps side by side along N; split-K over grid axis 1)
    Thread (g, c) = (lane // 4, lane % 4) owns the four adjacent columns 4g .. 4g+3 of its warp's 32 and, at K step
    s (32 deep), the packed word row 4s + c: one 16-byte load of four words. Columns (4g, 4g+1) and (4g+2, 4g+3) are
    rows (g, g + 8) of two m16n8k16 A operands (weights as A: "swap AB", so M = 1-8 rows of x fill the n8 side and
    9-16 take a second mma); the word's codes (j, j + 4) become one fp16 / bf16 pair (LOP3 with 1024 (fp16) or 128
    (bf16) as exponent, minus the pair 1024 + z), codes (0, 4) and (1, 5) one k16 step, (2, 6) and (3, 7) the next.
    The B operand is row g of x at the same eight K positions of word 4s + c (one 16-byte load, permuted by two
    PRMTs per pair of registers). The accumulator fragment leaves thread (g, c) with y[2c + e, 4g + i]: its own
    columns, so the per-group scales are its own loads. Everything per thread is explicit, so the unpacking and
    the mma are one inline-PTX block per K step (``pack=4``: each thread's four elements of each operand).
    split-K: partial tiles in an fp32 workspace [split, M, N]; the last CTA of a column tile (a counter in
    ``W4A16Weight.locks``) adds them in split order (deterministic). Parts are whole loop iterations; where the split
    does not divide their count the parts differ by one iteration (``MmaGemvConfig.uneven``).

Measured (H200, Triton 3.6, results/w4a16-mma-gemv-h200-2026-12-04.md): 2.2 SASS instructions per weight (fp16;
bf16 2.4: three shifts per word), 58 registers. Against the previous choices over eight layer shapes, geomean of
speedups over cuBLAS fp16 at M = 1 / 2 / 4 / 8: 2.43x / 2.18x / 2.15x / 2.01x where the CUDA-core gemv and the
Triton m16 tiles gave 2.31x / 1.56x / 1.42x / 1.36x. At M = 16 (two mma row blocks) the first split rule lost to
the Triton tiles (1.16x against 1.32x); with fewer CTAs per SM (``MMA_TWO_BLOCKS``) it wins on all eight shapes
(1.78x against 1.29x), so the dispatcher runs M <= 16 here. The weights stream at 1.1-2.9 TB/s, where a plain read of
the same words in the same grid reaches 1.75-3.45 TB/s (results/w4a16-mma-tma-ring-h200-2026-12-04.md). ptxas keeps
about two K steps of loads in flight per thread, yet that is not the bound: a TMA ring keeping 16-64 KB per CTA in
flight ran slower, and so did a K step with the zero folded out (5-10% fewer instructions, more registers); what
remains is each warp's dependent chain at the occupancy its registers allow. ``prefetch`` (the next iteration's
words loaded before this one's math, 66 registers, allocated as 72) helps where the grid keeps its warps
(``mma_config_for``; 28672 x 8192 at M = 1: 3.0x).
A per-thread cp.async ring in shared memory (3-4 iterations ahead, no registers held) ran at about half the speed:
Triton's barrier analysis puts CTA barriers around the ring although each thread reads only what it copied (code in
commit 21b3bd4); two column blocks per thread (98 registers) lost to occupancy.

Limits: 4-bit codes; K a multiple of 32 x ``steps``; group size a multiple of 32 (or one group); N a multiple of 4;
x with unit column stride and an even row stride (read as 32-bit pairs); M <= 16. CUDA compute capability 9.0+
(mma.sync would run on sm_80, but the bf16 subtraction needs sm_90);
Gluon has no interpreter mode, so CPU tests cover the launcher's rules and the reference, the GPU tests the kernel.
Written for Triton 3.6's Gluon. Tuned on the H200 (sm_90, 132 SMs).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
from quantkit.kernels.w4a16_configs import LOCK_SLOTS
from quantkit.kernels.w4a16_gemv import w4a16_gemv_reference
from quantkit.kernels.w4a16_weight import W4A16Weight, check_operands, num_sms
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

w4a16_mma_gemv_reference = w4a16_gemv_reference  # the same product


def mma_step_asm(bf16: bool, mb: int) -> str:
    """PTX for one K step of one thread: 4 packed words (columns 4g .. 4g+3, word row 4s + c), their 4 zero pairs
    (magic + z) and 4 high zero pairs (-(magic / 16 + z)), mb x 4 int32 of x (eight 16-bit activations of one row, as
    pairs) and 2 mb accumulators of 4 fp32 in; the 2 mb accumulators out. Operand numbering follows Triton's
    pack=4: 4 registers per operand, outputs first, in argument order.

    Codes (j, j + 4) of a word become one pair: (w >> 4j) & 0x000F000F | magic reads as magic + code in each half,
    minus the zero pair leaves q - z exactly. fp16 saves two of the three shifts (Marlin's trick, Frantar et al.
    2024): (w >> s) & 0x00F000F0 | magic reads as 1024 + 16 code, and one FMA by 1/16 minus (64 + z) leaves q - z
    (exact: powers of two and small integers); bf16's 7 mantissa bits leave no room for a code at bit 4."""
    kind = "bf16" if bf16 else "f16"
    magic = 0x43004300 if bf16 else 0x64006400
    sixteenth = 0x2C002C00  # fp16 1/16 in both halves
    n_acc = 2 * mb
    out = [[f"${4 * t + i}" for i in range(4)] for t in range(n_acc)]
    base = 4 * n_acc
    words = [f"${base + i}" for i in range(4)]
    zeros = [f"${base + 4 + i}" for i in range(4)]
    zeros_hi = [f"${base + 8 + i}" for i in range(4)]
    xs = [[f"${base + 12 + 4 * b + i}" for i in range(4)] for b in range(mb)]
    acc_in = [[f"${base + 12 + 4 * mb + 4 * t + i}" for i in range(4)] for t in range(n_acc)]
    lines = ["{", ".reg .b32 u, " + ", ".join(f"p{i}_{j}" for i in range(4) for j in range(4)) + ";",
             ".reg .b32 " + ", ".join(f"x{b}_{j}" for b in range(mb) for j in range(4)) + ";",
             ".reg .f32 d0, d1, d2, d3;", ".reg .b32 sx;", f"mov.b32 sx, {sixteenth:#010x};"]  # fmt: skip
    for i in range(4):  # word i -> pairs p{i}_j = codes (j, j + 4) minus the zero, as two 16-bit floats
        w = words[i]
        if bf16:
            lines.append(f"lop3.b32 p{i}_0, {w}, 0x000F000F, {magic:#010x}, 0xea;")
            for j in (1, 2, 3):
                lines += [f"shr.u32 u, {w}, {4 * j};", f"lop3.b32 p{i}_{j}, u, 0x000F000F, {magic:#010x}, 0xea;"]
            lines += [f"sub.rn.bf16x2 p{i}_{j}, p{i}_{j}, {zeros[i]};" for j in range(4)]
            continue
        lines += [f"lop3.b32 p{i}_0, {w}, 0x000F000F, {magic:#010x}, 0xea;",
                  f"lop3.b32 p{i}_1, {w}, 0x00F000F0, {magic:#010x}, 0xea;",
                  f"shr.u32 u, {w}, 8;",
                  f"lop3.b32 p{i}_2, u, 0x000F000F, {magic:#010x}, 0xea;",
                  f"lop3.b32 p{i}_3, u, 0x00F000F0, {magic:#010x}, 0xea;"]  # fmt: skip
        for j in (0, 2):
            lines.append(f"sub.rn.f16x2 p{i}_{j}, p{i}_{j}, {zeros[i]};")
            lines.append(f"fma.rn.f16x2 p{i}_{j + 1}, p{i}_{j + 1}, sx, {zeros_hi[i]};")
    for b in range(mb):  # x pairs (j, j+1) -> (j, j + 4) as the codes
        x0, x1, x2, x3 = xs[b]
        lines += [f"prmt.b32 x{b}_0, {x0}, {x2}, 0x5410;", f"prmt.b32 x{b}_1, {x0}, {x2}, 0x7632;",
                  f"prmt.b32 x{b}_2, {x1}, {x3}, 0x5410;", f"prmt.b32 x{b}_3, {x1}, {x3}, 0x7632;"]  # fmt: skip
    op = f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32"
    for b in range(mb):
        for p in range(2):  # A rows g / g + 8 = columns 2p / 2p + 1; accumulator (e, column) = tensor 2b + e, elem
            c_idx = [(2 * b, 2 * p), (2 * b + 1, 2 * p), (2 * b, 2 * p + 1), (2 * b + 1, 2 * p + 1)]
            for h in range(2):
                a = f"p{2 * p}_{2 * h}, p{2 * p + 1}_{2 * h}, p{2 * p}_{2 * h + 1}, p{2 * p + 1}_{2 * h + 1}"
                bb = f"x{b}_{2 * h}, x{b}_{2 * h + 1}"
                src = ", ".join(acc_in[t][i] for t, i in c_idx) if h == 0 else "d0, d1, d2, d3"
                dst = "d0, d1, d2, d3" if h == 0 else ", ".join(out[t][i] for t, i in c_idx)
                lines.append(f"{op} {{{dst}}}, {{{a}}}, {{{bb}}}, {{{src}}};")
    lines.append("}")
    return "\n".join(lines)


def mma_step_constraints(mb: int) -> str:
    n_acc = 2 * mb
    return ",".join(["=f"] * (4 * n_acc) + ["r"] * (4 * (3 + mb)) + ["f"] * (4 * n_acc))


_F16_MB1 = gl.constexpr(mma_step_asm(False, 1))
_F16_MB2 = gl.constexpr(mma_step_asm(False, 2))
_BF16_MB1 = gl.constexpr(mma_step_asm(True, 1))
_BF16_MB2 = gl.constexpr(mma_step_asm(True, 2))
_CONS_MB1 = gl.constexpr(mma_step_constraints(1))
_CONS_MB2 = gl.constexpr(mma_step_constraints(2))


@gluon.jit
def _mma_step(words, zp, zh, x0, x1, a0, a1, a2, a3, BF16: gl.constexpr, MB: gl.constexpr):
    """One K step through the inline PTX: the accumulators (a0, a1) for rows 2c, 2c+1 (and a2, a3 for rows
    8 + 2c, 9 + 2c when MB == 2) of x, each [T, 4] over the thread's four columns."""
    if MB == 1:
        a0, a1 = gl.inline_asm_elementwise(_BF16_MB1 if BF16 else _F16_MB1, _CONS_MB1, [words, zp, zh, x0, a0, a1],
                                           (gl.float32, gl.float32), is_pure=True, pack=4)  # fmt: skip
    else:
        a0, a1, a2, a3 = gl.inline_asm_elementwise(_BF16_MB2 if BF16 else _F16_MB2, _CONS_MB2,
                                                   [words, zp, zh, x0, x1, a0, a1, a2, a3], (gl.float32,) * 4,
                                                   is_pure=True, pack=4)  # fmt: skip
    return a0, a1, a2, a3


@gluon.jit
def _zero_pairs(zw, cols, BF16: gl.constexpr):
    """Packed zero words of the thread's columns -> zero pairs (magic + z in both 16-bit halves) and high zero
    pairs (fp16: -(64 + z); unused for bf16)."""
    z = (zw >> ((cols % 8) * 4)) & 0xF
    zv = z | (0x4300 if BF16 else 0x6400)
    zh = (z * 16 + 0x5400) | 0x8000
    return zv | (zv << 16), zh | (zh << 16)


@gluon.jit
def _words(w_ptrs, kw, stride_qwk, nmask, EVEN_N: gl.constexpr):
    """The thread's four packed words of word row ``kw`` + c."""
    if EVEN_N:
        return gl.load(w_ptrs + kw * stride_qwk)
    else:
        return gl.load(w_ptrs + kw * stride_qwk, mask=nmask, other=0)


@gluon.jit
def _k_loop(qz_ptr, s_ptr, w_ptrs, x0_ptrs, x1_ptrs, cols, nmask, it0, n_iters, stride_qwk, stride_qzg,
            stride_sg, L: gl.constexpr, GROUP: gl.constexpr, STEPS: gl.constexpr, SPG: gl.constexpr, MB: gl.constexpr,
            BF16: gl.constexpr, EVEN_N: gl.constexpr, PREFETCH: gl.constexpr):  # fmt: skip
    """The K slice: accumulators over the thread's four columns for rows (2c, 2c + 1) of x, then rows (8 + 2c,
    9 + 2c) when MB == 2. The loads are plain; ptxas keeps about two steps of them in flight. PREFETCH (4 steps
    per iteration): the next iteration's words are loaded before this one's math (the last iteration reloads its
    own, an L2 hit)."""
    zero = gl.zeros(cols.shape, gl.float32, layout=L)
    acc0 = zero
    acc1 = zero
    acc2 = zero
    acc3 = zero
    if PREFETCH:
        n0 = _words(w_ptrs, it0 * 16, stride_qwk, nmask, EVEN_N)
        n1 = _words(w_ptrs, it0 * 16 + 4, stride_qwk, nmask, EVEN_N)
        n2 = _words(w_ptrs, it0 * 16 + 8, stride_qwk, nmask, EVEN_N)
        n3 = _words(w_ptrs, it0 * 16 + 12, stride_qwk, nmask, EVEN_N)
    for it in range(it0, it0 + n_iters):
        if PREFETCH:
            c0 = n0
            c1 = n1
            c2 = n2
            c3 = n3
            nk = gl.minimum(it + 1, it0 + n_iters - 1) * 16
            n0 = _words(w_ptrs, nk, stride_qwk, nmask, EVEN_N)
            n1 = _words(w_ptrs, nk + 4, stride_qwk, nmask, EVEN_N)
            n2 = _words(w_ptrs, nk + 8, stride_qwk, nmask, EVEN_N)
            n3 = _words(w_ptrs, nk + 12, stride_qwk, nmask, EVEN_N)
        for st in gl.static_range(STEPS):
            kw = (it * STEPS + st) * 4  # first packed word row of the step
            if st % SPG == 0:
                grp = (kw * 8) // GROUP
                zp, zh = _zero_pairs(gl.load(qz_ptr + grp * stride_qzg + cols // 8, mask=nmask, other=0), cols, BF16)
                sc = gl.load(s_ptr + grp * stride_sg + cols, mask=nmask, other=0.0).to(gl.float32)
                p0 = zero
                p1 = zero
                p2 = zero
                p3 = zero
            if PREFETCH:
                words = c0 if st == 0 else c1 if st == 1 else c2 if st == 2 else c3
            else:
                words = _words(w_ptrs, kw, stride_qwk, nmask, EVEN_N)
            x0 = gl.load(x0_ptrs + 4 * kw)
            x1 = x0
            if MB == 2:
                x1 = gl.load(x1_ptrs + 4 * kw)
            p0, p1, p2, p3 = _mma_step(words, zp, zh, x0, x1, p0, p1, p2, p3, BF16, MB)
            if st % SPG == SPG - 1:
                acc0 += sc * p0
                acc1 += sc * p1
                if MB == 2:
                    acc2 += sc * p2
                    acc3 += sc * p3
    return acc0, acc1, acc2, acc3


@gluon.jit
def _store_rows(out_ptr, ws_ptr, bias_ptr, acc, m, cols, M, N, stride_om, split, SPLIT_K: gl.constexpr,
                HAS_BIAS: gl.constexpr, FINAL: gl.constexpr):  # fmt: skip
    """Rows ``m`` ([T]) of the thread's columns: the fp32 partial into the workspace (not FINAL) or, when FINAL,
    the sum of the SPLIT_K partials in split order (+ bias) into y."""
    nmask = cols < N
    mask = gl.expand_dims(m < M, 1) & nmask
    idx = gl.expand_dims(m, 1) * N + cols
    if FINAL:
        total = acc
        if SPLIT_K > 1:
            total = gl.load(ws_ptr + idx, mask=mask, other=0.0, cache_modifier=".cg")
            for i in gl.static_range(1, SPLIT_K):
                total += gl.load(ws_ptr + i * M * N + idx, mask=mask, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            total += gl.load(bias_ptr + cols, mask=nmask, other=0.0).to(gl.float32)
        gl.store(out_ptr + gl.expand_dims(m, 1) * stride_om + cols, total.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        gl.store(ws_ptr + split * M * N + idx, acc, mask=mask)


@gluon.jit
def _store_all(out_ptr, ws_ptr, bias_ptr, acc0, acc1, acc2, acc3, m0, cols, M, N, stride_om, split,
               SPLIT_K: gl.constexpr, HAS_BIAS: gl.constexpr, FINAL: gl.constexpr,
               MB: gl.constexpr):  # fmt: skip
    """``_store_rows`` of every accumulator ``_k_loop`` filled: rows m0 = 2c and 2c + 1 of the thread's columns,
    then rows 8 + 2c and 9 + 2c when MB == 2."""
    _store_rows(out_ptr, ws_ptr, bias_ptr, acc0, m0, cols, M, N, stride_om, split, SPLIT_K, HAS_BIAS, FINAL)
    _store_rows(out_ptr, ws_ptr, bias_ptr, acc1, m0 + 1, cols, M, N, stride_om, split, SPLIT_K, HAS_BIAS, FINAL)
    if MB == 2:
        _store_rows(out_ptr, ws_ptr, bias_ptr, acc2, m0 + 8, cols, M, N, stride_om, split, SPLIT_K, HAS_BIAS, FINAL)
        _store_rows(out_ptr, ws_ptr, bias_ptr, acc3, m0 + 9, cols, M, N, stride_om, split, SPLIT_K, HAS_BIAS, FINAL)


@gluon.jit
def _w4a16_mma_gemv_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, iters, stride_xm, stride_qwk, stride_qzg, stride_sg, stride_om,
    GROUP: gl.constexpr, STEPS: gl.constexpr, MB: gl.constexpr, BF16: gl.constexpr, HAS_BIAS: gl.constexpr,
    SPLIT_K: gl.constexpr, EVEN_N: gl.constexpr, PREFETCH: gl.constexpr, EVEN_SPLIT: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    L: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [num_warps, 1], [1, 0])
    BLOCK_N: gl.constexpr = 32 * num_warps
    SPG: gl.constexpr = GROUP // 32 if GROUP // 32 < STEPS else STEPS  # K steps per scale application

    pid_n = gl.program_id(0)
    split = gl.program_id(1)
    t = gl.arange(0, 32 * num_warps, layout=gl.SliceLayout(1, L))
    lane = t % 32
    g = lane // 4
    c = lane % 4
    cols = gl.expand_dims(pid_n * BLOCK_N + (t // 32) * 32 + 4 * g, 1) + gl.expand_dims(
        gl.arange(0, 4, layout=gl.SliceLayout(0, L)), 0
    )  # [T, 4]: the thread's four columns
    nmask = cols < N
    w_ptrs = qw_ptr + gl.expand_dims(c, 1) * stride_qwk + cols  # word row c of each step, + 4 rows per step
    quad = gl.expand_dims(4 * c, 1) + gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, L)), 0)
    # x as int32 pairs (word row r -> pairs 4r .. 4r+3); rows past M read row M - 1 (their outputs are not stored)
    x0_ptrs = x_ptr + gl.expand_dims(gl.minimum(g, M - 1) * stride_xm, 1) + quad
    x1_ptrs = x_ptr + gl.expand_dims(gl.minimum(g + 8, M - 1) * stride_xm, 1) + quad

    # split-K in whole loop iterations: ``iters`` per part (EVEN_SPLIT), else ``iters`` in all, the parts as even as
    # they go (they differ by at most one iteration). The even case keeps the loop count a launch argument, which
    # Triton specializes (e.g. divisible by 16) as it did before uneven parts existed.
    if EVEN_SPLIT:
        it0 = split * iters
        n_it = iters
    else:
        it0 = split * iters // SPLIT_K
        n_it = (split + 1) * iters // SPLIT_K - it0
    acc0, acc1, acc2, acc3 = _k_loop(
        qz_ptr, s_ptr, w_ptrs, x0_ptrs, x1_ptrs, cols, nmask, it0, n_it,
        stride_qwk, stride_qzg, stride_sg, L, GROUP, STEPS, SPG, MB, BF16, EVEN_N, PREFETCH,
    )  # fmt: skip

    m0 = 2 * c
    if SPLIT_K > 1:
        _store_all(out_ptr, ws_ptr, bias_ptr, acc0, acc1, acc2, acc3, m0, cols, M, N, stride_om, split, SPLIT_K,
                   HAS_BIAS, False, MB)  # fmt: skip
        gl.thread_barrier()
        done = gl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        gl.thread_barrier()
        if done == SPLIT_K - 1:  # each thread adds up the partials of its own elements
            _store_all(out_ptr, ws_ptr, bias_ptr, acc0, acc1, acc2, acc3, m0, cols, M, N, stride_om, split, SPLIT_K,
                       HAS_BIAS, True, MB)  # fmt: skip
            gl.store(cnt_ptr + pid_n, 0)
    else:
        _store_all(out_ptr, ws_ptr, bias_ptr, acc0, acc1, acc2, acc3, m0, cols, M, N, stride_om, split, SPLIT_K,
                   HAS_BIAS, True, MB)  # fmt: skip


@dataclass(frozen=True)
class MmaGemvConfig:
    """``num_warps`` warps of 32 columns per CTA; ``steps`` K steps of 32 per loop iteration (all their loads
    issued together); K is split until the grid has ``fill`` x SMs CTAs (at most ``max_split`` slices)."""

    num_warps: int = 4
    steps: int = 4
    fill: float = 4.0
    max_split: int = 16
    prefetch: bool = False  # steps == 4 only: the next iteration's words are loaded before this one's math
    wave: int = 0  # > 0: the split never makes the grid exceed this many CTAs per SM (one wave of resident CTAs)
    min_depth: int = 0  # > 0: the split never leaves a CTA fewer than this many K rows
    skip_split: int = 0  # > 0: a split measured slow for this config; the rule goes one doubling on (or back)
    wave_divisor: bool = False  # the split: the largest divisor of the loop count whose grid fits one wave (``wave``)
    uneven: bool = False  # the doubling split need not divide the loop count (parts differ by at most one iteration)

    @property
    def block_n(self) -> int:
        return 32 * self.num_warps

    @property
    def name(self) -> str:
        extra = ("p" if self.prefetch else "") + (f"v{self.wave}" if self.wave else "")
        extra += f"d{self.min_depth}" if self.min_depth else ""
        extra += f"m{self.max_split}" if self.max_split != 16 else ""
        extra += f"x{self.skip_split}" if self.skip_split else ""
        extra += "e" if self.wave_divisor else ""
        extra += "u" if self.uneven else ""
        return f"mma-w{self.num_warps}s{self.steps}f{self.fill:g}{extra}"


MMA_MAX_M = 16
MMA_TRITON = "3.6."  # the Gluon API the kernel is written for
# ``w4a16_linear`` runs this kernel up to MMA_DISPATCH_M rows (H200, eight layer shapes): against the previous choice
# 0.95-1.12x at M = 1 (the CUDA-core gemv; 7 of 8 shapes faster), 1.12-1.95x at M = 2-8
# (results/w4a16-mma-gemv-h200-2026-12-04.md); M = 9-16 see MMA_TWO_BLOCKS.
MMA_DISPATCH_M = 16
MMA_DEFAULT = MmaGemvConfig()
# Loading the next iteration's words first holds 66 registers instead of 58 (groups of 128, one row block; offline
# sm_90 compile with Triton 3.6), allocated in units of 8 as 72 against 64: 28 resident warps per SM instead of 32.
# It won where its one-wave split gives the grid as many warps as the default's (28672 x 8192 at M = 1: 2.93x cuBLAS
# fp16 against 2.61x; 4096 x 14336 2.23x against 1.96x) and lost where the wave cap halves them (8192 x 8192 2.65x
# against 3.00x), hence ``mma_config_for``. With groups of 64 the loop holds 72 registers (76 were read on the GPU
# for the revision timed then), a wave holds fewer CTAs than the cap assumes, and the full table lost up to a third at
# M = 2-8 (results/w4a16-h200-2026-12-04b.md; 28672 x 8192 at M = 4: 1.30x against 2.08x): groups of 64 never take it.
MMA_PREFETCH = MmaGemvConfig(2, 4, 8.0, prefetch=True, wave=14)
# Groups of 64, M <= 8: two K steps per iteration (one group each), no prefetch. At M = 1 it beat MMA_DEFAULT on 7
# of 8 shapes (1.06-1.19x; 14336 x 4096 0.88x); at M = 4 on the five whose split reaches max_split (1.03-1.50x) and
# lost on the three of N >= 14336 split 4-8 ways (0.87-0.89x): ``mma_config_for`` keeps it to M = 1 and to the
# layers it splits max_split ways (results/w4a16-mma-split-probe-h200-2026-12-04.md).
MMA_STEPS2 = MmaGemvConfig(4, 2, 4.0)
# The same loop at M = 1 (groups of 64), with the split rule fitted to every split of it timed on eight shapes in two
# runs (results/w4a16-mma-split-m1-h200-2026-12-04.md): 8-way splits ran 1.25-1.91x cuBLAS fp16 where 4 or 16 ran
# 2.2-3.0x on every shape, so the rule steps over 8 (14336 x 4096: 1.81x -> 2.17x), and the layers of N = 4096 fill
# the GPU only at 32 slices (4096 x 14336: 2.00x -> 2.22x; 4096 x 4096 tied); the other shapes keep their split.
MMA_STEPS2_M1 = MmaGemvConfig(4, 2, 4.0, max_split=32, skip_split=8)
# It also serves groups of 128 (and, as for MMA_PREFETCH, other multiples or one group) at M = 1 on layers of at most
# MMA_STEPS2_M1_MAX_N columns (64 column tiles, K split 16-32 ways): against the prefetch / default choice, two runs
# (results/w4a16-mma-split-m1-h200-2026-12-04.md's run 2, results/w4a16-mma-tma-ring-h200-2026-12-04.md section 3):
# 4096 x 14336 +7% / +7%, 4096 x 4096 +5% / +5%, 6144 x 4096 +3% / +4%, 8192 x 8192 and 8192 x 28672 +1% / +1%;
# on the wider layers it lost 3-7% (14336 x 4096, 28672 x 4096, 28672 x 8192), which keep the prefetch loop.
MMA_STEPS2_M1_MAX_N = 8192
# Groups of a multiple of 128 (or one group) at M = 2-8: MMA_STEPS2 on layers of 33-64 column tiles (4096 < N <= 8192),
# where two runs of every shape at M = 2 / 4 / 8 (results/w4a16-mma-tma-ring-h200-2026-12-04.md, section 4) had it
# 3-5% ahead of the default loop (8192 x 8192, 8192 x 28672) and 5-13% ahead of the prefetch loop (6144 x 4096); at 32
# tiles it was within 2% or lost (4096 x 14336 at M = 2: 0.93x), on the wider layers it lost 7-24%.
MMA_STEPS2_TILES = (33, 64)
# M = 9-16 (two mma row blocks per warp): the prefetch loop with a split that keeps the grid within 8 CTAs per SM
# and each CTA at 512 K rows or more. With two row blocks the prefetch loop holds 128 registers (sm_90, compiled
# offline with Triton 3.6): 16 resident warps, i.e. 8 two-warp CTAs per SM, not MMA_PREFETCH's wave of 14; and short
# K slices pay the fp32 partial sums of 16 rows. Every split timed at M = 16: this
# rule picks the fastest on all 16 (shape, group 128 / 64) cells; against the Triton m16 tiles that served these rows
# before, 1.01-1.64x (geomean over cuBLAS fp16 1.29x -> 1.78x at group 128, 1.27x -> 1.62x at group 64, 1.29x ->
# 1.79x with one group per column; results/w4a16-mma-split-probe-h200-2026-12-04.md).
# Its parts need not divide K evenly (``uneven``): on the layers the split is the one timed above, and on
# layers whose K has few factors of two the doubling no longer stops at 1-4 slices (4096 x 11008: 2 -> 16, 8192 x
# 29568: 1 -> 8; results/w4a16-mma-two-blocks-uneven-h200-2026-12-04.md).
MMA_TWO_BLOCKS = MmaGemvConfig(2, 4, 8.0, prefetch=True, wave=8, min_depth=512, uneven=True)
# M = 1, groups of a multiple of 128 (or one group): the prefetch loop split into the largest whole number of slices
# whose grid fits one wave of 14 CTAs per SM, any divisor of the loop count, where that split is not a power of two
# and fills at least MMA_WAVE_FILL of the wave (K = 7 x 2^j layers). Same run, every split of four configs
# (results/w4a16-mma-wave-split-h200-2026-12-04.md): 8192 x 28672 split 14 3.00x cuBLAS fp16 against 2.86x for the
# two-step loop's 16 (and 2.52x for the prefetch loop's power-of-two 8); 4096 x 14336 split 28 2.47x against 2.38x.
# With groups of 64 the same splits lost (2.31x against 2.62x, 2.01x against 2.22x): not taken there.
MMA_PREFETCH_WAVE = MmaGemvConfig(2, 4, 8.0, max_split=32, prefetch=True, wave=14, wave_divisor=True)
MMA_WAVE_FILL = 0.9
# M <= 8, groups of a multiple of 128 (or one group), when the rules above leave the grid under MMA_REFILL of one
# wave (MMA_REFILL_ROWS at M = 2-8) on a layer whose K is no power of two (``under_filled``: the down projections
# of Llama-2 and Qwen2.5, whose K has few factors of two, so the doubling stops early): MMA_PREFETCH_WAVE if its
# split fills at least MMA_PREFETCH_REFILL of its wave, else the default loop with the divisor rule
# (MMA_DEFAULT_WAVE, 8 CTAs per SM; when it fills more), which goes one divisor past the wave when no divisor fills
# half of it. Fitted on every divisor split of three configs on four such layers at M = 1 and 4
# (results/w4a16-mma-odd-k-split-h200-2026-12-04.md), then checked old rule against new through the same kernel on
# seven layers (results/w4a16-mma-rule-ab-h200-2026-12-04.txt), e.g. at M = 1 4096 x 11008 0.91x -> 1.99x cuBLAS
# fp16 (split 4 -> 43), 8192 x 29568 0.71x -> 2.52x (2 -> 11, prefetch), 3584 x 3584 1.03x -> 1.94x; at M = 4
# 0.41-1.02x -> 1.16-2.31x.
MMA_RESIDENT_4W = 8  # CTAs per SM of the four-warp loops (58-64 registers a thread)
MMA_REFILL = 0.625  # M = 1: the four layers switched filled 6-61%; 6144 x 4096 (73%) keeps its measured best
# M = 2-8: the one-wave prefetch split lost where the doubling rule already filled 55% (4096 x 14336, split 16 -> 28:
# 2.03x -> 1.65x at M = 2, 1.84x -> 1.33x at M = 8), so below half a wave only
# (results/w4a16-mma-rule-ab-h200-2026-12-04.txt)
MMA_REFILL_ROWS = 0.5
MMA_PREFETCH_REFILL = 0.75
MMA_DEFAULT_WAVE = MmaGemvConfig(4, 4, 4.0, max_split=64, wave=MMA_RESIDENT_4W, wave_divisor=True)


def mma_gemv_split(cfg: MmaGemvConfig, n: int, k: int, sms: int) -> int:
    """Split-K factor: doubled while the grid has fewer than cfg.fill x SMs CTAs, K still splits into whole loop
    iterations, (cfg.wave) the grid stays within one wave of resident CTAs and (cfg.min_depth) each CTA keeps at
    least that many K rows; a result of cfg.skip_split moves one doubling on where allowed, else one back.
    cfg.wave_divisor: instead, the largest divisor of the loop count (at most cfg.max_split) within one wave, or,
    when that fills less than half of the wave, the smallest divisor past it (a wave and part of another beat a mostly
    idle GPU)."""
    ctas = -(-n // cfg.block_n)
    iters = k // (32 * cfg.steps)
    if cfg.wave_divisor:
        divisors = [s for s in range(1, min(iters, cfg.max_split) + 1) if iters % s == 0]
        cap = cfg.wave * sms
        inside = max((s for s in divisors if ctas * s <= cap), default=1)
        past = [s for s in divisors if ctas * s > cap]
        return min(past) if 2 * ctas * inside < cap and past else inside

    def allowed(split: int) -> bool:
        return (
            split <= cfg.max_split
            and (cfg.uneven or iters % split == 0)
            and iters >= split
            and not (cfg.wave and ctas * split > cfg.wave * sms)
            and not (cfg.min_depth and iters // split * 32 * cfg.steps < cfg.min_depth)
        )

    split = 1
    while ctas * split < cfg.fill * sms and allowed(split * 2):
        split *= 2
    if cfg.skip_split and split == cfg.skip_split:
        split = split * 2 if allowed(split * 2) else split // 2
    return split


def mma_gemv_unsupported_reason(x: torch.Tensor, w: W4A16Weight, out: torch.Tensor | None,
                                cfg: MmaGemvConfig) -> str | None:  # fmt: skip
    """Why this kernel cannot run the product (None: it can); operand shapes and dtypes are ``check_operands``'s."""
    depth = 32 * cfg.steps
    group = w.group_size
    if w.bits != 4:
        return f"4-bit weights only, got {w.bits}-bit"
    if x.shape[0] > MMA_MAX_M:
        return f"M = {x.shape[0]} rows; this kernel takes at most {MMA_MAX_M}"
    if cfg.prefetch and cfg.steps != 4:
        return f"prefetch is written for 4 steps per iteration, got {cfg.steps}"
    if w.in_features % depth:
        return f"K = {w.in_features} must be a multiple of {depth}"
    if group and (group % 32 or (group % depth if group >= depth else cfg.steps % (group // 32))):
        return f"group size {group} must be a multiple of {depth} or divide it in multiples of 32"
    if w.out_features % 4:
        return f"N = {w.out_features} must be a multiple of 4"
    if x.stride(1) != 1 or x.stride(0) % 2:
        return "x needs unit column stride and an even row stride (read as 32-bit pairs)"
    if out is not None and out.stride(1) != 1:
        return "out needs unit column stride"
    if not triton.__version__.startswith(MMA_TRITON):
        return f"written for Triton {MMA_TRITON}x's Gluon, found Triton {triton.__version__}"
    if not x.is_cuda or torch.cuda.get_device_capability(x.device) < (9, 0):
        return "needs a CUDA device of compute capability 9.0 or newer"
    return None


def grid_warps(cfg: MmaGemvConfig, n: int, k: int, sms: int) -> int:
    """Warps the launch of ``cfg`` puts on the GPU for an N x K layer (CTAs x split x warps per CTA)."""
    return -(-n // cfg.block_n) * mma_gemv_split(cfg, n, k, sms) * cfg.num_warps


def wave_split_fits(n: int, k: int, sms: int) -> bool:
    """Whether MMA_PREFETCH_WAVE's split of an N x K layer is one the doubling rules cannot reach (not a power of
    two) and fills at least MMA_WAVE_FILL of its wave."""
    split = mma_gemv_split(MMA_PREFETCH_WAVE, n, k, sms)
    return split & (split - 1) != 0 and wave_fill(MMA_PREFETCH_WAVE, n, k, sms) >= MMA_WAVE_FILL


@functools.lru_cache(maxsize=1024)
def mma_config_for(n: int, k: int, group: int, sms: int, m: int = 1) -> MmaGemvConfig | None:
    """The measured config for an N x K layer at M rows (see the configs above), None where this kernel is not the
    choice: M = 9-16 with groups other than 64, a multiple of 128 or one group (groups of 32 ran at about cuBLAS
    fp16's speed on every path; the Triton m16 tiles keep them).
    M <= 8: for groups of 64 MMA_STEPS2_M1 at M = 1 and MMA_STEPS2 where it splits K max_split ways; for groups of
    a multiple of 128 (or one group) MMA_PREFETCH_WAVE at M = 1 where ``wave_split_fits``, else MMA_STEPS2_M1 at
    M = 1 on layers of at most MMA_STEPS2_M1_MAX_N columns and
    MMA_STEPS2 at M = 2-8 on layers of MMA_STEPS2_TILES column tiles, then MMA_PREFETCH where its grid has at least
    as many warps as MMA_DEFAULT's; else MMA_DEFAULT. For groups of a multiple of 128 (or one group) a choice that is
    ``under_filled`` gives way to MMA_PREFETCH_WAVE or MMA_DEFAULT_WAVE (see there)."""
    if m > 8:
        return MMA_TWO_BLOCKS if group % 64 == 0 else None
    cfg = _doubling_config(n, k, group, sms, m)
    if group % 128 == 0 and cfg is not MMA_PREFETCH_WAVE and under_filled(cfg, n, k, sms, m):
        if wave_fill(MMA_PREFETCH_WAVE, n, k, sms) >= MMA_PREFETCH_REFILL:
            return MMA_PREFETCH_WAVE
        if wave_fill(MMA_DEFAULT_WAVE, n, k, sms) > wave_fill(cfg, n, k, sms):
            return MMA_DEFAULT_WAVE
    return cfg


def under_filled(cfg: MmaGemvConfig, n: int, k: int, sms: int, m: int = 1) -> bool:
    """Whether cfg's doubling split leaves the grid under MMA_REFILL (M = 1) or MMA_REFILL_ROWS (M = 2-8) of a wave
    on a layer whose K is not a power of two (K = odd x 2^j, odd > 1: the doubling runs out of factors of two)."""
    return k & (k - 1) != 0 and wave_fill(cfg, n, k, sms) < (MMA_REFILL if m == 1 else MMA_REFILL_ROWS)


def wave_fill(cfg: MmaGemvConfig, n: int, k: int, sms: int) -> float:
    """The share of one wave of resident CTAs (cfg.wave per SM, else MMA_RESIDENT_4W) that cfg's grid fills."""
    if k % (32 * cfg.steps):
        return 0.0
    ctas = -(-n // cfg.block_n) * mma_gemv_split(cfg, n, k, sms)
    return ctas / ((cfg.wave or MMA_RESIDENT_4W) * sms)


def _doubling_config(n: int, k: int, group: int, sms: int, m: int) -> MmaGemvConfig:
    """``mma_config_for`` at M <= 8 before its under-filled-grid fallback."""
    if m == 1 and group % 128 == 0 and wave_split_fits(n, k, sms):
        return MMA_PREFETCH_WAVE
    if m == 1 and (group == 64 or (group % 128 == 0 and n <= MMA_STEPS2_M1_MAX_N)):
        return MMA_STEPS2_M1
    if group % 128 == 0 and MMA_STEPS2_TILES[0] <= -(-n // MMA_STEPS2.block_n) <= MMA_STEPS2_TILES[1]:
        return MMA_STEPS2
    if group == 64 and mma_gemv_split(MMA_STEPS2, n, k, sms) == MMA_STEPS2.max_split:
        return MMA_STEPS2
    if group % 128 == 0 and grid_warps(MMA_PREFETCH, n, k, sms) >= grid_warps(MMA_DEFAULT, n, k, sms):
        return MMA_PREFETCH
    return MMA_DEFAULT


def mma_plan(x: torch.Tensor, w: W4A16Weight, out: torch.Tensor | None = None) -> tuple[MmaGemvConfig, int] | None:
    """(config, split-K) when ``w4a16_linear`` runs this kernel for x [M, K] (kernel channel order), else None:
    CUDA, M up to MMA_DISPATCH_M, a measured config (``mma_config_for``) and operands it takes
    (``mma_gemv_unsupported_reason``)."""
    m = x.shape[0]
    if not x.is_cuda or m > MMA_DISPATCH_M:
        return None
    n, k, sms = w.out_features, w.in_features, num_sms(x.device)
    cfg = mma_config_for(n, k, w.group_size, sms, m)
    if cfg is None or mma_gemv_unsupported_reason(x, w, out, cfg) is not None:
        return None
    return cfg, mma_gemv_split(cfg, n, k, sms)


def w4a16_mma_gemv(
    x: torch.Tensor,
    w: W4A16Weight,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: MmaGemvConfig | None = None,
    split: int | None = None,
) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W.T + bias for M <= 16; x is already in kernel channel order. ``split``: the split-K
    factor instead of ``mma_gemv_split``'s (tests, probes): parts of whole loop iterations, as even as they go."""
    check_operands(x, w, bias, out)
    sms = num_sms(x.device)
    cfg = config or mma_config_for(w.out_features, w.in_features, w.group_size, sms, x.shape[0]) or MMA_DEFAULT
    reason = mma_gemv_unsupported_reason(x, w, out, cfg)
    if reason:
        raise ValueError(f"w4a16_mma_gemv: {reason}")
    k, n = w.in_features, w.out_features
    if split is None:
        split = mma_gemv_split(cfg, n, k, sms)
    elif not 1 <= split <= k // (32 * cfg.steps) or (split > 1 and -(-n // cfg.block_n) > LOCK_SLOTS):
        raise ValueError(f"split {split}: K = {k} has {k // (32 * cfg.steps)} loop iterations of {32 * cfg.steps}, "
                         "at least one per part")  # fmt: skip
    return launch(x, w, bias, out, cfg, split)


def launch(x: torch.Tensor, w: W4A16Weight, bias: torch.Tensor | None, out: torch.Tensor | None, cfg: MmaGemvConfig,
           split: int) -> torch.Tensor:  # fmt: skip
    """The launch itself, for operands already checked (``w4a16_mma_gemv``, or ``mma_plan`` + ``check_operands``).
    The automatic split leaves at most N / 64 column tiles to count, far under LOCK_SLOTS for any layer here."""
    m, k = x.shape
    n = w.out_features
    ctas = -(-n // cfg.block_n)
    iters = k // (32 * cfg.steps)
    even = iters % split == 0
    if out is None:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    part = torch.empty(split, m, n, device=x.device, dtype=torch.float32) if split > 1 else out
    _w4a16_mma_gemv_kernel[(ctas, split)](
        x.view(torch.int32), w.qweight, w.qzeros, w.scales, bias if bias is not None else out, out, part, w.locks,
        m, n, iters // split if even else iters, x.stride(0) // 2, w.qweight.stride(0), w.qzeros.stride(0),
        w.scales.stride(0), out.stride(0),
        GROUP=w.group_size or 2**30, STEPS=cfg.steps, MB=1 if m <= 8 else 2, BF16=x.dtype == torch.bfloat16,
        HAS_BIAS=bias is not None, SPLIT_K=split, EVEN_N=n % cfg.block_n == 0,
        PREFETCH=cfg.prefetch, EVEN_SPLIT=even, num_warps=cfg.num_warps,
    )  # fmt: skip
    return out
