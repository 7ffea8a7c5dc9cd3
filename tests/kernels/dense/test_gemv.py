"""The float decode GEMV (``kernels/gemv.py``) against float64 (interpreter on CPU, GPU on the H200).

Error bound: no worse than 2x PyTorch's own same-dtype ``F.linear`` error on the same operands, plus one unit in
the last place of the output (Triton's interpreter truncates fp32 -> bf16 instead of rounding).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from quantkit.kernels.dense.gemv import MAX_ROWS, gemv, gemv_reference, serves, use_gemv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "n,k,with_bias",
    [(37, 1024, False), (4, 2048, True), (1000, 100, True), (130, 1500, False), (3, 8, True)],  # ragged N and K
)
def test_matches_float64(dtype, n, k, with_bias):
    g = torch.Generator().manual_seed(n * 7 + k)
    x = torch.randn(1, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if with_bias else None
    out = torch.full((1, n), float("nan"), dtype=dtype, device=DEVICE)
    y = gemv(x, w, b, out=out)
    assert y.data_ptr() == out.data_ptr() and torch.isfinite(y).all()
    ref = gemv_reference(x, w, b).double()
    exact = x.double() @ w.double().t() + (b.double() if b is not None else 0)
    torch_err = (F.linear(x, w, b).double() - exact).abs().max().item()
    err = (y.double() - exact).abs()
    ulp = torch.finfo(dtype).eps * exact.abs()
    assert (err <= 2 * torch_err + ulp + 1e-6).all(), f"max error {err.max().item():.3g} vs torch {torch_err:.3g}"
    assert (y.double() - ref).abs().max().item() <= 2 * torch_err + ulp.max().item() + 1e-6


def test_row_stride_and_slices():
    base = torch.randn(64, 520, device=DEVICE).half()
    w = base[:, :512]  # rows 520 apart, K contiguous
    x = torch.randn(1, 512, device=DEVICE).half()
    y = gemv(x, w)
    exact = x.double() @ w.double().t()
    assert (y.double() - exact).abs().max().item() <= 2 * (F.linear(x, w).double() - exact).abs().max().item() + 1e-3


def test_rejects_bad_operands():
    x = torch.randn(1, 64, device=DEVICE).half()
    w = torch.randn(8, 64, device=DEVICE).half()
    with pytest.raises(ValueError, match="one row"):
        gemv(torch.randn(2, 64, device=DEVICE).half(), w)
    with pytest.raises(ValueError, match="share K"):
        gemv(x, torch.randn(8, 32, device=DEVICE).half())
    with pytest.raises(ValueError, match="both be fp16 or both bf16"):
        gemv(x, w.bfloat16())
    with pytest.raises(ValueError, match="bias must be"):
        gemv(x, w, torch.zeros(4, device=DEVICE).half())
    with pytest.raises(ValueError, match="out must be"):
        gemv(x, w, out=torch.empty(1, 8, device=DEVICE))


def test_use_gemv_rule():
    w = torch.empty(16, 64, dtype=torch.bfloat16)
    x = torch.empty(1, 1, 64, dtype=torch.bfloat16)
    assert not use_gemv(x, w)  # CPU tensors: F.linear
    if torch.cuda.is_available():
        xc, wc = x.cuda(), w.cuda()
        assert use_gemv(xc, wc)
        assert not use_gemv(torch.empty(2, 64, dtype=torch.bfloat16, device="cuda"), wc)  # two rows
        assert not use_gemv(xc, wc.half())  # dtypes differ
        assert not use_gemv(xc, torch.empty(MAX_ROWS + 1, 64, dtype=torch.bfloat16, device="cuda"))


def test_the_rule_on_sizes():
    bf16 = torch.bfloat16
    assert serves(1, MAX_ROWS, bf16, bf16, True)
    assert not serves(1, MAX_ROWS + 1, bf16, bf16, True)  # the lm_head stays with cuBLAS
    assert not serves(2, 64, bf16, bf16, True) and not serves(1, 64, bf16, bf16, False)
    assert not serves(1, 64, torch.float32, torch.float32, True) and not serves(1, 64, bf16, torch.float16, True)
