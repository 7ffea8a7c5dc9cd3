"""W8A8 linear: 8-bit activations x 8-bit weights with per-token x per-output-channel scales, int8 or fp8 e4m3.

Computes ``y[m, n] = (acc[m, n] * a_scale[m]) * w_scale[n] (+ bias[n])`` with ``acc = sum_k qa[m, k] * qw[n, k]``,
in two kernels:

1. ``quantize_activations``: one program per row of x [M, K] (fp16/bf16/fp32). Dynamic (per token): the row's abs-max
   gives ``a_scale[m] = amax / QMAX`` and ``qa = clamp(round(x * (QMAX / amax)), -QMAX, QMAX)``; short rows are read
   once and kept in registers, long ones in two sweeps (``_quantize_launch_params``). Static (per tensor): ``qa =
   clamp(round(x * (1 / input_scale)))`` with the calibrated fp32 ``input_scale`` [1]. QMAX = 127 for int8 (symmetric,
   -128 unused) and 448 for e4m3fn (largest finite). ``amax`` is floored at ``MIN_AMAX`` so that all-zero rows give
   zeros, not NaN. Rounding is half-to-even, to the integers (int8) or to the e4m3 grid (fp8), computed explicitly in
   fp32 so the GPU and Triton's interpreter agree with ``torch.round`` / ``Tensor.to(torch.float8_e4m3fn)`` bit for bit
   (the interpreter's own fp32 -> fp8 cast does not round to nearest even).
2. ``w8a8_matmul``: qa [M, K] x qw [N, K]^T. Tiles of BLOCK_M x BLOCK_N, grouped along M (GROUP_M) for L2 reuse, and
   a K loop of BLOCK_K. Two kernels share the accumulate and epilogue code: operand tiles fetched by the TMA unit
   through host-built tensor descriptors (config ``USE_TMA``; needs K % 16 == 0), or by pointer loads with an
   unmasked EVEN_K fast path (any K). ``USE_TMA`` 2 runs the TMA product persistently (one program per SM walking the
   output tiles, so a program's next loads overlap its epilogue; 3 and 4: two and three programs per SM). Triton
   3.6's automatic warp specialization of that loop (``tl.range(..., warp_specialize=True)``, num_warps 4, loop not
   flattened) compiles for sm_90 but hung on the H200 (2026-12-02, 128 x 256 tiles, int8): not offered. int8
   accumulates in int32 (exact while 128 * 128 * K < 2**31, i.e. K <= 131_071; weights from GPTQ may use the code
   -128). fp8 accumulates in fp32; Hopper's fp8 tensor cores add with reduced precision, so by default each
   BLOCK_K-long partial sum is promoted into a full fp32 accumulator (DeepSeek-V3's fix, promotion interval 128);
   ``fp8_fast_accum=True`` keeps the whole K loop in the tensor core (Triton's sm_90 default, like cuBLAS
   ``use_fast_accum=True``). The epilogue converts the accumulator to fp32, applies both scales and the bias in
   registers and stores fp16/bf16/fp32 once: the int32 accumulator never goes to memory.
   On Hopper, fp8 with the promoted accumulation at M > 256 runs ``w8a8_ws_kernel.py`` instead (Gluon, two consumer
   warp groups whose promotions overlap each other's wgmma; the same promotion interval and error, 1.46x bf16
   against 1.31x for this kernel's tiles, results/w8a8-fp8-ws-h200-2026-12-04.md); ``w8a8_ws.py`` holds the rule.
3. Programmatic dependent launch (``w8a8_linear``, M <= 64 on sm_90+, ``use_pdl``): the quantizer lets the GEMM start
   at once; the GEMM asks L2 for the first ``PDL_PREFETCH_K`` bytes of its weight rows, then waits
   (griddepcontrol.wait) for the codes, so the quantizer's launch and run overlap the GEMM's start (+3% at M 16-64).
4. L2 prefetch ahead (M 17-64, ``l2_ahead_for``): inside the K loop each program asks L2 for its weight tile
   ``L2_AHEAD_M64`` steps ahead (``l2_prefetch.py``), which pays where few programs stream long weight rows.

Weight layout: ``qw`` [N, K] row-major, K contiguous (``Layout.INT8_ROWMAJOR`` / ``Layout.FP8_ROWMAJOR`` v1). That is
the K-major B operand Hopper's int8/fp8 wgmma needs (only 16-bit types may read a transposed shared-memory operand)
and the layout cuBLAS's fast int8 path wants (``torch._int_mm(a, w.t())``), so no re-layout is needed.

Limits: 2-D operands, K-contiguous ``qa`` and ``qw``, every tensor under 2**31 elements (32-bit offsets).
Tile configs: ``CONFIGS`` below, per (format, M regime); see its header for what they were tuned on. int8 with
M <= 16 on layers of more than 2 x 132 such tiles takes ``INT8_WIDE_SKINNY`` (``pick_config``'s ``n``); M 33-64 the
persistent ``UPPER_M64``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from quantkit.kernels.l2_prefetch import prefetch_block_l2, prefetch_l2, threads
from quantkit.kernels.w4a16_weight import interpreting, num_sms
from quantkit.kernels.w8a8_ws import launch as ws_launch
from quantkit.kernels.w8a8_ws import tma_compatible, ws_offered, ws_unsupported_reason
from triton.tools.tensor_descriptor import TensorDescriptor

INT8_MAX = 127.0
E4M3_MAX = 448.0
MIN_AMAX = 1e-30  # keeps QMAX / amax finite in fp32 for all-zero (or subnormal) rows
ONE_PASS_MAX_K = 32768  # rows up to this length may be quantized from registers after a single read
SWEEP_BLOCK_K = 8192  # the block of the two-sweep path (abs-max sweep, then quantizing sweep) for longer rows
PDL_MAX_M = 64  # w8a8_linear launches the GEMM with programmatic dependent launch up to this many rows (use_pdl)
PDL_PREFETCH_K = 1024  # bytes of each weight row asked from L2 before the GEMM waits for the quantizer
INT32_SAFE_K = (2**31 - 1) // (128 * 128)  # 131_071: the int8 accumulator cannot overflow up to this K
_MAX_NUMEL = 2**31 - 1

FORMAT_OF_DTYPE = {torch.int8: "int8", torch.float8_e4m3fn: "fp8"}
DTYPE_OF_FORMAT = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
QMAX_OF_FORMAT = {"int8": INT8_MAX, "fp8": E4M3_MAX}
_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_MIN_AMAX = tl.constexpr(MIN_AMAX)


# ----------------------------------------------------------------------------------------------------------------
# Reference (plain PyTorch): defines the numerics the kernels reproduce.
# ----------------------------------------------------------------------------------------------------------------


def _cast_codes(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 values already clamped to [-QMAX, QMAX] -> int8 codes (half-to-even) or e4m3 (nearest even)."""
    if fmt == "int8":
        return torch.round(v).to(torch.int8)
    return v.to(torch.float8_e4m3fn)


