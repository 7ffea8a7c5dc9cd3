"""Activation quantizer of the W8A8 family: x [M, K] -> 8-bit codes and scales, int8 or fp8 e4m3.

``quantize_activations``: one program per row of x [M, K] (fp16/bf16/fp32). Dynamic (per token): the row's abs-max
gives ``a_scale[m] = amax / QMAX`` and ``qa = clamp(round(x * (QMAX / amax)), -QMAX, QMAX)``; short rows are read
once and kept in registers, long ones in two sweeps (``quantize_launch_params``). Static (per tensor): ``qa =
clamp(round(x * (1 / input_scale)))`` with the calibrated fp32 ``input_scale`` [1]. QMAX = 127 for int8 (symmetric,
-128 unused) and 448 for e4m3fn (largest finite). ``amax`` is floored at ``MIN_AMAX`` so that all-zero rows give
zeros, not NaN. Rounding is half-to-even, to the integers (int8) or to the e4m3 grid (fp8), computed explicitly in
fp32 so the GPU and Triton's interpreter agree with ``torch.round`` / ``Tensor.to(torch.float8_e4m3fn)`` bit for bit
(the interpreter's own fp32 -> fp8 cast does not round to nearest even). With ``pdl`` the GEMM launched after it
(programmatic dependent launch) may start at once and waits for the codes itself.

The plain PyTorch references here define the numerics; ``quantize_rows_reference`` also quantizes weights (rows =
output channels) for ``quantkit.nn.W8A8Linear``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from quantkit.kernels._device import round_half_even

INT8_MAX = 127.0
E4M3_MAX = 448.0
MIN_AMAX = 1e-30  # keeps QMAX / amax finite in fp32 for all-zero (or subnormal) rows
ONE_PASS_MAX_K = 32768  # rows up to this length may be quantized from registers after a single read
SWEEP_BLOCK_K = 8192  # the block of the two-sweep path (abs-max sweep, then quantizing sweep) for longer rows
MAX_NUMEL = 2**31 - 1  # 32-bit offsets

FORMAT_OF_DTYPE = {torch.int8: "int8", torch.float8_e4m3fn: "fp8"}
DTYPE_OF_FORMAT = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
QMAX_OF_FORMAT = {"int8": INT8_MAX, "fp8": E4M3_MAX}
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # of x and of the GEMM's output

_MIN_AMAX = tl.constexpr(MIN_AMAX)


def require(cond: bool, msg: str) -> None:
    """Raise ValueError(msg) unless ``cond``: the family's operand checks."""
    if not cond:
        raise ValueError(msg)


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


# ----------------------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def round_to_e4m3_grid(v):
    """Round fp32 with |v| <= 448 to the nearest e4m3fn value (ties to even), still as fp32.

    The spacing of e4m3 values in |v|'s binade is 2**(e - 3) (3 mantissa bits), and 2**-9 below the smallest
    normal 2**-6; scaling by powers of two built from the exponent bits is exact, so only the integer rounding
    rounds. The sign is copied back bitwise so that negatives rounding to zero give -0, as a hardware cast does.
    """
    bits = v.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((127 - e + 3) << 23).to(tl.float32, bitcast=True)
    r = round_half_even(tl.abs(v) * inv_step) * step
    return (r.to(tl.int32, bitcast=True) | (bits & -0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def store_codes(q_ptrs, v, mask, QMAX: tl.constexpr, IS_FP8: tl.constexpr):
    """v fp32 = x * (1 / scale): clamp to [-QMAX, QMAX], round, store as int8 or e4m3."""
    v = tl.minimum(tl.maximum(v, -QMAX), QMAX)
    if IS_FP8:
        tl.store(q_ptrs, round_to_e4m3_grid(v).to(q_ptrs.dtype.element_ty), mask=mask)
    else:
        tl.store(q_ptrs, round_half_even(v).to(tl.int8), mask=mask)


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
        store_codes(q_row + offs * stride_qk, x * inv, mask, QMAX, IS_FP8)
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
            store_codes(q_row + (k0 + offs) * stride_qk, x * inv, mask, QMAX, IS_FP8)


def quantize_launch_params(k: int, block_k: int | None, fmt: str, m: int) -> tuple[int, bool, int]:
    """(block_k, one_pass, num_warps) for rows of length k, from an H200 probe.

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
    require(fmt in QMAX_OF_FORMAT, f"fmt must be one of {sorted(QMAX_OF_FORMAT)}, got {fmt!r}")
    require(x.dim() == 2, f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    require(x.dtype in FLOAT_DTYPES, f"x must be fp16, bf16 or fp32, got {x.dtype}")
    require(x.numel() <= MAX_NUMEL, f"x has {x.numel()} elements; 32-bit offsets allow {MAX_NUMEL}")
    m, k = x.shape
    require(k > 0, "x has no columns")
    if out is None:
        out = torch.empty(m, k, dtype=DTYPE_OF_FORMAT[fmt], device=x.device)
    require(
        out.shape == (m, k) and out.dtype == DTYPE_OF_FORMAT[fmt] and out.device == x.device,
        f"out must be {DTYPE_OF_FORMAT[fmt]} {(m, k)} on {x.device}, got {out.dtype} {tuple(out.shape)} {out.device}",
    )
    dynamic = input_scale is None
    if dynamic:
        if out_scale is None:
            out_scale = torch.empty(m, dtype=torch.float32, device=x.device)
        require(
            out_scale.shape == (m,) and out_scale.dtype == torch.float32 and out_scale.is_contiguous(),
            f"out_scale must be contiguous fp32 [{m}], got {out_scale.dtype} {tuple(out_scale.shape)}",
        )
        scale = out_scale
    else:
        require(out_scale is None, "out_scale is only for dynamic quantization (input_scale is given)")
        require(
            input_scale.numel() == 1 and input_scale.dtype == torch.float32 and input_scale.device == x.device,
            f"input_scale must be one fp32 value on {x.device}, got {input_scale.dtype} {tuple(input_scale.shape)}",
        )
        scale = input_scale
    if m == 0:
        return out, scale
    block_k, one_pass, num_warps = quantize_launch_params(k, block_k, fmt, m)
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
