"""Round-to-nearest FP8 (e4m3fn) weight quantization with fp32 scales.

FP8 e4m3 (Micikevicius et al., "FP8 Formats for Deep Learning", arXiv 2209.05433) has 4 exponent bits, 3 mantissa
bits and a largest finite value of 448 (the "fn" variant has no infinities). DeepSeek-V3 (arXiv 2412.19437) made
e4m3 weights and activations with fp32 scales and higher-precision accumulation the standard FP8 inference path. This
quantizer scales per output channel (the per-token x per-channel W8A8 fp8 kernel), per tensor, or per B x B block
(DeepSeek-V3's weights, section 3.3: B = 128; the block GEMM ``quantkit.kernels.w8a8.block`` consumes them).

For W [N, K] and per-channel granularity, with amax_n = max_k |W[n, k]| (floored at ``MIN_AMAX``):

    scale[n] = amax_n / 448,        q[n, k] = e4m3(clamp(W[n, k] * (448 / amax_n), -448, 448))

where e4m3(.) rounds to the nearest representable value, ties to even; ``W ~= q * scale[:, None]``. Per-tensor
granularity uses the abs-max of the whole matrix. Per channel this is exactly ``W8A8Linear.from_float``'s fp8 grid.
Per block, amax is taken over each block W[bB:(b+1)B, cB:(c+1)B] (the last row and column of blocks are shorter when
B does not divide N or K) and ``scale`` is [ceil(N/B), ceil(K/B)]: DeepSeek-V3's ``weight_scale_inv``, which despite
its name multiplies the codes: ``W[n, k] ~= q[n, k] * scale[n // B, k // B]``.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
MIN_AMAX = 1e-30  # an all-zero channel gets a tiny positive scale and zero codes, never NaN
GRANULARITIES = ("channel", "tensor", "block")
DEFAULT_BLOCK = 128  # DeepSeek-V3's weight block (128 x 128) and activation tile (1 x 128)


def quantize_fp8(
    w: torch.Tensor, granularity: str = "channel", block_size: int = DEFAULT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q float8_e4m3fn [N, K], scale fp32 [N] per channel, [1] per tensor, or
    [ceil(N/B), ceil(K/B)] per ``block_size`` x ``block_size`` block)."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight [N, K], got shape {tuple(w.shape)}")
    wf = w.float()
    if granularity == "block":
        return _quantize_blocks(wf, block_size)
    if granularity == "channel":
        amax = wf.abs().amax(dim=1).clamp(min=MIN_AMAX)  # [N]
    else:
        amax = wf.abs().amax().clamp(min=MIN_AMAX).reshape(1)  # [1]
    qmax = torch.full_like(amax, E4M3_MAX)
    scale = amax / qmax  # tensor / tensor: correctly rounded (a scalar operand may go through a reciprocal)
    inv = qmax / amax
    q = (wf * inv.reshape(-1, 1)).clamp(-E4M3_MAX, E4M3_MAX)  # [N, K]
    return q.to(torch.float8_e4m3fn), scale


def _quantize_blocks(wf: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(b, int) or isinstance(b, bool) or b <= 0:
        raise ValueError(f"block_size must be a positive integer, got {b!r}")
    n, k = wf.shape
    nb, kb = -(-n // b), -(-k // b)
    # w [N, K] -> zero-padded [nb, B, kb, B] (a zero never raises an abs-max)
    blocks = torch.nn.functional.pad(wf, (0, kb * b - k, 0, nb * b - n)).view(nb, b, kb, b)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=MIN_AMAX)  # [nb, kb]
    qmax = torch.full_like(amax, E4M3_MAX)
    scale, inv = amax / qmax, qmax / amax
    q = (blocks * inv[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).view(nb * b, kb * b)[:n, :k]
    return q.to(torch.float8_e4m3fn).contiguous(), scale


def expand_blocks(scale: torch.Tensor, n: int, k: int, block_size: int) -> torch.Tensor:
    """Block scales [ceil(N/B), ceil(K/B)] -> one scale per weight [N, K]."""
    b = block_size
    return scale.repeat_interleave(b, 0).repeat_interleave(b, 1)[:n, :k]


def dequantize_fp8(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32, block_size: int | None = None
) -> torch.Tensor:
    """(q [N, K], scale [N] or [1]; with ``block_size``, block scales [ceil(N/B), ceil(K/B)]) -> W [N, K] =
    q * scale, computed in fp32."""
    if block_size is not None:
        return (q.float() * expand_blocks(scale.float(), *q.shape, block_size)).to(dtype)
    return (q.float() * scale.float().reshape(-1, 1)).to(dtype)
