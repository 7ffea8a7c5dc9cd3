"""Round-to-nearest FP8 (e4m3fn) weight quantization with fp32 scales.

FP8 e4m3 (Micikevicius et al., "FP8 Formats for Deep Learning", arXiv 2209.05433) has 4 exponent bits, 3 mantissa
bits and a largest finite value of 448 (the "fn" variant has no infinities). DeepSeek-V3 (arXiv 2412.19437) made
e4m3 weights and activations with fp32 scales and higher-precision accumulation the standard FP8 inference path; it
scales weights per 128 x 128 block, while this quantizer scales per output channel (or per tensor), which is what
the W8A8 fp8 kernel consumes (per-token x per-channel scales, ``quantkit.kernels.w8a8``).

For W [N, K] and per-channel granularity, with amax_n = max_k |W[n, k]| (floored at ``MIN_AMAX``):

    scale[n] = amax_n / 448,        q[n, k] = e4m3(clamp(W[n, k] * (448 / amax_n), -448, 448))

where e4m3(.) rounds to the nearest representable value, ties to even; ``W ~= q * scale[:, None]``. Per-tensor
granularity uses the abs-max of the whole matrix. Per channel this is exactly ``W8A8Linear.from_float``'s fp8 grid.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
MIN_AMAX = 1e-30  # an all-zero channel gets a tiny positive scale and zero codes, never NaN
GRANULARITIES = ("channel", "tensor")


def quantize_fp8(w: torch.Tensor, granularity: str = "channel") -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q float8_e4m3fn [N, K], scale fp32 [N] per channel or [1] per tensor)."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight [N, K], got shape {tuple(w.shape)}")
    wf = w.float()
    if granularity == "channel":
        amax = wf.abs().amax(dim=1).clamp(min=MIN_AMAX)  # [N]
    else:
        amax = wf.abs().amax().clamp(min=MIN_AMAX).reshape(1)  # [1]
    qmax = torch.full_like(amax, E4M3_MAX)
    scale = amax / qmax  # tensor / tensor: correctly rounded (a scalar operand may go through a reciprocal)
    inv = qmax / amax
    q = (wf * inv.reshape(-1, 1)).clamp(-E4M3_MAX, E4M3_MAX)  # [N, K]
    return q.to(torch.float8_e4m3fn), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q [N, K], scale [N] or [1]) -> W [N, K] = q * scale, computed in fp32."""
    return (q.float() * scale.float().reshape(-1, 1)).to(dtype)
