"""GPTQ's block kernel against the PyTorch column loop (Triton's interpreter on CPU machines, the GPU on the H200).

The kernel divides correctly rounded and rounds half to even like the reference, but may contract
``w - (q - z) * s`` and the rank-1 updates into fused multiply-adds, so a value can move by an ulp; a code can then
differ where the value sits on a rounding boundary. Codes must agree almost everywhere (>= 99.9%) and the errors
to fp32 precision where the codes agree, and one whole GPTQ call must reach the reference's reconstruction loss.
"""

from __future__ import annotations

import pytest
import torch
from quantkit.kernels.gptq.block import MAX_BLOCK, gptq_block, gptq_block_reference

from quantkit.algorithms import gptq as gptq_module
from quantkit.quant.scheme import QuantScheme
from quantkit.quant.tensor import compute_qparams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def block_inputs(n: int, b: int, bits: int, sym: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    W1 = torch.randn(n, b, generator=g)
    X = torch.randn(4 * b, b, generator=g) * torch.rand(b, generator=g) * 3
    H = X.t() @ X / X.shape[0] + 0.01 * torch.eye(b)
    U1 = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    scale, zero = compute_qparams(W1, bits, sym)  # one grid per row, repeated for each column
    s1, z1 = scale[:, None].expand(n, b).clone(), zero[:, None].expand(n, b).clone()
    return [t.to(DEVICE) for t in (W1, U1, s1, z1)], 2**bits - 1


@pytest.mark.parametrize(
    ("n", "b", "bits", "sym"),
    [(1, 1, 4, False), (7, 5, 4, True), (33, 128, 4, False), (70, 100, 3, True), (5, 256, 2, False)],
)
def test_block_matches_reference(n, b, bits, sym):
    (W1, U1, s1, z1), maxq = block_inputs(n, b, bits, sym)
    before = W1.clone()
    q, e = gptq_block(W1, U1, s1, z1, maxq)
    q_ref, e_ref = gptq_block_reference(W1, U1, s1, z1, maxq)
    assert torch.equal(W1, before)  # the input block is not modified
    same = q == q_ref
    assert same.float().mean() >= 0.999
    assert torch.allclose(e[same], e_ref[same], rtol=1e-4, atol=1e-5)
    assert bool(((q >= 0) & (q <= maxq) & (q == q.round())).all())


def test_block_rejects_bad_operands():
    (W1, U1, s1, z1), maxq = block_inputs(4, 8, 4, False)
    with pytest.raises(ValueError, match="fp32"):
        gptq_block(W1.half(), U1, s1, z1, maxq)
    with pytest.raises(ValueError, match="U1"):
        gptq_block(W1, U1[:4, :4], s1, z1, maxq)
    big = torch.zeros(2, MAX_BLOCK + 1, device=DEVICE)
    with pytest.raises(ValueError, match="at most"):
        gptq_block(big, torch.eye(MAX_BLOCK + 1, device=DEVICE), big, big, maxq)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_with_kernel_reaches_reference_loss(monkeypatch, act_order):
    """A whole GPTQ call with the kernel in its column loop (as on CUDA) against the PyTorch loop."""
    g = torch.Generator().manual_seed(1)
    W = torch.randn(24, 200, generator=g).to(DEVICE)
    X = (torch.randn(800, 200, generator=g) * torch.rand(200, generator=g) * 2).to(DEVICE)
    H = 2 * X.t() @ X / X.shape[0]
    scheme = QuantScheme(bits=4, group_size=64, sym=False)
    monkeypatch.setattr(gptq_module, "block_step", gptq_block_reference)
    ref, ref_info = gptq_module.gptq(W, H, scheme, block_size=48, act_order=act_order)
    monkeypatch.setattr(gptq_module, "block_step", gptq_block)
    qw, info = gptq_module.gptq(W, H, scheme, block_size=48, act_order=act_order)
    assert (qw.q == ref.q).float().mean() >= 0.995
    assert torch.equal(qw.g_idx, ref.g_idx)
    assert info["loss"] == pytest.approx(ref_info["loss"], rel=0.02)
