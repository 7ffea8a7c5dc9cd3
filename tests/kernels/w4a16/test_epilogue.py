"""The W4A16 epilogue's cast: fp32 -> bf16 rounded to nearest even by hand where Triton's interpreter truncates."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from quantkit.kernels._device import interpreting
from quantkit.kernels.w4a16.epilogue import to_act

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _cast_kernel(x_ptr, y_ptr, N: tl.constexpr, EMULATE_BF16: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y_ptr + offs, to_act(tl.load(x_ptr + offs), y_ptr.dtype.element_ty, EMULATE_BF16))


@pytest.mark.skipif(DEVICE == "cpu" and not interpreting(), reason="needs CUDA or TRITON_INTERPRET=1")
def test_bf16_rounds_to_nearest_even():
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(256, generator=g) * 100).to(torch.bfloat16).float()
    ulp = (base.to(torch.bfloat16).view(torch.int16) + 1).view(torch.bfloat16).float() - base
    # exact ties (half an ulp: even and odd neighbours both), just below and just above them
    x = torch.cat([base + ulp / 2, base + ulp * 0.49, base + ulp * 0.51, base]).to(DEVICE)
    y = torch.full_like(x, float("nan"), dtype=torch.bfloat16)
    _cast_kernel[(1,)](x, y, N=x.numel(), EMULATE_BF16=interpreting())
    assert torch.equal(y, x.to(torch.bfloat16))
