"""The runtime's per-layer operations fused with the per-token int8 quantizer of a W4A8 projection that follows them.

A W4A8 layer quantizes its input per token (``w8a8.quant.quantize_activations``) in a launch of its own, right after
the RMSNorm kernel (before q/k/v and gate/up) or the SiLU-gated product (before down): at batch-1 decode three
launches per layer that only read back a row just written. These kernels produce the GEMM's operands directly:

- ``add_rms_norm_quant(x, weight, eps, residual)``: ``norm_rope.add_rms_norm``'s h and y (y rounded to x's dtype,
  same arithmetic and launch shape, so the same reduction), then y quantized per token as
  ``quantize_activations_reference(y, "int8")``: ``amax = max(abs-max(y), MIN_AMAX)``, ``a_scale = amax / 127``,
  ``qa = round_half_even(clamp(y * (127 / amax), -127, 127))``, both divisions correctly rounded. Returns
  (qa int8 [T, n], a_scale fp32 [T], h [T, n]); y itself is never stored. One program per row, rows up to
  ``MAX_HIDDEN`` elements held in registers.
- ``silu_mul_quant(g, u)``: ``norm_rope.silu_mul``'s value (fp32, rounded once to g's dtype) quantized the same way;
  returns (qa, a_scale). g and u may be strided row views (the fused gate/up projection's output split in two). One
  program per row: rows the quantizer reads once (``quantize_launch_params``: up to 32768 int8 elements at M <= 64,
  16384 otherwise) are held in registers, longer ones take two sweeps (abs-max, then quantize), the product
  recomputed in the second. Where the quantizer splits rows (``w8a8.quant.split_rows``: few rows, at least 16384
  wide, no ``pdl``), so does this kernel, on the same workspace and rule. ``silu_quant_pays`` says where the
  runtime fuses.

Outputs are bit for bit those of the two launches they replace (``add_rms_norm`` or ``silu_mul``, then
``quantize_activations(y, "int8")``). ``pdl``: the kernel first lets a GEMM launched after it with programmatic
dependent launch (``w4a8_matmul(pdl=True)``) start; that GEMM waits for these writes itself (CUDA, sm_90+).

Tuned on: nothing (launch-bound sizes; the launch shapes of the kernels they replace). H100, bf16, CUDA graphs, one
row: the norm at 4096 wide 2.53 us against 3.45 us for the two launches; the SiLU gate: ``SILU_QUANT_MAX``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from quantkit.kernels._device import PDL_REFUSED, num_sms, pdl_possible
from quantkit.kernels.dense.norm_rope import (
    MAX_HIDDEN,
    add_rms_norm_reference,
    add_rms_norm_row,
    norm_launch,
    silu_mul_reference,
    silu_mul_row,
)
from quantkit.kernels.w8a8.quant import (
    INT8_MAX,
    MIN_AMAX,
    quantize_activations_reference,
    quantize_launch_params,
    quantize_row_dynamic,
    quantize_split_block,
    split_launch,
    split_phases,
    split_plan,
    split_rows,
    store_codes,
)

# The longest row on which ``silu_mul_quant`` beats ``silu_mul`` + ``quantize_activations`` (the runtime keeps the two
# launches above it). ``benchmarks/bench_quantizer.py``, H100, bf16, CUDA graphs, T = 1 / 16: 14336 (Llama-3-8B) 5.26 /
# 5.36 us against 5.39 / 5.74 us; 28672 (Llama-3-70B) 8.73 / 8.92 us against 7.48 / 7.96 us: one program per row,
# against silu_mul's 2048-wide programs, and no block or warp count of the fused kernel did better (two sweeps of 8192:
# 12.8 us). Not timed alone at prefill's thousands of rows; the runtime's offline workload (prefill chunks included)
# rose from 1.08x to 1.16x bf16 with the fusion on (docs/results/w4a8.md).
SILU_QUANT_MAX = 16384
_MIN_AMAX = tl.constexpr(MIN_AMAX)
_QMAX = tl.constexpr(INT8_MAX)


def add_rms_norm_quant_reference(x, weight, eps: float, residual=None):
    """(qa int8 [T, n], a_scale fp32 [T], h [T, n]): ``add_rms_norm_reference``'s norm, rounded to x's dtype, quantized
    per token by ``quantize_activations_reference``."""
    y, h = add_rms_norm_reference(x, weight, eps, residual)
    qa, a_scale = quantize_activations_reference(y.to(x.dtype), "int8")
    return qa, a_scale, h


def silu_mul_quant_reference(g, u):
    """(qa int8 [T, n], a_scale fp32 [T]) of ``silu_mul_reference(g, u)``."""
    return quantize_activations_reference(silu_mul_reference(g, u), "int8")


def silu_quant_pays(g: torch.Tensor, pdl: bool) -> bool:
    """Whether ``silu_mul_quant`` beats ``silu_mul`` + ``quantize_activations`` for the gate rows g [T, n]: rows up to
    ``SILU_QUANT_MAX``, or rows it splits (H100, bf16, CUDA graphs, 28672 wide without pdl: 4.9 against 6.1 us at
    T = 1, 6.1 against 7.4 us at T = 16, the two launches' quantizer split too)."""
    t, n = g.shape
    return n <= SILU_QUANT_MAX or split_rows(t, n, num_sms(g.device), pdl) > 1


@triton.jit
def _add_rms_norm_quant_kernel(
    x_ptr, r_ptr, w_ptr, q_ptr, scale_ptr, h_ptr, n, stride_x, stride_r, eps,
    HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    if PDL:  # the GEMM that follows may start now: it waits for this grid's writes before reading them
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    y = add_rms_norm_row(x_ptr, r_ptr, w_ptr, h_ptr, row, n, stride_x, stride_r, eps, offs, mask, HAS_RESIDUAL)
    quantize_row_dynamic(q_ptr + row * n + offs, scale_ptr + row, y.to(tl.float32), mask, _QMAX, False)


def _check_pdl(pdl: bool, x: torch.Tensor, name: str) -> None:
    if pdl and not pdl_possible(x):
        raise ValueError(f"{name}: {PDL_REFUSED}")


def add_rms_norm_quant(x, weight, eps: float, residual=None, pdl: bool = False):
    """x [T, n] fp16 / bf16 (and residual [T, n]) -> (qa int8 [T, n], a_scale fp32 [T], h [T, n]) with h = x + residual
    (or x itself) and (qa, a_scale) the per-token int8 codes of ``add_rms_norm``'s y. ``pdl``: see the module doc."""
    if x.dim() != 2 or x.stride(1) != 1 or weight.shape != (x.shape[1],):
        raise ValueError(f"add_rms_norm_quant: x {tuple(x.shape)} (rows contiguous), weight {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1 or residual.dtype != x.dtype):
        raise ValueError(f"add_rms_norm_quant: residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"add_rms_norm_quant: x must be float16 or bfloat16, got {x.dtype}")
    t, n = x.shape
    if not 0 < n <= MAX_HIDDEN:
        raise ValueError(f"add_rms_norm_quant: rows of 1 to {MAX_HIDDEN} elements, got {n}")
    _check_pdl(pdl, x, "add_rms_norm_quant")
    qa = torch.empty((t, n), dtype=torch.int8, device=x.device)
    a_scale = torch.empty(t, dtype=torch.float32, device=x.device)
    h = x if residual is None else torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t:
        block, warps = norm_launch(n)
        _add_rms_norm_quant_kernel[(t,)](
            x, x if residual is None else residual, weight, qa, a_scale, h, n, x.stride(0),
            x.stride(0) if residual is None else residual.stride(0), eps,
            HAS_RESIDUAL=residual is not None, PDL=pdl, BLOCK=block, num_warps=warps,
        )  # fmt: skip
    return qa, a_scale, h


@triton.jit
def _silu_mul_block(g_row, u_row, offs, mask):
    """``silu_mul``'s values at ``offs`` of one row (rounded to g's dtype), as fp32."""
    return silu_mul_row(g_row, u_row, offs, mask).to(tl.float32)


@triton.jit
def _silu_mul_quant_kernel(
    g_ptr, u_ptr, q_ptr, scale_ptr, n, stride_g, stride_u,
    ONE_PASS: tl.constexpr, PDL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    g_row, u_row, q_row = g_ptr + row * stride_g, u_ptr + row * stride_u, q_ptr + row * n
    offs = tl.arange(0, BLOCK)
    if ONE_PASS:  # the whole row in one block
        mask = offs < n
        quantize_row_dynamic(q_row + offs, scale_ptr + row, _silu_mul_block(g_row, u_row, offs, mask), mask, _QMAX,
                             False)  # fmt: skip
    else:  # long rows: abs-max sweep, then a quantizing sweep that computes the product again
        running = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, n, BLOCK):
            mask = k0 + offs < n
            running = tl.maximum(running, tl.abs(_silu_mul_block(g_row, u_row, k0 + offs, mask)))
        amax = tl.maximum(tl.max(running, axis=0), _MIN_AMAX)
        tl.store(scale_ptr + row, tl.math.div_rn(amax, _QMAX))
        inv = tl.math.div_rn(_QMAX, amax)
        for k0 in range(0, n, BLOCK):
            mask = k0 + offs < n
            store_codes(q_row + k0 + offs, _silu_mul_block(g_row, u_row, k0 + offs, mask) * inv, mask, _QMAX, False)


@triton.jit
def _silu_mul_quant_split_kernel(
    g_ptr, u_ptr, q_ptr, scale_ptr, ws_ptr, n, ws_rows, stride_g, stride_u,
    PHASE: tl.constexpr, PDL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Block ``program_id(1)`` of row ``program_id(0)``: the quantizer's split rows (``w8a8.quant``'s module doc)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    y = _silu_mul_block(g_ptr + row * stride_g, u_ptr + row * stride_u, offs, mask)
    quantize_split_block(q_ptr + row * n + offs, scale_ptr + row, y, mask, ws_ptr, ws_rows, row, _QMAX, False, PHASE)


def silu_mul_quant(
    g, u, pdl: bool = False, block: int | None = None, num_warps: int | None = None, split: int | None = None
):
    """g, u [T, n] fp16 / bf16 (rows dense, any row strides) -> (qa int8 [T, n], a_scale fp32 [T]): the per-token int8
    codes of ``silu_mul(g, u)``. ``pdl``: see the module doc. Launch overrides (probes): ``block`` (a power of two;
    one shorter than n selects the two-sweep path) and ``num_warps``; ``split``: programs per row (None:
    ``w8a8.quant.split_rows``'s rule, 1: one; refused with ``block``)."""
    if g.shape != u.shape or g.dim() != 2 or g.stride(1) != 1 or u.stride(1) != 1 or g.dtype != u.dtype:
        raise ValueError(f"silu_mul_quant: g {tuple(g.shape)} and u {tuple(u.shape)} must be equal 2-D, rows dense")
    if g.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"silu_mul_quant: g and u must be float16 or bfloat16, got {g.dtype}")
    t, n = g.shape
    if n == 0:
        raise ValueError("silu_mul_quant: rows have no elements")
    _check_pdl(pdl, g, "silu_mul_quant")
    qa = torch.empty((t, n), dtype=torch.int8, device=g.device)
    a_scale = torch.empty(t, dtype=torch.float32, device=g.device)
    split, ws = split_plan(split, t, n, g.device, block is None, pdl, "silu_mul_quant") if t else (1, None)
    if ws is not None:
        width, programs, warps = split_launch(n, split)
        args = (g, u, qa, a_scale, ws, n, ws.shape[1], g.stride(0), u.stride(0))
        for phase in split_phases():
            _silu_mul_quant_split_kernel[(t, programs)](*args, PHASE=phase, PDL=pdl, BLOCK=width,
                                                        num_warps=num_warps or warps)  # fmt: skip
    elif t:
        block, one_pass, warps = quantize_launch_params(n, block, "int8", t)
        _silu_mul_quant_kernel[(t,)](
            g, u, qa, a_scale, n, g.stride(0), u.stride(0), ONE_PASS=one_pass, PDL=pdl, BLOCK=block,
            num_warps=num_warps or warps,
        )  # fmt: skip
    return qa, a_scale
