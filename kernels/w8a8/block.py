"""Block-wise fp8 W8A8 GEMM (DeepSeek-V3, arXiv 2412.19437, section 3.3): e4m3 weights with one fp32 scale per
B x B block, e4m3 activations with one fp32 scale per 1 x B tile of each token, computed at run time.

Computes ``y[m, n] = sum_j (sum_{k in tile j} qa[m, k] * qw[n, k]) * a_scale[m, j] * w_scale[n // B, j] (+ bias[n])``
with ``j = k // B``: each B-long partial sum is formed from the codes alone, then scaled by its two scales and added
into a full fp32 accumulator. That is the report's fine-grained quantization and its promotion rule in one step:
Hopper's fp8 tensor cores accumulate with ~14 mantissa bits, so every B = 128 products the partial sum leaves the
tensor core, is multiplied by the scales on the CUDA cores and joins the fp32 sum (DeepGEMM's approach). The
promotion interval is B for every M, small M included.

How
    ``quantize_tiles``: x [M, K] viewed as [M * ceil(K/B), B] rows and quantized by the family's row quantizer
    (``quant.quantize_activations``, fp8, dynamic): a_scale [M, ceil(K/B)] = tile abs-max / 448. The GEMM tiles the
    output in BLOCK_M x BLOCK_N and walks K in steps of BLOCK_K = B, one scale pair per step; ragged M, N, K are
    masked (a short last tile's padding is zero in both operands).

Layouts: ``qw`` float8_e4m3fn [N, K] row-major, K contiguous; ``w_scale`` fp32 [ceil(N/B), ceil(K/B)] (DeepSeek-V3's
``weight_scale_inv``; ``Layout.FP8_BLOCK`` v1); ``qa`` [M, K] K contiguous; ``a_scale`` fp32 [M, ceil(K/B)] row-major.

Limits: B a power of two from 16 to 512; 2-D operands under 2**31 elements. Hardware: written for sm_89/sm_90 (fp8
tensor cores); its tile configs are untuned first choices. Off CUDA the reference below is the module's CPU path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from quantkit.kernels.w8a8.quant import (
    E4M3_MAX,
    FLOAT_DTYPES,
    MAX_NUMEL,
    quantize_activations,
    quantize_rows_reference,
    require,
)

BLOCK_SIZES = (16, 32, 64, 128, 256, 512)


# ----------------------------------------------------------------------------------------------------------------
# Reference (plain PyTorch): defines the numerics the kernel reproduces.
# ----------------------------------------------------------------------------------------------------------------


def _tiles(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [M, K] -> [M * ceil(K/B), B], the last tile of each row zero-padded (a zero never raises an abs-max)."""
    m, k = x.shape
    kb = -(-k // block)
    if k % block:
        x = F.pad(x, (0, kb * block - k))
    return x.reshape(m * kb, block)


def quantize_tiles_reference(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (qa float8_e4m3fn [M, K], a_scale fp32 [M, ceil(K/B)]): per 1 x B tile, scale = abs-max / 448."""
    m, k = x.shape
    q, s = quantize_rows_reference(_tiles(x, block), "fp8")
    return q.view(m, -1)[:, :k].contiguous(), s.view(m, -1)


def fp8_block_matmul_reference(
    qa: torch.Tensor,
    a_scale: torch.Tensor,
    qw: torch.Tensor,
    w_scale: torch.Tensor,
    block: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float16,
) -> torch.Tensor:
    """y [M, N]: each B-long partial product of the codes in fp32, scaled by a_scale[m, j] * w_scale[n // B, j] and
    summed in fp32, tile by tile (the kernel's order), then the bias and ``out_dtype``."""
    m, k = qa.shape
    n = qw.shape[0]
    acc = torch.zeros(m, n, dtype=torch.float32, device=qa.device)
    w_cols = w_scale.float().repeat_interleave(block, 0)[:n]  # [N, ceil(K/B)]: each output row's block scales
    for j, k0 in enumerate(range(0, k, block)):
        part = qa[:, k0 : k0 + block].float() @ qw[:, k0 : k0 + block].float().t()  # [M, N]
        acc += part * a_scale[:, j : j + 1].float() * w_cols[:, j][None, :]
    if bias is not None:
        acc += bias.float()
    return acc.to(out_dtype)


# ----------------------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _fp8_block_matmul_kernel(
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
    stride_wn,
    stride_cm,
    stride_cn,
    stride_asm,
    stride_wsn,
    # meta-parameters
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # = the quantization block B
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows_m = offs_m % M  # rows past M / N wrap onto valid rows: loads need no M/N mask, the store drops them
    rows_n = offs_n % N
    a_ptrs = a_ptr + rows_m[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + offs_k[:, None] + rows_n[None, :] * stride_wn  # [BLOCK_K, BLOCK_N]
    a_scale_ptrs = a_scale_ptr + rows_m * stride_asm  # [BLOCK_M]: tile j of each row at + j
    w_scale_ptrs = w_scale_ptr + (rows_n // BLOCK_K) * stride_wsn  # [BLOCK_N]: block (n // B, j) at + j
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for j in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            a = tl.load(a_ptrs, mask=(j * BLOCK_K + offs_k)[None, :] < K, other=0.0)
            w = tl.load(w_ptrs, mask=(j * BLOCK_K + offs_k)[:, None] < K, other=0.0)
        part = tl.dot(a, w)  # one B-long partial sum in the tensor core, then promoted with its scales
        a_s = tl.load(a_scale_ptrs + j)
        w_s = tl.load(w_scale_ptrs + j)
        acc += part * a_s[:, None] * w_s[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    mask_m = offs_m < M
    mask_n = offs_n < N
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def tile_config(m: int) -> dict[str, int]:
    """BLOCK_M, BLOCK_N, num_warps, num_stages for M rows (first choices, not tuned)."""
    if m <= 16:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 4}
    if m <= 64:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 4}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}


def quantize_tiles(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_tiles_reference`` on x's device by the family's row quantizer: (qa [M, K], a_scale [M, ceil(K/B)])."""
    require(x.dim() == 2 and x.dtype in FLOAT_DTYPES, f"x must be 2-D fp16/bf16/fp32, got {x.dtype} {tuple(x.shape)}")
    m, k = x.shape
    qa, a_scale = quantize_activations(_tiles(x.contiguous(), block), "fp8")
    qa = qa.view(m, -1)
    return (qa if qa.shape[1] == k else qa[:, :k].contiguous()), a_scale.view(m, -1)


def fp8_block_matmul(
    qa: torch.Tensor,
    a_scale: torch.Tensor,
    qw: torch.Tensor,
    w_scale: torch.Tensor,
    block: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float16,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """The block GEMM on quantized operands: y [M, N] in ``out_dtype`` (``config``: tile_config's keys)."""
    require(block in BLOCK_SIZES, f"block must be one of {BLOCK_SIZES}, got {block}")
    require(qa.dim() == 2 and qw.dim() == 2, f"qa and qw must be 2-D, got {tuple(qa.shape)} and {tuple(qw.shape)}")
    require(qa.dtype == qw.dtype == torch.float8_e4m3fn, f"qa and qw must be float8_e4m3fn, got {qa.dtype}, {qw.dtype}")
    m, k = qa.shape
    n = qw.shape[0]
    kb = -(-k // block)
    require(qw.shape[1] == k, f"qw must be [N, K={k}], got {tuple(qw.shape)}")
    require(qa.stride(1) == 1 and qw.stride(1) == 1, "qa and qw must be contiguous along K")
    require(
        a_scale.dtype == torch.float32 and a_scale.shape == (m, kb) and a_scale.stride(1) == 1,
        f"a_scale must be fp32 [{m}, {kb}], got {a_scale.dtype} {tuple(a_scale.shape)}",
    )
    require(
        w_scale.dtype == torch.float32 and w_scale.shape == (-(-n // block), kb) and w_scale.stride(1) == 1,
        f"w_scale must be fp32 [{-(-n // block)}, {kb}], got {w_scale.dtype} {tuple(w_scale.shape)}",
    )
    require(bias is None or (bias.shape == (n,) and bias.is_contiguous()), f"bias must be contiguous [{n}]")
    require(out_dtype in FLOAT_DTYPES, f"out_dtype must be fp16, bf16 or fp32, got {out_dtype}")
    require(max(qa.numel(), qw.numel(), m * n) <= MAX_NUMEL, f"operands exceed {MAX_NUMEL} elements")
    out = torch.empty(m, n, dtype=out_dtype, device=qa.device)
    if m == 0:
        return out
    cfg = {**tile_config(m), **(config or {})}
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    _fp8_block_matmul_kernel[grid](
        qa, qw, out, a_scale, w_scale, bias if bias is not None else w_scale,
        m, n, k, qa.stride(0), qw.stride(0), out.stride(0), out.stride(1), a_scale.stride(0), w_scale.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % block == 0, BLOCK_K=block, **cfg,
    )  # fmt: skip
    return out


def fp8_block_linear(
    x: torch.Tensor, qw: torch.Tensor, w_scale: torch.Tensor, block: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] -> y [..., N] in x's dtype: quantize x per 1 x B tile, then the block GEMM."""
    x2 = x.reshape(-1, x.shape[-1])
    qa, a_scale = quantize_tiles(x2, block)
    y = fp8_block_matmul(qa, a_scale, qw, w_scale, block, bias, out_dtype=x.dtype)
    return y.reshape(*x.shape[:-1], qw.shape[0])


__all__ = [
    "BLOCK_SIZES",
    "E4M3_MAX",
    "fp8_block_linear",
    "fp8_block_matmul",
    "fp8_block_matmul_reference",
    "quantize_tiles",
    "quantize_tiles_reference",
    "tile_config",
]
