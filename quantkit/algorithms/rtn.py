"""Round-to-nearest (RTN): each group's min-max grid, every weight rounded independently."""

from __future__ import annotations

import torch

from quantkit.quant.scheme import QuantScheme
from quantkit.quant.tensor import GroupGrid, QuantizedWeight, group_index, quantize_with_qparams


def group_qparams(
    w: torch.Tensor, scheme: QuantScheme, mse: bool = False, grid: GroupGrid | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and zeros of contiguous groups: w [N, K] -> (scales [N, n_g], zeros [N, n_g]).

    The last group is shorter when the group size does not divide K. ``grid``: the rule of each group's grid
    (:class:`~quantkit.quant.tensor.GroupGrid`; default: ``scheme``'s for w, ``mse`` searching each group's
    clipping range instead of taking its min-max).
    """
    grid = grid or GroupGrid.for_weight(w, scheme, mse)
    n, k = w.shape
    g = scheme.group_of(k)
    full = k // g
    scales, zeros = [], []
    if full:
        s, z = grid(w[:, : full * g].reshape(n, full, g))  # [N, full]
        scales.append(s)
        zeros.append(z)
    if k % g:
        s, z = grid(w[:, full * g :])  # ragged last group [N]
        scales.append(s[:, None])
        zeros.append(z[:, None])
    return torch.cat(scales, dim=1), torch.cat(zeros, dim=1)


def rtn(w: torch.Tensor, scheme: QuantScheme) -> QuantizedWeight:
    """Quantize w [N, K] to ``scheme`` by rounding to the nearest grid point of its group.

    Progressive schemes: the grid is ``quantize_progressive``'s (same s1, s2, z), but each weight is rounded once, to
    the nearest point of its group's grid, where that function rounds twice (to int8, then to the 4-bit grid) and
    can land one step away (a weight within half an int8 step of a 4-bit midpoint)."""
    w = w.float()
    grid = GroupGrid.for_weight(w, scheme)
    scales, zeros = group_qparams(w, scheme, grid=grid)  # [N, n_g]
    g_idx = group_index(w.shape[1], scheme, device=w.device)
    gi = g_idx.long()
    q = quantize_with_qparams(w, scales[:, gi], zeros[:, gi], scheme.maxq)
    return QuantizedWeight(q.to(torch.uint8), scales, zeros.to(torch.int32), g_idx, scheme, grid.channel_scale)
