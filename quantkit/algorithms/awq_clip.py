"""AWQ's clipping search (from the reference implementation of Lin et al., MLSys 2024, arXiv 2306.00978): shrink
each group's quantization range where that lowers the group's share of the layer's output error.

:func:`search_clip` returns the ranges as plain tensors; :func:`clip_weight` applies them to a float weight, so
that a later min-max quantizer (RTN, GPTQ) sees the clipped range.
"""

from __future__ import annotations

import torch

from quantkit.errors import QuantkitError
from quantkit.quant.scheme import QuantScheme
from quantkit.quant.tensor import compute_qparams, grouped, quantize_with_qparams


def clip_ratios(grid: int, min_ratio: float) -> list[float]:
    """The clip search's shrink factors: 1, 1 - 1/grid, ... down to ``min_ratio``."""
    return [1 - i / grid for i in range(int(grid * (1 - min_ratio) + 1e-6) + 1)]


def group_range(w: torch.Tensor, group_size: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The min-max quantizer's range of each group, always holding 0: w [N, K] -> (lo, hi) fp32 [N, n_g]."""
    wg = grouped(w.float(), group_size)  # [N, n_g, G]
    if sym:
        hi = wg.abs().amax(dim=-1)
        return -hi, hi
    return wg.amin(dim=-1).clamp(max=0), wg.amax(dim=-1).clamp(min=0)


@torch.no_grad()
def search_clip(
    w: torch.Tensor,
    x: torch.Tensor,
    scheme: QuantScheme,
    grid: int = 20,
    min_ratio: float = 0.5,
    separate_ends: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output channel and group, the clipping range minimising the error of that group's share of the output.

    ``w`` [N, K], ``x`` [T, K] a sample of the layer's inputs. The range [min, max] of each group (always holding
    0; [-absmax, absmax] when symmetric) is shrunk by r = 1, 1 - 1/grid, ... down to ``min_ratio``; each candidate
    is quantized with the min-max grid of the clipped weights. ``separate_ends`` (asymmetric schemes): then shrink
    the top end alone, then the bottom end alone, from the best common ratio (never worse than it). Returns
    (lo, hi), fp32 [N, n_g].
    """
    n, k = w.shape
    gsize = scheme.group_of(k)
    xg = grouped(x.float(), gsize).permute(1, 2, 0)  # x [T, K] -> [n_g, G, T]
    n_g, _, t = xg.shape
    ratios = clip_ratios(grid, min_ratio)
    rows = max(1, (1 << 24) // max(n_g * t, 1))  # keeps each [n_g, rows, T] product near 64 MB
    lo_out, hi_out = [], []
    for start in range(0, n, rows):
        wb = grouped(w[start : start + rows].float(), gsize)  # [r, n_g, G]
        lo0, hi0 = group_range(w[start : start + rows], gsize, scheme.sym)  # [r, n_g]
        lo, hi = _clip_rows(wb, xg, lo0, hi0, scheme, ratios, separate_ends and not scheme.sym)
        lo_out.append(lo)
        hi_out.append(hi)
    return torch.cat(lo_out), torch.cat(hi_out)


def clipped_fake_quantize(wg: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """Groups wg [..., n_g, G] clamped to [lo, hi] [..., n_g], then RTN on the min-max grid of the clamped values,
    dequantized (fp32, same shape)."""
    wc = torch.maximum(torch.minimum(wg, hi[..., None]), lo[..., None])
    scale, zero = compute_qparams(wc, scheme.bits, scheme.sym)
    scale, zero = scale[..., None], zero[..., None]
    return (quantize_with_qparams(wc, scale, zero, scheme.maxq) - zero) * scale


def _clip_rows(wb, xg, lo0, hi0, scheme: QuantScheme, ratios: list[float], separate_ends: bool):
    """search_clip on a chunk of rows: wb [r, n_g, G], xg [n_g, G, T], full ranges lo0 / hi0 [r, n_g]."""
    ref = torch.matmul(wb.transpose(0, 1), xg)  # [n_g, r, G] @ [n_g, G, T] -> [n_g, r, T]
    best_err = torch.full_like(hi0, float("inf"))
    best_lo, best_hi = lo0.clone(), hi0.clone()

    def consider(lo: torch.Tensor, hi: torch.Tensor) -> None:
        wq = clipped_fake_quantize(wb, lo, hi, scheme)
        err = (torch.matmul(wq.transpose(0, 1), xg) - ref).pow(2).mean(dim=-1).t()  # [n_g, r, T] -> [r, n_g]
        better = err < best_err
        best_err.copy_(torch.where(better, err, best_err))
        best_lo.copy_(torch.where(better, lo, best_lo))
        best_hi.copy_(torch.where(better, hi, best_hi))

    for r in ratios:
        consider(lo0 * r, hi0 * r)
    if separate_ends:
        fixed_lo = best_lo.clone()
        for r in ratios:
            consider(fixed_lo, hi0 * r)
        fixed_hi = best_hi.clone()
        for r in ratios:
            consider(lo0 * r, fixed_hi)
    return best_lo, best_hi


@torch.no_grad()
def clip_weight(w: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, group_size: int) -> None:
    """Clamp w [N, K] in place to its groups' ranges lo, hi [N, n_g] (contiguous groups of ``group_size``, the
    last maybe ragged), so that a later min-max quantizer (RTN, GPTQ) sees the clipped range."""
    n, k = w.shape
    g = k if group_size == -1 else min(group_size, k)
    if lo.shape != (n, -(-k // g)) or hi.shape != lo.shape:
        raise QuantkitError(f"clip ranges of shape {tuple(lo.shape)} do not fit a weight {(n, k)} in groups of {g}")
    g_idx = torch.arange(k, device=w.device) // g
    lo, hi = lo.to(w.device)[:, g_idx], hi.to(w.device)[:, g_idx]
    w.copy_(torch.maximum(torch.minimum(w.float(), hi), lo).to(w.dtype))
