"""Skinny-M W4A16 product on the tensor cores of one warp at a time (mma.sync), written in Gluon: y = x @ W.T + bias
for M = 1-16 rows (decode), reading the GPTQ buffers in place.

What it computes
    y[m, n] = sum_k x[m, k] * s[g(k), n] * (q[k, n] - z[g(k), n]) + bias[n], fp32 accumulation, y in x's dtype.
    Same buffers as ``gemv.py`` (``W4A16Weight``: qweight int32 [K / 8, N] packed along K lowest bits first,
    qzeros int32 [n_g, N / 8], scales fp16 [n_g, N], groups contiguous along K). The difference q - z is exact in
    fp16 / bf16, the tensor cores add the products x (q - z) in fp32, and each group's partial sum is multiplied by
    its fp32 scale: no rounding of the weight at all (PyTorch's dequantize rounds (q - z) s to 16 bits first).

Why
    The CUDA-core gemv spends ~3.7 instructions per weight (unpack, FFMA per row of x) and keeps few loads in flight.
    Here unpacking costs ~1.1 instructions per weight (per packed word of eight fp16 codes: 1 shift, 4 LOP3 with the
    magic exponent, 2 subtractions and 2 FMAs of the zero pairs), plus one mma per 32 codes of a thread.
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

Measured (H200, Triton 3.6): 2.2 SASS instructions per weight (fp16;
bf16 2.4: three shifts per word), 58 registers. Against the previous choices over eight layer shapes, geomean of
speedups over cuBLAS fp16 at M = 1 / 2 / 4 / 8: 2.43x / 2.18x / 2.15x / 2.01x where the CUDA-core gemv and the
Triton m16 tiles gave 2.31x / 1.56x / 1.42x / 1.36x. At M = 16 (two mma row blocks) the first split rule lost to
the Triton tiles (1.16x against 1.32x); with fewer CTAs per SM (``MMA_TWO_BLOCKS``) it wins on all eight shapes
(1.78x against 1.29x), so the dispatcher runs M <= 16 here. The weights stream at 1.1-2.9 TB/s, where a plain read of
the same words in the same grid reaches 1.75-3.45 TB/s. ptxas keeps
about two K steps of loads in flight per thread, yet that is not the bound: a TMA ring keeping 16-64 KB per CTA in
flight ran slower, and so did a K step with the zero folded out (5-10% fewer instructions, more registers); what
remains is each warp's dependent chain at the occupancy its registers allow. ``prefetch`` (the next iteration's
words loaded before this one's math, 66 registers, allocated as 72) helps where the grid keeps its warps
(``mma_config_for``; 28672 x 8192 at M = 1: 3.0x).
A per-thread cp.async ring in shared memory (3-4 iterations ahead, no registers held) ran at about half the speed:
Triton's barrier analysis puts CTA barriers around the ring although each thread reads only what it copied; two
column blocks per thread (98 registers) lost to occupancy.

Limits: 4-bit codes; K a multiple of 32 x ``steps``; group size a multiple of 32 (or one group); N a multiple of 4;
x with unit column stride and an even row stride (read as 32-bit pairs); M <= 16. CUDA compute capability 9.0+
(mma.sync would run on sm_80, but the bf16 subtraction needs sm_90);
Gluon has no interpreter mode, so CPU tests cover the launcher's rules and the reference, the GPU tests the kernel.
Written for Triton 3.6's Gluon. Tuned on the H200 (sm_90, 132 SMs).
"""

from __future__ import annotations

import torch
from quantkit.kernels._device import num_sms
from quantkit.kernels.w4a16.configs import LOCK_SLOTS
from quantkit.kernels.w4a16.gemv import w4a16_gemv_reference
from quantkit.kernels.w4a16.mma_gemv_configs import (
    MMA_DEFAULT,
    MmaGemvConfig,
    mma_config_for,
    mma_gemv_split,
    mma_gemv_unsupported_reason,
)
from quantkit.kernels.w4a16.weight import W4A16Weight, check_operands
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
    """The launch for operands already checked (``w4a16_mma_gemv``, or the dispatch after ``check_operands``).
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
