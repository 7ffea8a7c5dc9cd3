"""SmoothQuant: migrate activation outliers into the weights (Xiao et al., ICML 2023, arXiv 2211.10438).

A few input channels of a linear carry activations far larger than the rest, so one int8 step per token (or per
tensor) is coarse for every other channel. For a smoothing group (a producer whose output channels X [T, C] feed
the consumers' weights W [N, K]), SmoothQuant picks per channel (Eq. 4 of the paper)

    s_j = max|X_j|^a / max|W_j|^(1 - a)

where max|W_j| is taken over every consumer's column j, and rewrites X W^T = (X / s) (W * s)^T: the division is
folded into the producer (:mod:`quantkit.models.fold`), the multiplication into the weights. The migration
strength a (alpha) is global (the paper hand-tunes 0.5-0.9 per model) or searched per group on a grid, keeping
the a whose W8A8 output error on calibration samples is smallest (:func:`search_alpha`). The search fakes the
numerics the rtn stage deploys (``W8A8Linear.from_float``), with the reference quantizers of
``quantkit.kernels.w8a8``: 8-bit activations per token (dynamic) or per tensor (static, scale = calibrated
abs-max / QMAX) and 8-bit per-channel abs-max weights, int8 or fp8 e4m3 as the scheme says; for a W4A8 scheme,
per-token activations in its ``act_fmt`` and the weights rounded to its 4-bit grid (``rtn``).

Notation: C producer channels; K consumer input columns (K = C except under grouped-query attention, where
``channel_map`` [K] names the channel behind each column); T tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.algorithms.rtn import rtn
from quantkit.errors import QuantkitError
from quantkit.kernels.w8a8 import quantize_activations_reference, quantize_rows_reference
from quantkit.models.fold import column_scales, to_channels
from quantkit.nn.w8a8 import KERNEL_FORMAT, static_input_scale
from quantkit.quant.scheme import QuantScheme

MIN_SCALE, MAX_SCALE = 1e-5, 1e5  # s outside this range means a degenerate channel, not an outlier to migrate


def weight_absmax(weights: list[torch.Tensor]) -> torch.Tensor:
    """max|W_j| over the rows of every consumer: [N_i, K] each -> fp32 [K]."""
    return torch.stack([w.detach().float().abs().amax(dim=0) for w in weights]).amax(dim=0)


def smoothing_scales(act_absmax: torch.Tensor, w_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = max|X|^a / max|W|^(1-a), fp32 [C]. A channel with no activation or no weight gets s = 1 (there is
    nothing to migrate), and s is clamped to [1e-5, 1e5]."""
    if not 0.0 <= alpha <= 1.0:
        raise QuantkitError(f"alpha must be in [0, 1], got {alpha}")
    a, w = act_absmax.float(), w_absmax.float()
    live = (a > 0) & (w > 0)
    s = a.clamp(min=1e-30).pow(alpha) / w.clamp(min=1e-30).pow(1.0 - alpha)
    return torch.where(live, s, torch.ones_like(s)).clamp(MIN_SCALE, MAX_SCALE)


def outlier_ratio(absmax: torch.Tensor) -> float | None:
    """Largest channel abs-max / median channel abs-max (None when no channel was ever active)."""
    a = absmax.float()
    med = a.median()
    if not bool(a.max() > 0) or not bool(med > 0):
        return None
    return (a.max() / med).item()


@torch.no_grad()
def w8a8_error(
    inputs: list[torch.Tensor],
    weights: list[torch.Tensor],
    s_cols: torch.Tensor,
    scheme: QuantScheme,
    input_absmax: list[torch.Tensor] | None = None,
    reference: list[torch.Tensor] | None = None,
) -> float:
    """Relative squared error sum ||Q(X / s) Q(W * s)^T - X W^T||^2 / sum ||X W^T||^2 over the consumers.

    ``inputs[i]`` x [T_i, K] and ``weights[i]`` W [N_i, K] of consumer i; ``s_cols`` [K]. Static schemes need
    ``input_absmax[i]`` [K], the per-column abs-max of consumer i's input over all calibration tokens (the
    per-tensor scale is max_j(absmax_j / s_j) / QMAX). ``reference`` may pass the float outputs X W^T.
    """
    if scheme.weight_only:
        raise QuantkitError(f"the W8A8 error needs a W8A8 scheme, got {scheme.name}")
    fmt = KERNEL_FORMAT[scheme.act_fmt or scheme.fmt]
    if not scheme.act_dynamic and input_absmax is None:
        raise QuantkitError("static activations need the calibrated input abs-max of every consumer")
    err = norm = 0.0
    s_cols = s_cols.float()
    for i, (x, w) in enumerate(zip(inputs, weights, strict=True)):
        if x.shape[0] == 0:
            continue
        x, w = x.float(), w.float()
        y = reference[i] if reference is not None else x @ w.t()  # [T, N]
        input_scale = None
        if not scheme.act_dynamic:
            input_scale = static_input_scale((input_absmax[i].float() / s_cols).max(), scheme)
        qa, a_scale = quantize_activations_reference(x / s_cols, fmt, input_scale)  # [T, K], [T] or [1]
        xq = qa.float() * a_scale.reshape(-1, 1)
        if scheme.w4a8:  # the 4-bit grid the weight stage rounds to
            wq = rtn(w * s_cols, scheme).dequantize()
        else:
            qw, w_scale = quantize_rows_reference(w * s_cols, fmt)  # [N, K], [N]
            wq = qw.float() * w_scale[:, None]
        err += (xq @ wq.t() - y).pow(2).sum().item()
        norm += y.pow(2).sum().item()
    return err / max(norm, 1e-30)


@dataclass
class AlphaSearch:
    """The chosen alpha of one group, its scales, and the error of every grid point (same order as the grid)."""

    alpha: float
    scales: torch.Tensor  # fp32 [C]
    grid: tuple[float, ...]
    errors: tuple[float, ...]
    error_unsmoothed: float  # s = 1

    @property
    def error(self) -> float:
        return self.errors[self.grid.index(self.alpha)]


@torch.no_grad()
def search_alpha(
    inputs: list[torch.Tensor],
    weights: list[torch.Tensor],
    act_absmax: torch.Tensor,
    grid: tuple[float, ...],
    scheme: QuantScheme,
    channel_map: torch.Tensor | None = None,
    input_absmax: list[torch.Tensor] | None = None,
) -> AlphaSearch:
    """The grid point a minimising :func:`w8a8_error` of s(a) for one group (ties: the first in grid order).

    ``act_absmax`` [C] is the producer channels' abs-max over all calibration tokens; the other arguments are
    those of :func:`w8a8_error`.
    """
    if not grid:
        raise QuantkitError("the alpha grid is empty")
    n_channels = act_absmax.numel()
    w_absmax = to_channels(weight_absmax(weights), channel_map, n_channels)
    reference = [x.float() @ w.float().t() for x, w in zip(inputs, weights, strict=True)]
    cols = torch.ones(inputs[0].shape[1], device=act_absmax.device)
    unsmoothed = w8a8_error(inputs, weights, cols, scheme, input_absmax, reference)
    errors, scales = [], []
    for a in grid:
        s = smoothing_scales(act_absmax, w_absmax, a)
        errors.append(w8a8_error(inputs, weights, column_scales(s, channel_map), scheme, input_absmax, reference))
        scales.append(s)
    best = min(range(len(grid)), key=lambda i: errors[i])
    return AlphaSearch(float(grid[best]), scales[best], tuple(map(float, grid)), tuple(errors), unsmoothed)
