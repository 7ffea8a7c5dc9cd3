"""Float GEMV for decode: y = x @ W.T + bias for ONE row of x, fp16 or bf16, W as ``nn.Linear`` stores it.

What it computes
    y[n] = sum_k x[k] * W[n, k] (+ bias[n]), fp32 accumulation, y in x's dtype: the same numbers as
    ``F.linear`` up to summation order. x [1, K], W [N, K] with K contiguous (any row stride), bias [N].

How
    A CTA owns BLOCK_N rows of W and walks K in BLOCK_K steps: each step loads a [BLOCK_N, BLOCK_K] tile (16-byte
    loads along K, every thread 8 consecutive elements of a row) and the matching x slice, and accumulates the
    elementwise products in an fp32 tile; one reduction along K at the end. No split-K: with BLOCK_N = 4 even a
    4096-row weight gives 1024 CTAs, eight per SM.

Why (measured, H200, M = 1, CUDA graphs)
    cuBLAS's one-row products leave bandwidth unused on the decoder's layer shapes (bf16: 2.3 TB/s on 4096x4096,
    2.6 on 6144x4096, 3.2-3.4 on the larger ones, against 4.25 TB/s of copy bandwidth). This kernel, bf16 / fp16:
    6144x4096 1.18x / 1.20x, 4096x4096 1.14x / 1.21x, 28672x4096 1.11x / 1.09x, 14336x4096 1.08x / 1.07x, 8192x8192
    1.02x / 1.12x, 4096x14336 0.97x / 0.98x (1.10x in a first probe); the runtime's bf16 batch-1 decode step went
    from 4.50 to 4.14 ms. On the 128256-row lm_head cuBLAS is at the copy bandwidth already (0.99x), so
    ``use_gemv`` leaves weights of more than ``MAX_ROWS`` rows to it.

Limits: one row of x (decode at batch 1); fp16/bf16 only; int32 offsets (W under 2**31 elements).
Hardware: tuned on the H200 (sm_90); plain loads and FMAs, so any Triton GPU target runs it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 4
BLOCK_K = 1024
NUM_WARPS = 4
MAX_ROWS = 65536  # wider weights (the lm_head) stay with cuBLAS, already at the copy bandwidth there
_DTYPES = (torch.float16, torch.bfloat16)


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain PyTorch in float64: y [1, N] = x [1, K] @ W.T (+ bias), in x's dtype."""
    y = x.double() @ weight.double().t()
    return (y if bias is None else y + bias.double()).to(x.dtype)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    N, K, stride_wn,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)  # rows past N repeat the last one (their output is masked): no load masks
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs + k0, eviction_policy="evict_first")
            x = tl.load(x_ptr + k0 + offs_k)
        else:
            in_k = k0 + offs_k < K
            w = tl.load(w_ptrs + k0, mask=in_k[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptr + k0 + offs_k, mask=in_k, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=offs_n < N)


def serves(rows: int, n: int, dtype: torch.dtype, weight_dtype: torch.dtype, is_cuda: bool) -> bool:
    """``use_gemv``'s rule on sizes alone: one row of fp16/bf16 x on CUDA, W of x's dtype, at most ``MAX_ROWS``
    rows of W (``quantkit.kernels.explain`` asks it for contiguous operands)."""
    return is_cuda and rows == 1 and dtype in _DTYPES and weight_dtype == dtype and n <= MAX_ROWS


def use_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``gemv`` serves this product: ``serves`` for its sizes, x and W contiguous along K."""
    return (
        x.numel() == x.shape[-1]  # one row
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
        and serves(1, weight.shape[0], x.dtype, weight.dtype, x.is_cuda)
    )


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """y [1, N] = x [1, K] @ weight [N, K].T (+ bias [N]) in x's dtype (fp16 or bf16)."""
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"gemv takes one row of x, [1, K]; got {tuple(x.shape)}")
    n, k = weight.shape
    if x.shape[1] != k or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"x [1, {x.shape[1]}] and weight {tuple(weight.shape)} must share K, contiguous along K")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must both be fp16 or both bf16; got {x.dtype} and {weight.dtype}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous [{n}], got {tuple(bias.shape)}")
    if any(t.device != x.device for t in (weight, *([bias] if bias is not None else []))):
        raise ValueError("x, weight and bias must be on one device")
    if weight.numel() >= 2**31:
        raise ValueError(f"weight has {weight.numel()} elements; 32-bit offsets allow < 2**31")
    if out is None:
        out = torch.empty(1, n, device=x.device, dtype=x.dtype)
    if out.shape != (1, n) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {x.dtype} [1, {n}], got {out.dtype} {tuple(out.shape)}")
    if n == 0:
        return out
    _gemv_kernel[(triton.cdiv(n, BLOCK_N),)](
        x, weight, bias if bias is not None else out, out, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % BLOCK_K == 0, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        num_warps=NUM_WARPS, num_stages=1,
    )  # fmt: skip
    return out
