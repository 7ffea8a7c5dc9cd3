"""GPTQ's inner loop: quantize one block of columns, column by column, feeding each column's error forward.

For a block of B columns of the weight (W1 [N, B], processing order), the upper Cholesky factor of the inverse
Hessian restricted to the block (U1 [B, B]) and each column's grid (s1, z1 [N, B]: the scale and integer zero of
the group the column belongs to), for i = 0 .. B-1:

    q[:, i]  = clamp(round(W1[:, i] / s1[:, i]) + z1[:, i], 0, maxq)
    E1[:, i] = (W1[:, i] - (q[:, i] - z1[:, i]) * s1[:, i]) / U1[i, i]
    W1[:, j] -= E1[:, i] * U1[i, j]            for j > i

(Frantar et al., GPTQ, Algorithm 1, the inner "for j" loop.) The caller applies E1 to the later columns with
one matrix product. Rows are independent, so one program takes BLOCK_N rows and keeps their [BLOCK_N, B] slice
of W1 in registers for the whole loop: one launch per block instead of ~10 small launches per column, which made
the PyTorch loop launch-bound on GPUs (~250 us per column on the H200 host).

Numerics: fp32 throughout; ``W1 / s1`` divides correctly rounded (``div_rn``) and rounds half to even, like
``torch.div`` and ``torch.round``, so codes agree with the reference except where fused multiply-adds move a
value across a rounding boundary by one ulp. Limits: B <= 256 (the block is held in registers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from quantkit.kernels._device import round_half_even

MAX_BLOCK = 256


def gptq_block_reference(
    W1: torch.Tensor, U1: torch.Tensor, s1: torch.Tensor, z1: torch.Tensor, maxq: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [N, B] as fp32, scaled errors E1 [N, B]); W1 is left unchanged."""
    W1 = W1.clone()
    Q1 = torch.empty_like(W1)
    E1 = torch.empty_like(W1)
    for i in range(W1.shape[1]):  # in-place ops with out=: few allocations per column
        w, q, s, z = W1[:, i], Q1[:, i], s1[:, i], z1[:, i]
        torch.div(w, s, out=q).round_().add_(z).clamp_(0, maxq)
        err = torch.sub(w, (q - z).mul_(s), out=E1[:, i]).div_(U1[i, i])
        W1[:, i:].addr_(err, U1[i, i:], alpha=-1)
    return Q1, E1


@triton.jit
def _gptq_block_kernel(
    w_ptr,
    u_ptr,
    s_ptr,
    z_ptr,
    q_ptr,
    e_ptr,
    N,
    B,
    stride_n,  # row stride of W1, s1, z1, Q1, E1 (all [N, B] contiguous)
    stride_u,
    maxq,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_B)
    rmask = rows < N
    cmask = cols < B
    offs = rows[:, None].to(tl.int64) * stride_n + cols[None, :]
    w = tl.load(w_ptr + offs, mask=rmask[:, None] & cmask[None, :], other=0.0)  # [BLOCK_N, BLOCK_B]
    row_offs = rows.to(tl.int64) * stride_n
    for i in range(B):
        wi = tl.sum(tl.where(cols[None, :] == i, w, 0.0), axis=1)  # column i, with every earlier update
        s = tl.load(s_ptr + row_offs + i, mask=rmask, other=1.0)
        z = tl.load(z_ptr + row_offs + i, mask=rmask, other=0.0)
        q = tl.minimum(tl.maximum(round_half_even(tl.math.div_rn(wi, s)) + z, 0.0), maxq)
        u_ii = tl.load(u_ptr + i * stride_u + i)
        err = tl.math.div_rn(wi - (q - z) * s, u_ii)
        tl.store(q_ptr + row_offs + i, q, mask=rmask)
        tl.store(e_ptr + row_offs + i, err, mask=rmask)
        u = tl.load(u_ptr + i * stride_u + cols, mask=cmask & (cols > i), other=0.0)  # [BLOCK_B]
        w -= err[:, None] * u[None, :]


def gptq_block(
    W1: torch.Tensor, U1: torch.Tensor, s1: torch.Tensor, z1: torch.Tensor, maxq: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton version of :func:`gptq_block_reference` (same arguments and results; W1 is not modified)."""
    N, B = W1.shape
    if B > MAX_BLOCK:
        raise ValueError(f"gptq_block: blocks of at most {MAX_BLOCK} columns, got {B}")
    if U1.shape != (B, B) or s1.shape != (N, B) or z1.shape != (N, B):
        raise ValueError(
            f"gptq_block: W1 {tuple(W1.shape)}, U1 {tuple(U1.shape)}, s1 {tuple(s1.shape)}, z1 {tuple(z1.shape)}"
        )
    if any(t.dtype != torch.float32 for t in (W1, U1, s1, z1)):
        raise ValueError("gptq_block: every operand must be fp32")
    W1, s1, z1, U1 = (t.contiguous() for t in (W1, s1, z1, U1))
    Q1 = torch.empty_like(W1)
    E1 = torch.empty_like(W1)
    if N == 0 or B == 0:
        return Q1, E1
    block_b = triton.next_power_of_2(B)
    block_n = max(1, min(64, 4096 // block_b))  # ~4k fp32 registers of W1 per program
    grid = (triton.cdiv(N, block_n),)
    _gptq_block_kernel[grid](
        W1, U1, s1, z1, Q1, E1, N, B, B, U1.stride(0), float(maxq), BLOCK_N=block_n, BLOCK_B=block_b
    )
    return Q1, E1