def quantize_rows_reference(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row quantization: x [R, C] float -> (q [R, C] int8 | float8_e4m3fn, scale fp32 [R]).

    ``x ~= q * scale[:, None]``. Used for activations (rows = tokens) and for weights (rows = output channels).
    """
    xf = x.float()
    amax = xf.abs().amax(dim=1).clamp(min=MIN_AMAX)  # [R]
    qmax = torch.full_like(amax, QMAX_OF_FORMAT[fmt])
    # tensor / tensor divides correctly rounded, like the kernel's div_rn; a Python-scalar numerator or divisor
    # may be computed through a reciprocal (scalar / t is t.reciprocal() * scalar), rounding twice
    scale = amax / qmax
    inv = qmax / amax
    q = _cast_codes((xf * inv[:, None]).clamp(-QMAX_OF_FORMAT[fmt], QMAX_OF_FORMAT[fmt]), fmt)
    return q, scale


def quantize_activations_reference(
    x: torch.Tensor, fmt: str, input_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (qa [M, K], a_scale fp32 [M] when dynamic, or ``input_scale`` [1] when static)."""
    if input_scale is None:
        return quantize_rows_reference(x, fmt)
    qmax = QMAX_OF_FORMAT[fmt]
    scale = input_scale.float().reshape(1)
    inv = torch.ones_like(scale) / scale
    q = _cast_codes((x.float() * inv).clamp(-qmax, qmax), fmt)
    return q, scale


def scaled_epilogue_reference(
    acc: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """acc [M, N] (int32 or fp32) -> (acc * a_scale[m]) * w_scale[n] (+ bias[n]) in fp32, then ``out_dtype``."""
    a = a_scale.float().reshape(-1, 1)  # [M, 1] or [1, 1]
    y = acc.float() * a * w_scale.float().reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def w8a8_matmul_reference(
    qa: torch.Tensor,
    a_scale: torch.Tensor,
    qw: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float16,
) -> torch.Tensor:
    """The GEMM on quantized operands (int8: exact, as integer sums below 2**53 in fp64; fp8: fp32 accumulation),
    then the fp32 epilogue."""
    acc_dtype = torch.float64 if qa.dtype == torch.int8 else torch.float32
    acc = qa.to(acc_dtype) @ qw.to(acc_dtype).t()
    return scaled_epilogue_reference(acc, a_scale, w_scale, bias, out_dtype)


# ----------------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _round_half_even(v):
    """Round fp32 to the nearest integer, ties to even (== torch.round); exact for |v| < 2**23."""
    f = tl.floor(v)
    d = v - f
    f_is_odd = (f - 2.0 * tl.floor(0.5 * f)) != 0.0
    return f + tl.where((d > 0.5) | ((d == 0.5) & f_is_odd), 1.0, 0.0)


@triton.jit
def _round_to_e4m3_grid(v):
    """Round fp32 with |v| <= 448 to the nearest e4m3fn value (ties to even), still as fp32.

    The spacing of e4m3 values in |v|'s binade is 2**(e - 3) (3 mantissa bits), and 2**-9 below the smallest
    normal 2**-6; scaling by powers of two built from the exponent bits is exact, so only the integer rounding
    rounds. The sign is copied back bitwise so that negatives rounding to zero give -0, as a hardware cast does.
    """
    bits = v.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((127 - e + 3) << 23).to(tl.float32, bitcast=True)
    r = _round_half_even(tl.abs(v) * inv_step) * step
    return (r.to(tl.int32, bitcast=True) | (bits & -0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def _store_codes(q_ptrs, v, mask, QMAX: tl.constexpr, IS_FP8: tl.constexpr):
    """v fp32 = x * (1 / scale): clamp to [-QMAX, QMAX], round, store as int8 or e4m3."""
    v = tl.minimum(tl.maximum(v, -QMAX), QMAX)
    if IS_FP8:
        tl.store(q_ptrs, _round_to_e4m3_grid(v).to(q_ptrs.dtype.element_ty), mask=mask)
    else:
        tl.store(q_ptrs, _round_half_even(v).to(tl.int8), mask=mask)


@triton.jit
def _quantize_rows_kernel(
    # pointers
    x_ptr,
    q_ptr,
    scale_ptr,
    # sizes
    K,
    # strides
    stride_xm,
    stride_xk,
    stride_qm,
    stride_qk,
    # meta-parameters
    QMAX: tl.constexpr,
    IS_FP8: tl.constexpr,
    DYNAMIC: tl.constexpr,
    ONE_PASS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # the GEMM that follows may start now: it waits for this grid's writes before reading them
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    offs = tl.arange(0, BLOCK_K)

    if ONE_PASS:  # the whole row fits in one block: read it once
        mask = offs < K
        x = tl.load(x_row + offs * stride_xk, mask=mask, other=0.0).to(tl.float32)
        if DYNAMIC:
            amax = tl.maximum(tl.max(tl.abs(x), axis=0), _MIN_AMAX)
            tl.store(scale_ptr + row, tl.math.div_rn(amax, QMAX))
            inv = tl.math.div_rn(QMAX, amax)
        else:
            inv = tl.math.div_rn(1.0, tl.load(scale_ptr))
        _store_codes(q_row + offs * stride_qk, x * inv, mask, QMAX, IS_FP8)
    else:  # long rows: abs-max sweep, then a quantizing sweep (the row is in L2 by then)
        if DYNAMIC:
            running = tl.zeros([BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                mask = k0 + offs < K
                x = tl.load(x_row + (k0 + offs) * stride_xk, mask=mask, other=0.0).to(tl.float32)
                running = tl.maximum(running, tl.abs(x))
            amax = tl.maximum(tl.max(running, axis=0), _MIN_AMAX)
            tl.store(scale_ptr + row, tl.math.div_rn(amax, QMAX))
            inv = tl.math.div_rn(QMAX, amax)
        else:
            inv = tl.math.div_rn(1.0, tl.load(scale_ptr))
        for k0 in range(0, K, BLOCK_K):
            mask = k0 + offs < K
            x = tl.load(x_row + (k0 + offs) * stride_xk, mask=mask, other=0.0).to(tl.float32)
            _store_codes(q_row + (k0 + offs) * stride_qk, x * inv, mask, QMAX, IS_FP8)


@triton.jit
def _await_activations(w_ptr, stride_wn, stride_wk, pid_n, N, K,
                       PDL: tl.constexpr, PREFETCH_K: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Under programmatic dependent launch this grid may start while the activation quantizer still runs: first
    ask L2 for the first PREFETCH_K columns of this tile's weight rows (they do not depend on it), then wait for
    the quantizer's writes (griddepcontrol.wait)."""
    if PDL:
        if PREFETCH_K > 0:
            rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
            cols = tl.arange(0, PREFETCH_K // 128) * 128  # one address per 128-byte line
            ptrs = w_ptr + rows[:, None] * stride_wn + (cols % K)[None, :] * stride_wk
            prefetch_l2(ptrs, tl.full(ptrs.shape, 1, tl.int32))
        tl.extra.cuda.gdc_wait()


@triton.jit
def _prefetch_ahead_start(w_ptr, stride_wn, pid_n, N, K, L2_AHEAD: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, THREADS: tl.constexpr):  # fmt: skip
    """L2 prefetch (``l2_prefetch.py``) of this tile's weight K tiles 1 .. L2_AHEAD - 1, before the K loop."""
    for d in tl.static_range(1, L2_AHEAD):
        prefetch_block_l2(w_ptr, pid_n * BLOCK_N, N, stride_wn, d * BLOCK_K, K, d * BLOCK_K < K, BLOCK_N, BLOCK_K,
                          THREADS)  # fmt: skip


@triton.jit
def _prefetch_ahead(w_ptr, stride_wn, pid_n, N, K, k0, L2_AHEAD: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, THREADS: tl.constexpr):  # fmt: skip
    """Inside the K loop at column k0: prefetch the weight K tile L2_AHEAD steps ahead."""
    if L2_AHEAD > 0:
        ahead = k0 + L2_AHEAD * BLOCK_K
        prefetch_block_l2(w_ptr, pid_n * BLOCK_N, N, stride_wn, ahead, K, ahead < K, BLOCK_N, BLOCK_K, THREADS)


@triton.jit
def _tile_ids(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """tile number -> (pid_m, pid_n), GROUP_M row-tiles at a time so that their weight tiles are reused from L2."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pids_per_group = GROUP_M * num_pid_n
    first_pid_m = (pid // pids_per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    return first_pid_m + (pid % pids_per_group) % group_rows, (pid % pids_per_group) // group_rows


@triton.jit
def _mma(a, w, acc, IS_FP8: tl.constexpr, FP8_FAST_ACCUM: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc += a [BLOCK_M, BLOCK_K] @ w [BLOCK_K, BLOCK_N] in int32 (int8) or fp32 (fp8)."""
    if IS_FP8 and FP8_FAST_ACCUM:
        return tl.dot(a, w, acc)  # sm_90: the whole K loop accumulates inside the tensor core (reduced precision)
    elif IS_FP8:
        return tl.dot(a, w, acc, max_num_imprecise_acc=BLOCK_K)  # promoted to full fp32 every BLOCK_K
    else:
        return tl.dot(a, w, acc, out_dtype=tl.int32)


@triton.jit
def _scale_bias_store(
    acc, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, stride_cm, stride_cn, offs_m, offs_n,
    A_SCALE_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """Epilogue in registers: (acc * a_scale[m]) * w_scale[n] (+ bias[n]) in fp32 -> one masked store."""
    mask_m = offs_m < M
    mask_n = offs_n < N
    y = acc.to(tl.float32)
    if A_SCALE_PER_ROW:
        y = y * tl.load(a_scale_ptr + offs_m, mask=mask_m, other=0.0)[:, None]
    else:
        y = y * tl.load(a_scale_ptr)
    y = y * tl.load(w_scale_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, y.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _w8a8_matmul_kernel(
    # pointers
    a_ptr,
    w_ptr,
    c_ptr,
    a_scale_ptr,
    w_scale_ptr,
    bias_ptr,
    # sizes
    M,
    N,
    K,
    # strides
    stride_am,
    stride_ak,
    stride_wn,
    stride_wk,
    stride_cm,
    stride_cn,
    # meta-parameters
    A_SCALE_PER_ROW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IS_FP8: tl.constexpr,
    FP8_FAST_ACCUM: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH_K: tl.constexpr,
    L2_AHEAD: tl.constexpr,
    THREADS: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    _await_activations(w_ptr, stride_wn, stride_wk, pid_n, N, K, PDL, PREFETCH_K, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # rows past M / N wrap onto valid rows: loads need no M/N mask, the store drops them
    a_ptrs = a_ptr + (offs_m % M)[:, None] * stride_am + offs_k[None, :] * stride_ak  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + (offs_n % N)[None, :] * stride_wn  # [BLOCK_K, BLOCK_N]

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32 if IS_FP8 else tl.int32)
    _prefetch_ahead_start(w_ptr, stride_wn, pid_n, N, K, L2_AHEAD, BLOCK_N, BLOCK_K, THREADS)
    for k0 in range(0, K, BLOCK_K):
        _prefetch_ahead(w_ptr, stride_wn, pid_n, N, K, k0, L2_AHEAD, BLOCK_N, BLOCK_K, THREADS)
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            a = tl.load(a_ptrs, mask=(k0 + offs_k)[None, :] < K, other=0.0)
            w = tl.load(w_ptrs, mask=(k0 + offs_k)[:, None] < K, other=0.0)
        acc = _mma(a, w, acc, IS_FP8, FP8_FAST_ACCUM, BLOCK_K)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    _scale_bias_store(
        acc, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, stride_cm, stride_cn, offs_m, offs_n,
        A_SCALE_PER_ROW, HAS_BIAS,
    )  # fmt: skip


@triton.jit
def _w8a8_matmul_tma_kernel(
    # tensor descriptors (TMA): qa [M, K] in blocks [BLOCK_M, BLOCK_K], qw [N, K] in blocks [BLOCK_N, BLOCK_K]
    a_desc,
    w_desc,
    # pointers
    c_ptr,
    a_scale_ptr,
    w_scale_ptr,
    bias_ptr,
    w_ptr,  # qw itself: only the L2 prefetch under PDL reads through it
    # sizes
    M,
    N,
    K,
    # strides
    stride_cm,
    stride_cn,
    stride_wn,
    # meta-parameters
    A_SCALE_PER_ROW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IS_FP8: tl.constexpr,
    FP8_FAST_ACCUM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH_K: tl.constexpr,
    PERSISTENT: tl.constexpr,
    NUM_PROGRAMS,  # PERSISTENT: the grid size
    L2_AHEAD: tl.constexpr,
    THREADS: tl.constexpr,
):
    """The same product with operand tiles fetched by the TMA unit (bulk async copies; out-of-bounds reads are
    zero-filled, so ragged M/N/K need no masks). PERSISTENT: one to three programs per SM walk the output tiles
    NUM_PROGRAMS apart, so the loads of a program's next tile overlap the epilogue of its current one; under PDL
    it waits once, before its first tile (the prefetch covers that tile's weight rows)."""
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    _await_activations(w_ptr, stride_wn, 1, pid_n, N, K, PDL, PREFETCH_K, BLOCK_N)
    if PERSISTENT:
        num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=True):
            pid_m, pid_n = _tile_ids(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            _tma_tile(a_desc, w_desc, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, w_ptr, M, N, K, stride_cm, stride_cn,
                      stride_wn, pid_m, pid_n, A_SCALE_PER_ROW, HAS_BIAS, IS_FP8, FP8_FAST_ACCUM, BLOCK_M, BLOCK_N,
                      BLOCK_K, L2_AHEAD, THREADS)  # fmt: skip
    else:
        _tma_tile(a_desc, w_desc, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, w_ptr, M, N, K, stride_cm, stride_cn,
                  stride_wn, pid_m, pid_n, A_SCALE_PER_ROW, HAS_BIAS, IS_FP8, FP8_FAST_ACCUM, BLOCK_M, BLOCK_N,
                  BLOCK_K, L2_AHEAD, THREADS)  # fmt: skip


@triton.jit
def _tma_tile(a_desc, w_desc, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, w_ptr, M, N, K, stride_cm, stride_cn,
              stride_wn, pid_m, pid_n, A_SCALE_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr, IS_FP8: tl.constexpr,
              FP8_FAST_ACCUM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              L2_AHEAD: tl.constexpr, THREADS: tl.constexpr):  # fmt: skip
    """One output tile from TMA-fetched operand tiles: the K loop, then the scaled store."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32 if IS_FP8 else tl.int32)
    _prefetch_ahead_start(w_ptr, stride_wn, pid_n, N, K, L2_AHEAD, BLOCK_N, BLOCK_K, THREADS)
    for k0 in range(0, K, BLOCK_K):
        _prefetch_ahead(w_ptr, stride_wn, pid_n, N, K, k0, L2_AHEAD, BLOCK_N, BLOCK_K, THREADS)
        a = a_desc.load([pid_m * BLOCK_M, k0])
        w = w_desc.load([pid_n * BLOCK_N, k0])
        acc = _mma(a, w.T, acc, IS_FP8, FP8_FAST_ACCUM, BLOCK_K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    _scale_bias_store(
        acc, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, stride_cm, stride_cn, offs_m, offs_n,
        A_SCALE_PER_ROW, HAS_BIAS,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# Tile configs per (format, M regime)
# ----------------------------------------------------------------------------------------------------------------

M_REGIMES = (("m16", 16), ("m64", 64), ("m256", 256), ("large", None))  # regime = first whose bound >= M
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "USE_TMA", "num_warps", "num_stages")
# USE_TMA: 0 pointer loads, 1 TMA, 2 / 3 / 4 TMA with one / two / three persistent programs per SM; TMA modes fall
# back to pointer loads where the operands are not TMA-compatible (``tma_compatible``)
TMA_MODES = (0, 1, 2, 3, 4)

# int8 "large" set by hand after benchmarks/probes/probe_persistent.py (H200, 2026-12-02): the persistent kernel with
# 256 x 128 tiles ran M >= 1024 at 1.50x bf16 (geomean of 18 cells, end to end) against 1.39x for the sweep's
# (128, 256, 128, 8, 1, 8, 3) in the same run (results/w8a8-persistent-h200-2026-12-02.md).
# BEGIN TUNED CONFIGS (rewritten by `python benchmarks/bench_w8a8.py --apply-sweep SWEEP.json`)
CONFIGS_TUNED_ON = "NVIDIA H200, torch 2.11.0+cu130, triton 3.6.0, 2026-11-29 12:23 UTC"
CONFIGS = {  # (format, M regime): CONFIG_KEYS values
    ("int8", "m16"): (16, 32, 256, 1, 1, 4, 6),
    ("int8", "m64"): (64, 64, 256, 1, 0, 4, 4),  # by hand, M 17-32 (see UPPER_M64)
    ("int8", "m256"): (64, 128, 128, 8, 0, 4, 4),
    ("int8", "large"): (256, 128, 128, 8, 2, 8, 3),
    ("fp8", "m16"): (16, 64, 256, 1, 1, 4, 4),
    ("fp8", "m64"): (64, 64, 256, 1, 0, 4, 4),  # by hand, M 17-32 (see UPPER_M64)
    ("fp8", "m256"): (64, 128, 128, 8, 0, 4, 4),
    ("fp8", "large"): (256, 128, 128, 8, 1, 8, 3),
}
# END TUNED CONFIGS


def m_regime(m: int) -> str:
    for name, bound in M_REGIMES:
        if bound is None or m <= bound:
            return name
    raise AssertionError("unreachable: the last regime has no bound")


# fp8 with fast accumulation and M > 256 (no promotion in the K loop, so the wide tile pays): the persistent kernel
# with 128 x 256 tiles, 1.61x bf16 against 1.52x with the promoted path's tiles, same probe and run as above
FP8_FAST_LARGE = (128, 256, 128, 8, 2, 8, 3)


# int8 with M <= 16 on wide layers: the committed 16 x 32 tiles fit 3 CTAs per SM (72 KB of shared memory each), so
# more than 2 x 132 tiles leave a last wave on part of the SMs; two persistent programs per SM over 16 x 64 tiles
# spread them evenly. benchmarks/probes/probe_persistent.py --ms 16,64 --variants int8 (H200, 2026-12-02; end to
# end, bf16 = 1): 14336 x 4096 1.27x -> 1.47x, 28672 x 8192 1.58x -> 1.67x, 8192 x 28672 1.68x -> 1.66x; at or
# below 264 tiles the committed config stayed ahead (results/w8a8-skinny-persistent-h200-2026-12-02.md). M = 1 was
# not probed; the full tables before and after it (results/w8a8-h200-2026-12-02b.md, -02e.md; two runs, so within
# their spread of a few %) read 14336 x 4096 1.29x -> 1.57x and 28672 x 8192 1.54x -> 1.84x at M = 1
INT8_WIDE_SKINNY = (16, 64, 256, 1, 3, 4, 4)
WIDE_TILES_PER_SM = 2  # of the committed m16 config's BLOCK_N


# The m64 regime in two halves, from benchmarks/probes/probe_m64.py (H200, 2026-12-03; end to end, bf16 = 1, geomean
# of six shapes, results/w8a8-m64-h200-2026-12-03.md). M 33-64: the persistent TMA kernel (one program per SM
# walking 64 x 64 x 256 tiles, so the next tile's loads overlap the current one's epilogue), int8 M = 64 1.453x ->
# 1.469x against the swept TMA config (1.457 -> 1.471 and 1.459 -> 1.473 in two reruns), fp8 1.422x -> 1.442x.
# M 17-32: CONFIGS' m64 entry, set by hand to pointer loads, which won at M = 32 (int8 1.272x -> 1.357x, fp8 1.262x
# -> 1.346x against the TMA config the 2026-11-29 sweep had picked at M = 64).
UPPER_M64 = (64, 64, 256, 1, 2, 4, 4)
UPPER_M64_FROM = 33


# M 17-64 (the m64 regime): each program asks L2 for its weight tile 4 K steps ahead. benchmarks/probes/
# probe_l2_ahead.py (H200, 2026-12-03), end to end over bf16, int8 / fp8: 4096 x 14336 1.26 / 1.23x -> 1.43 / 1.38x,
# 4096 x 4096 1.08 / 1.06x -> 1.16 / 1.13x, the other four shapes within -1% / +3%; at M = 1 and 16 it lost 0-7%
# (results/l2-ahead-h200-2026-12-03.md)
L2_AHEAD_M64 = 4


def l2_ahead_for(m: int) -> int:
    """K tiles ahead that the GEMM prefetches into L2 for M rows (``l2_prefetch.py``; 0: none)."""
    return L2_AHEAD_M64 if m_regime(m) == "m64" else 0


def pick_config(m: int, fmt: str, fp8_fast_accum: bool = False, n: int | None = None, sms: int = 132) -> dict[str, int]:
    """The tile config for M rows (``CONFIGS`` by regime); ``n`` (output features) and ``sms`` pick the wide-layer
    int8 config for M <= 16 (``INT8_WIDE_SKINNY``); M 33-64 takes ``UPPER_M64``."""
    regime = m_regime(m)
    values = FP8_FAST_LARGE if fmt == "fp8" and fp8_fast_accum and regime == "large" else CONFIGS[(fmt, regime)]
    if fmt == "int8" and regime == "m16" and n is not None and -(-n // values[1]) > WIDE_TILES_PER_SM * sms:
        values = INT8_WIDE_SKINNY
    if regime == "m64" and m >= UPPER_M64_FROM:
        values = UPPER_M64
    return dict(zip(CONFIG_KEYS, values, strict=True))


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _quantize_launch_params(k: int, block_k: int | None, fmt: str, m: int) -> tuple[int, bool, int]:
    """(block_k, one_pass, num_warps) for rows of length k, from an H200 probe (results/w8a8-quant-h200-2026-12-02.md).

    Rows up to 16384 are read once. Longer rows are read once only for int8 with few rows (M <= 64): the registers
    of a 32768-wide block (32 warps) spill little there, while fp8's rounding code spilled at 16 warps and, with many
    rows, a CTA that fills an SM's registers alone cannot overlap its load, reduce and store phases (fp8, M = 1024,
    K = 28672: 282 us in one pass, 54 us in two sweeps of 8192). Two sweeps use blocks of 8192 and 16 warps.
    """
    if block_k is None:
        one_pass_max = ONE_PASS_MAX_K if fmt == "int8" and m <= 64 else SWEEP_BLOCK_K * 2
        block_k = triton.next_power_of_2(k) if k <= one_pass_max else SWEEP_BLOCK_K
    one_pass = block_k >= k
    if not one_pass:
        num_warps = 16 if block_k >= SWEEP_BLOCK_K else 8 if block_k >= 4096 else 4
    else:  # fp8's rounding needs more registers: 32 warps keep a 16384 block from spilling
        num_warps = 4 if block_k <= 2048 else 8 if block_k <= 8192 else 16 if block_k <= 16384 and fmt == "int8" else 32
    return block_k, one_pass, num_warps


def quantize_activations(
    x: torch.Tensor,
    fmt: str,
    input_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
    block_k: int | None = None,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp16/bf16/fp32 -> (qa [M, K] int8 | float8_e4m3fn, a_scale fp32 [M]); static when ``input_scale``
    (fp32 [1]) is given, and then the returned scale is ``input_scale`` itself.

    ``pdl``: let the next kernel, launched with programmatic dependent launch (``w8a8_matmul(pdl=True)``), start
    while this one runs (CUDA, sm_90+; not in the interpreter).

    ``out`` / ``out_scale`` may be preallocated (contiguous, right shape and dtype); ``block_k`` overrides the row
    block (a block shorter than K selects the two-sweep path).
    """
    _check(fmt in QMAX_OF_FORMAT, f"fmt must be one of {sorted(QMAX_OF_FORMAT)}, got {fmt!r}")
    _check(x.dim() == 2, f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    _check(x.dtype in _OUT_DTYPES, f"x must be fp16, bf16 or fp32, got {x.dtype}")
    _check(x.numel() <= _MAX_NUMEL, f"x has {x.numel()} elements; 32-bit offsets allow {_MAX_NUMEL}")
    m, k = x.shape
    _check(k > 0, "x has no columns")
    if out is None:
        out = torch.empty(m, k, dtype=DTYPE_OF_FORMAT[fmt], device=x.device)
    _check(
        out.shape == (m, k) and out.dtype == DTYPE_OF_FORMAT[fmt] and out.device == x.device,
        f"out must be {DTYPE_OF_FORMAT[fmt]} {(m, k)} on {x.device}, got {out.dtype} {tuple(out.shape)} {out.device}",
    )
    dynamic = input_scale is None
    if dynamic:
        if out_scale is None:
            out_scale = torch.empty(m, dtype=torch.float32, device=x.device)
        _check(
            out_scale.shape == (m,) and out_scale.dtype == torch.float32 and out_scale.is_contiguous(),
            f"out_scale must be contiguous fp32 [{m}], got {out_scale.dtype} {tuple(out_scale.shape)}",
        )
        scale = out_scale
    else:
        _check(out_scale is None, "out_scale is only for dynamic quantization (input_scale is given)")
        _check(
            input_scale.numel() == 1 and input_scale.dtype == torch.float32 and input_scale.device == x.device,
            f"input_scale must be one fp32 value on {x.device}, got {input_scale.dtype} {tuple(input_scale.shape)}",
        )
        scale = input_scale
    if m == 0:
        return out, scale
    block_k, one_pass, num_warps = _quantize_launch_params(k, block_k, fmt, m)
    _quantize_rows_kernel[(m,)](
        x,
        out,
        scale,
        k,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        QMAX=QMAX_OF_FORMAT[fmt],
        IS_FP8=fmt == "fp8",
        DYNAMIC=dynamic,
        ONE_PASS=one_pass,
        BLOCK_K=block_k,
        PDL=pdl,
        num_warps=num_warps,
    )
    return out, scale


def check_matmul_operands(
    qa: torch.Tensor,
    a_scale: torch.Tensor,
    qw: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """``w8a8_matmul``'s operand checks (shapes, dtypes, strides, devices, sizes, with messages that name the
    operand); returns ``out``, allocated when None."""
    _check(qa.dim() == 2 and qw.dim() == 2, f"qa and qw must be 2-D, got {tuple(qa.shape)} and {tuple(qw.shape)}")
    _check(qa.dtype in FORMAT_OF_DTYPE, f"qa must be int8 or float8_e4m3fn, got {qa.dtype}")
    _check(qw.dtype == qa.dtype, f"qa and qw must share a dtype, got {qa.dtype} and {qw.dtype}")
    m, k = qa.shape
    n = qw.shape[0]
    _check(qw.shape[1] == k, f"qw must be [N, K={k}] (Layout int8/fp8_rowmajor), got {tuple(qw.shape)}")
    _check(qa.stride(1) == 1 and qw.stride(1) == 1, "qa and qw must be contiguous along K (stride 1 in dim 1)")
    _check(k > 0, "K must be positive")
    _check(
        qa.dtype != torch.int8 or k <= INT32_SAFE_K, f"K={k} may overflow the int32 accumulator (limit {INT32_SAFE_K})"
    )
    _check(
        a_scale.dtype == torch.float32 and a_scale.is_contiguous() and a_scale.numel() in (1, m),
        f"a_scale must be contiguous fp32 [{m}] or [1], got {a_scale.dtype} {tuple(a_scale.shape)}",
    )
    _check(
        w_scale.dtype == torch.float32 and w_scale.is_contiguous() and w_scale.shape == (n,),
        f"w_scale must be contiguous fp32 [{n}], got {w_scale.dtype} {tuple(w_scale.shape)}",
    )
    _check(bias is None or (bias.shape == (n,) and bias.is_contiguous()), f"bias must be contiguous [{n}]")
    _check(out_dtype in _OUT_DTYPES, f"out_dtype must be fp16, bf16 or fp32, got {out_dtype}")
    tensors = [qa, qw, a_scale, w_scale] + ([bias] if bias is not None else [])
    _check(all(t.device == qa.device for t in tensors), "all operands must be on one device")
    _check(max(qa.numel(), qw.numel(), m * n) <= _MAX_NUMEL, f"operands exceed {_MAX_NUMEL} elements")
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype, device=qa.device)
    _check(
        out.shape == (m, n) and out.dtype == out_dtype and out.device == qa.device,
        f"out must be {out_dtype} {(m, n)}, got {out.dtype} {tuple(out.shape)}",
    )
    return out


def w8a8_matmul(
    qa: torch.Tensor,
    a_scale: torch.Tensor,
    qw: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float16,
    out: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    fp8_fast_accum: bool = False,
    pdl: bool = False,
    prefetch_k: int = 0,
    l2_ahead: int | None = None,
) -> torch.Tensor:
    """qa [M, K] x qw [N, K] (both int8 or both float8_e4m3fn, K contiguous) -> y [M, N] in ``out_dtype``.

    ``a_scale`` fp32 [M] (per token) or [1] (per tensor); ``w_scale`` fp32 [N]; ``bias`` [N] any float dtype.
    ``config`` overrides the tile config picked from ``CONFIGS`` (keys ``CONFIG_KEYS``); without it, fp8 with
    promoted accumulation at M > 256 runs the warp-specialized Gluon kernel on Hopper (``w8a8_ws``).
    ``fp8_fast_accum``: see the header (ignored for int8). ``pdl``: launch with programmatic dependent launch, so
    that the kernel may start while the one before it (the activation quantizer, ``quantize_activations(pdl=True)``)
    runs, and waits for it before reading ``qa``; meanwhile each program asks L2 for the first ``prefetch_k`` bytes
    (a multiple of 128, a power of two times 128) of its weight rows. CUDA sm_90+ only. ``l2_ahead``: while on K
    tile t, each program asks L2 for its weight's tile t + ``l2_ahead`` (``l2_prefetch.py``; 0: none; None:
    ``l2_ahead_for(m)``; never in the interpreter).
    """
    out = check_matmul_operands(qa, a_scale, qw, w_scale, bias, out_dtype, out)
    m, k = qa.shape
    n = qw.shape[0]
    fmt = FORMAT_OF_DTYPE[qa.dtype]
    _check(
        prefetch_k == 0 or (prefetch_k >= 128 and triton.next_power_of_2(prefetch_k) == prefetch_k and pdl),
        f"prefetch_k must be 0 or 128 x a power of two, with pdl; got {prefetch_k}",
    )
    _check(not pdl or (qa.is_cuda and not interpreting()), "pdl needs a CUDA device (not Triton's interpreter)")
    l2_ahead = l2_ahead_for(m) if l2_ahead is None else l2_ahead
    _check(0 <= l2_ahead <= 8, f"l2_ahead must be in [0, 8], got {l2_ahead}")
    if m == 0 or n == 0:
        return out
    if config is None and ws_offered(m, fmt, fp8_fast_accum, pdl) and ws_unsupported_reason(qa, qw, out) is None:
        return ws_launch(qa, a_scale, qw, w_scale, bias, out)
    cfg = dict(config) if config is not None else pick_config(m, fmt, fp8_fast_accum, n, num_sms(qa.device))
    _check(set(cfg) == set(CONFIG_KEYS), f"config keys must be {CONFIG_KEYS}, got {sorted(cfg)}")
    launch = {"num_warps": cfg.pop("num_warps"), "num_stages": cfg.pop("num_stages")}
    tma_mode = cfg.pop("USE_TMA")
    _check(tma_mode in TMA_MODES, f"USE_TMA must be one of {sorted(TMA_MODES)}, got {tma_mode}")
    use_tma = tma_mode > 0 and tma_compatible(qa, qw)
    if tma_mode >= 2 and not _persistent_fits(cfg, launch["num_stages"], out.element_size(), qa.device):
        tma_mode = 1  # one tile per program: its epilogue reuses the pipeline's shared memory
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    epilogue = (out, a_scale, w_scale, bias if bias is not None else w_scale)  # bias never read without HAS_BIAS
    meta = {
        "A_SCALE_PER_ROW": a_scale.numel() == m,  # for M == 1 both readings are the same value
        "HAS_BIAS": bias is not None,
        "IS_FP8": fmt == "fp8",
        "FP8_FAST_ACCUM": fp8_fast_accum and fmt == "fp8",
        "PDL": pdl,
        "PREFETCH_K": prefetch_k,
        "L2_AHEAD": 0 if interpreting() else l2_ahead,
        "THREADS": threads(launch["num_warps"]),
    }
    if pdl:
        launch["launch_pdl"] = True
    if use_tma:
        a_desc = TensorDescriptor.from_tensor(qa, [cfg["BLOCK_M"], cfg["BLOCK_K"]])
        w_desc = TensorDescriptor.from_tensor(qw, [cfg["BLOCK_N"], cfg["BLOCK_K"]])
        persistent = tma_mode >= 2
        if persistent:
            grid = (min(grid[0], num_sms(qa.device) * (tma_mode - 1)),)
        _w8a8_matmul_tma_kernel[grid](
            a_desc, w_desc, *epilogue, qw, m, n, k, out.stride(0), out.stride(1), qw.stride(0), **meta, **cfg,
            PERSISTENT=persistent, NUM_PROGRAMS=grid[0] if persistent else 1, **launch,
        )  # fmt: skip
    else:
        _w8a8_matmul_kernel[grid](
            qa, qw, *epilogue, m, n, k, qa.stride(0), qa.stride(1), qw.stride(0), qw.stride(1),
            out.stride(0), out.stride(1), EVEN_K=k % cfg["BLOCK_K"] == 0, **meta, **cfg, **launch,
        )  # fmt: skip
    return out


def _persistent_fits(cfg: dict, stages: int, out_bytes: int, device: torch.device) -> bool:
    """Whether the persistent kernel's shared memory fits: its programs keep the next tile's pipeline stages (8-bit
    operand tiles) while the epilogue converts the accumulator's layout through a buffer of the output tile, so an
    fp32 output of 128 x 256 (128 KB beside 144 KB of stages; Triton asks for 278,552 bytes on the H200) does not."""
    if device.type != "cuda":
        return True
    limit = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
    operands = stages * (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"]
    barriers_and_alignment = 1024  # Triton's request exceeded this estimate by 24 bytes in every measured case
    return operands + cfg["BLOCK_M"] * cfg["BLOCK_N"] * out_bytes + barriers_and_alignment <= limit


def w8a8_linear(
    x: torch.Tensor,
    qw: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    fp8_fast_accum: bool = False,
    pdl: bool | None = None,
) -> torch.Tensor:
    """x [..., K] fp16/bf16/fp32 -> y [..., N] in x's dtype: quantize the activations (format of ``qw``), then GEMM.

    ``pdl`` (None: ``use_pdl``'s rule): launch the GEMM with programmatic dependent launch after the quantizer, with
    an L2 prefetch of ``PDL_PREFETCH_K`` bytes of each program's weight rows before it waits for the codes.
    """
    _check(qw.dtype in FORMAT_OF_DTYPE, f"qw must be int8 or float8_e4m3fn, got {qw.dtype}")
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    pdl = use_pdl(x2) if pdl is None else pdl
    qa, a_scale = quantize_activations(x2, FORMAT_OF_DTYPE[qw.dtype], input_scale, pdl=pdl)
    y = w8a8_matmul(
        qa, a_scale, qw, w_scale, bias, out_dtype=x.dtype, config=config, fp8_fast_accum=fp8_fast_accum, pdl=pdl,
        prefetch_k=PDL_PREFETCH_K if pdl else 0,
    )  # fmt: skip
    return y.reshape(*x.shape[:-1], qw.shape[0])


def use_pdl(x: torch.Tensor) -> bool:
    """Programmatic dependent launch on CUDA sm_90+ (never in the interpreter) for M <= PDL_MAX_M rows.

    H200 probes (results/w8a8-pdl-h200-2026-12-02.md, three runs, the plain launch timed first in two and last in
    one): for M <= 64 the quantizer's launch and run overlap the GEMM's start and its first weight lines, +3-4%
    geomean end to end over the six shapes in every run (per cell -11% to +12%). At M = 256 it was 8-15% slower (the
    GEMM's programs then hold the SMs while they wait); the gains first seen at M >= 1024 came from the timing
    order and reversed with it.
    """
    return (
        x.is_cuda
        and x.shape[0] <= PDL_MAX_M
        and not interpreting()
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
    )
