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


def search_one_factor_at_a_time(w, bits, sym, steps=100, max_shrink=0.8, norm=2.4):
    """The search written plainly: shrink the weights themselves, take min-max grids, keep the first minimum."""
    best = None
    for i in range(round(max_shrink * steps) + 1):
        s, z = compute_qparams(w * (1 - i / steps), bits, sym)
        err = grid_error(w, s, z, bits, norm)
        if best is None:
            best = [err, s, z]
        else:
            better = err < best[0]
            best = [torch.where(better, new, old) for new, old in zip((err, s, z), best, strict=True)]
    return best[1], best[2]


@pytest.mark.parametrize("chunk", [1 << 20, 1000, 1])
@pytest.mark.parametrize("bits, sym", [(4, True), (4, False), (3, False), (2, True)])
def test_same_grids_as_the_plain_search(monkeypatch, chunk, bits, sym):
    """Grids from each group's min and max times the factor, errors in place and factors in chunks (of one
    factor, of a few, of all) choose exactly what shrinking the weights one factor at a time chooses."""
    monkeypatch.setitem(search_qparams.__globals__["SEARCH_CHUNK_ELEMENTS"], "cpu", chunk)
    w = torch.randn(40, 2, 64, generator=torch.Generator().manual_seed(bits)) * 0.02
    w[:, 0, 3] = 0.3  # outliers, so the factors matter
    w[5] = 0.0  # all-zero groups
    w[6, 1] = 0.01  # a constant group: every factor ties
    s, z = search_qparams(w, bits, sym)
    s_ref, z_ref = search_one_factor_at_a_time(w, bits, sym)
    assert torch.equal(s, s_ref) and torch.equal(z, z_ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("chunk", [1 << 24, 1000])
def test_same_grids_on_cuda(monkeypatch, chunk):
    """With the CUDA chunk size (and a small one) the search picks what the plain search picks on the GPU."""
    monkeypatch.setitem(search_qparams.__globals__["SEARCH_CHUNK_ELEMENTS"], "cuda", chunk)
    w = torch.randn(300, 3, 128, generator=torch.Generator().manual_seed(7)) * 0.02
    w[:, 1, 9] = -0.25
    s, z = search_qparams(w.cuda(), 4, False)
    s_ref, z_ref = search_one_factor_at_a_time(w.cuda(), 4, False)
    assert torch.equal(s, s_ref) and torch.equal(z, z_ref)
