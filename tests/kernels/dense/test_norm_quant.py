"""The norm and SiLU kernels fused with W4A8's per-token int8 quantizer (interpreter on CPU, GPU where there is one).

Each fused kernel must give bit for bit what the two launches it replaces give (``add_rms_norm`` or ``silu_mul``,
then ``quantize_activations(y, "int8")``), and so ``quantize_activations_reference`` of the norm or product those
kernels compute. Against the plain PyTorch references (which reduce and round in another order) the codes agree
wherever the unquantized values do: exactly for the norm in fp16 here, to a code of one elsewhere.
"""

from __future__ import annotations

import pytest
import torch
from quantkit.kernels.dense import norm_quant as Q
from quantkit.kernels.dense.norm_rope import add_rms_norm, silu_mul
from quantkit.kernels.w8a8.quant import quantize_activations, quantize_activations_reference, split_workspace

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HALF = [torch.float16, torch.bfloat16]


def assert_same(got: tuple, want: tuple) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def near(qa, a_scale, ref_qa, ref_scale, dtype) -> bool:
    """Codes within one and scales within two ulps of ``dtype`` (the abs-max element rounded once in another order,
    or truncated by the interpreter's bf16 cast) of the references'."""
    codes = bool((qa.int() - ref_qa.int()).abs().max() <= 1)
    return codes and torch.allclose(a_scale, ref_scale, rtol=2 * torch.finfo(dtype).eps, atol=0)


