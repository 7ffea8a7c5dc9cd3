"""Round-to-nearest (RTN): each group's min-max grid, every weight rounded independently."""

from __future__ import annotations

import torch

from quantkit.quant.scheme import QuantScheme
from quantkit.quant.tensor import QuantizedWeight, compute_qparams, group_index, quantize_with_qparams, search_qparams


def group_qparams(w: torch.Tensor, scheme: QuantScheme, mse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and zeros of contiguous groups: w [N, K] -> (scales [N, n_g], zeros [N, n_g]).

    The last group is shorter when the group size does not divide K. ``mse``: search each group's clipping range
    (:func:`~quantkit.quant.tensor.search_qparams`) instead of taking its min-max.
    """
    compute = search_qparams if mse else compute_qparams
    n, k = w.shape
    g = scheme.group_of(k)
    full = k // g
    scales, zeros = [], []
    if full:
        s, z = compute(w[:, : full * g].reshape(n, full, g), scheme.bits, scheme.sym)  # [N, full]
        scales.append(s)
        zeros.append(z)
    if k % g:
        s, z = compute(w[:, full * g :], scheme.bits, scheme.sym)  # ragged last group [N]
        scales.append(s[:, None])
        zeros.append(z[:, None])
    return torch.cat(scales, dim=1), torch.cat(zeros, dim=1)


def rtn(w: torch.Tensor, scheme: QuantScheme) -> QuantizedWeight:
    """Quantize w [N, K] to ``scheme`` by rounding to the nearest grid point of its group."""
    w = w.float()
    scales, zeros = group_qparams(w, scheme)  # [N, n_g]
    g_idx = group_index(w.shape[1], scheme, device=w.device)
    gi = g_idx.long()
    q = quantize_with_qparams(w, scales[:, gi], zeros[:, gi], scheme.maxq)
    return QuantizedWeight(q.to(torch.uint8), scales, zeros.to(torch.int32), g_idx, scheme)
