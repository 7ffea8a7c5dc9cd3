"""Clipped grids (quantkit.quant.tensor.search_qparams): never worse than min-max, and they clip outliers."""

import pytest
import torch

from quantkit.quant.tensor import compute_qparams, quantize_with_qparams, search_qparams


def grid_error(w, scale, zero, bits, norm=2.4):
    q = quantize_with_qparams(w, scale[..., None], zero[..., None], 2**bits - 1)
    return ((q - zero[..., None]) * scale[..., None] - w).abs().pow(norm).sum(-1)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("sym", [True, False])
def test_never_worse_than_min_max(bits, sym):
    w = torch.randn(64, 3, 128, generator=torch.Generator().manual_seed(bits))
    w[:, :, 0] *= 8  # one outlier per group
    s0, z0 = compute_qparams(w, bits, sym)
    s, z = search_qparams(w, bits, sym)
    assert s.shape == s0.shape == z.shape
    assert torch.all(grid_error(w, s, z, bits) <= grid_error(w, s0, z0, bits))
    assert torch.equal(s, s.half().float())  # stored precision, like compute_qparams


def test_an_outlier_is_clipped_at_4_bits():
    """A lone large weight stretches a min-max grid; the search clips it a little to refine the grid for the rest."""
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(0)) * 0.01
    w[:, 5] = 0.1
    s0, _ = compute_qparams(w, 4, False)
    s, _ = search_qparams(w, 4, False)
    assert torch.all(s < 0.98 * s0)


def test_all_zero_group_stays_finite():
    s, z = search_qparams(torch.zeros(3, 32), 4, False)
    assert torch.all(s == 1) and torch.all(z == 0)