def rows(t: int, n: int, dtype, seed: int, spread: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, n, generator=g) * spread
    x[:, : min(3, n)] *= 20  # outlier channels set the abs-max
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(("t", "n"), [(1, 64), (5, 100), (3, 576), (2, 4096)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_quant_is_the_two_launches(dtype, t, n, with_residual):
    x = rows(t, n, dtype, 1)
    r = rows(t, n, dtype, 2) if with_residual else None
    w = (torch.rand(n, generator=torch.Generator().manual_seed(3)) + 0.5).to(dtype).to(DEVICE)
    qa, a_scale, h = Q.add_rms_norm_quant(x, w, 1e-5, r)
    y, h2 = add_rms_norm(x, w, 1e-5, r)
    assert_same((qa, a_scale, h), (*quantize_activations(y, "int8"), h2))
    assert_same((qa, a_scale), quantize_activations_reference(y, "int8"))
    if r is None:
        assert h is x  # as add_rms_norm: no copy
    ref_qa, ref_scale, ref_h = Q.add_rms_norm_quant_reference(x, w, 1e-5, r)
    assert near(qa, a_scale, ref_qa, ref_scale, dtype)
    if dtype == torch.float16 or DEVICE == "cuda":  # the interpreter's bf16 cast truncates
        assert torch.equal(h, ref_h)


def test_add_rms_norm_quant_matches_the_reference_bit_for_bit_where_the_norms_agree():
    """fp16 (rounded to nearest by the interpreter too): where the kernel's y equals the reference's, the whole
    output is the reference's, bit for bit."""
    x, r = rows(6, 320, torch.float16, 4), rows(6, 320, torch.float16, 5)
    w = (torch.rand(320, generator=torch.Generator().manual_seed(6)) + 0.5).half().to(DEVICE)
    y = add_rms_norm(x, w, 1e-6, r)[0]
    same = (y == add_rms_norm_reference_y(x, w, 1e-6, r)).all(dim=1)
    assert bool(same.any())
    got = Q.add_rms_norm_quant(x, w, 1e-6, r)
    want = Q.add_rms_norm_quant_reference(x, w, 1e-6, r)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a[same], b[same])


def add_rms_norm_reference_y(x, w, eps, r):
    from quantkit.kernels.dense.norm_rope import add_rms_norm_reference

    return add_rms_norm_reference(x, w, eps, r)[0]


@pytest.mark.parametrize("dtype", HALF)
def test_a_zero_row_gives_zero_codes_and_the_floor_scale(dtype):
    x = rows(3, 96, dtype, 7)
    x[1] = 0
    w = torch.ones(96, dtype=dtype, device=DEVICE)
    qa, a_scale, _ = Q.add_rms_norm_quant(x, w, 1e-5)
    assert not bool(qa[1].any()) and a_scale[1].item() == pytest.approx(Q.MIN_AMAX / 127)
    assert_same((qa, a_scale), quantize_activations(add_rms_norm(x, w, 1e-5)[0], "int8"))
    g = rows(3, 96, dtype, 8)
    g[2] = 0
    qa, a_scale = Q.silu_mul_quant(g, rows(3, 96, dtype, 9))
    assert not bool(qa[2].any()) and torch.isfinite(a_scale).all()
    assert_same((qa, a_scale), quantize_activations(silu_mul(g, rows(3, 96, dtype, 9)), "int8"))


def test_add_rms_norm_quant_reads_strided_rows():
    """x and residual as row views of wider buffers (row strides past n)."""
    wide = rows(4, 200, torch.bfloat16, 10)
    x, r = wide[:, :96], rows(4, 160, torch.bfloat16, 11)[:, 32:128]
    w = torch.rand(96, device=DEVICE).to(torch.bfloat16) + 0.5
    qa, a_scale, h = Q.add_rms_norm_quant(x, w, 1e-5, r)
    y, h2 = add_rms_norm(x, w, 1e-5, r)
    assert_same((qa, a_scale, h), (*quantize_activations(y, "int8"), h2))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(("t", "n"), [(1, 96), (5, 100), (3, 3000)])
def test_silu_mul_quant_of_the_gate_up_views_is_the_two_launches(dtype, t, n):
    """g and u as the fused gate/up projection's split: column views of one [T, 2n] tensor, row stride 2n."""
    gate_up = rows(t, 2 * n, dtype, 12, spread=3.0)
    g, u = gate_up.split(n, dim=-1)
    assert g.stride(0) == 2 * n and u.data_ptr() == g.data_ptr() + n * g.element_size()
    got = Q.silu_mul_quant(g, u)
    y = silu_mul(g, u)
    assert_same(got, quantize_activations(y, "int8"))
    assert_same(got, quantize_activations_reference(y, "int8"))
    assert near(*got, *Q.silu_mul_quant_reference(g, u), dtype)


@pytest.mark.parametrize(("block", "split"), [(None, 1), (2048, None), (None, None)],
                         ids=["one-pass", "two-sweeps", "split-rows"])  # fmt: skip
def test_silu_mul_quant_of_a_long_row(block, split):
    """Llama-3-70B's intermediate width (28672): held in one block at one row, swept twice in blocks, or
    split over several programs (the default at few rows); the outlier in the last block sets the scale."""
    n = 28672
    g, u = rows(1, n, torch.bfloat16, 13, spread=2.0), rows(1, n, torch.bfloat16, 14)
    g[0, -5] = 100
    u[0, -5] = 200  # far past the outlier channels' products
    got = Q.silu_mul_quant(g, u, block=block, split=split)
    assert_same(got, quantize_activations(silu_mul(g, u), "int8"))
    assert got[0][0, -5] == 127


@pytest.mark.parametrize("split", [2, 3])
def test_silu_mul_quant_split_over_programs_is_the_two_launches(split):
    """Rows of the gate/up views cut into 2 or 3 programs that share each row's abs-max; the workspace is zeros
    after."""
    gate_up = rows(3, 2 * 1000, torch.bfloat16, 17, spread=3.0)
    g, u = gate_up.split(1000, dim=-1)
    assert_same(Q.silu_mul_quant(g, u, split=split), quantize_activations(silu_mul(g, u), "int8", split=1))
    assert not split_workspace(g.device).any()
    with pytest.raises(ValueError, match="split"):
        Q.silu_mul_quant(g, u, split=2, block=512)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # silu of g < -88 (the interpreter's numpy)
@pytest.mark.parametrize("block", [None, 64])
def test_silu_mul_quant_many_rows_and_blocks(block):
    """Ragged widths over several sweeps (400 = 6 x 64 + 16) and a row count past the one-pass limit's M."""
    g, u = rows(70, 400, torch.float16, 15, spread=2.0), rows(70, 400, torch.float16, 16)
    assert_same(Q.silu_mul_quant(g, u, block=block), quantize_activations(silu_mul(g, u), "int8"))


def test_empty_batches_and_bad_operands():
    w = torch.ones(64, dtype=torch.float16, device=DEVICE)
    qa, a_scale, h = Q.add_rms_norm_quant(torch.empty(0, 64, dtype=torch.float16, device=DEVICE), w, 1e-5)
    assert qa.shape == (0, 64) and a_scale.shape == (0,) and h.shape == (0, 64)
    qa, a_scale = Q.silu_mul_quant(*torch.empty(2, 0, 64, dtype=torch.float16, device=DEVICE))
    assert qa.shape == (0, 64) and a_scale.shape == (0,)
    x = torch.randn(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        Q.add_rms_norm_quant(x, w.float(), 1e-5)
    with pytest.raises(ValueError, match="weight"):
        Q.add_rms_norm_quant(x.half(), w[:7], 1e-5)
    with pytest.raises(ValueError, match="residual"):
        Q.add_rms_norm_quant(x.half(), w, 1e-5, x[:1].half())
    with pytest.raises(ValueError, match="rows of 1 to 16384"):
        Q.add_rms_norm_quant(torch.zeros(1, 16385, dtype=torch.float16, device=DEVICE), torch.ones(16385), 1e-5)
    with pytest.raises(ValueError, match="equal 2-D"):
        Q.silu_mul_quant(x.half(), x[:1].half())
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        Q.silu_mul_quant(x, x)


@pytest.mark.skipif(DEVICE == "cuda", reason="checks the refusal off sm_90 and in the interpreter")
def test_pdl_is_refused_off_cuda():
    x = torch.randn(2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="pdl needs a CUDA device"):
        Q.add_rms_norm_quant(x, torch.ones(64, dtype=torch.float16), 1e-5, pdl=True)
    with pytest.raises(ValueError, match="pdl needs a CUDA device"):
        Q.silu_mul_quant(x, x, pdl=True)
