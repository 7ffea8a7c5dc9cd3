"""AWQ: activation-aware weight quantization (Lin et al., MLSys 2024, arXiv 2306.00978).

A producer P (a norm or a linear) computes the activations x that enter the consumer linears W. For any positive
per-channel s, ``W x = (W diag(s)) (diag(s)^-1 x)``: dividing P's output channel j by s_j and multiplying column j
of every consumer by s_j leaves the float model unchanged, while channels with large mean |x| get finer relative
quantization steps. The paper searches s = mean|x|^a on a grid of a in [0, 1) for the value that minimises the
error of the block output computed with fake-quantized consumers (Sec. 3.2); its released code also
offers s = mean|x|^a / mean|w|^(1-a) ("duo scaling", the default here). A second search from the released code
shrinks each group's clipping range to minimise that group's share of the output error.

Search and apply are separate, as in the reference implementation: :func:`search_scales` and :func:`search_clip`
return plain tensors; :func:`quantkit.models.fold.fold_scales` and :func:`clip_weight` replay them;
:class:`LayerSearch` holds one decoder layer's results and converts them to and from a flat tensor dict (for
saving and re-applying later).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.algorithms.gptq import gptq
from quantkit.algorithms.rtn import rtn
from quantkit.errors import QuantkitError
from quantkit.models.fold import column_scales, to_channels
from quantkit.quant.scheme import QuantScheme
from quantkit.quant.tensor import compute_qparams, quantize_with_qparams

SEARCH_FORMAT = "quantkit-awq-search"
SEARCH_VERSION = 1


def fake_quantize(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """RTN on ``scheme``'s grid, dequantized: w [N, K] -> [N, K] (fp32)."""
    return rtn(w, scheme).dequantize(torch.float32)


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """w [N, K] -> [N, n_g, G], the ragged last group zero-padded (a zero never changes a range that holds 0)."""
    n, k = w.shape
    g = k if group_size == -1 else min(group_size, k)
    n_g = -(-k // g)
    return F.pad(w, (0, n_g * g - k)).view(n, n_g, g)


def weight_magnitude(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """mean|w| of each input channel, each weight measured relative to its group's max |w|: w [N, K] -> [K]."""
    k = w.shape[1]
    a = _grouped(w.float().abs(), group_size)  # [N, n_g, G]
    rel = a / a.amax(dim=-1, keepdim=True).clamp(min=1e-12)
    return rel.flatten(1)[:, :k].mean(dim=0)


def candidate_scales(x_mean: torch.Tensor, w_mean: torch.Tensor | None, a: float) -> torch.Tensor:
    """s = mean|x|^a / mean|w|^(1-a) (activation-only when ``w_mean`` is None), normalised to geometric-mean 1
    of its extremes as in the reference code: [K] -> [K]."""
    s = x_mean.clamp(min=1e-8).pow(a)
    if w_mean is not None:
        s = s / w_mean.clamp(min=1e-8).pow(1 - a)
    s = s.clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def _output(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


@dataclass
class ScaleSearch:
    """The best scales of one smoothing group. ``ratio`` is None when no candidate beat plain quantization
    (s = 1). Losses are mean squared block-output errors against the float block."""

    scales: torch.Tensor  # fp32 [K]
    ratio: float | None
    loss: float
    loss_rtn: float


class BlockObjective:
    """Mean squared error of a block's output against the float block, with candidate consumer weights in place.

    ``calls`` are the (args, kwargs) of every call of ``block`` on the calibration data. Calling the objective
    with one weight per consumer (None: leave that consumer as it is) runs the block on every call and restores
    the consumers' weights afterwards.
    """

    def __init__(self, block: nn.Module, calls: list[tuple[tuple, dict]], consumers: list[nn.Linear]) -> None:
        self.block, self.calls, self.consumers = block, calls, consumers
        self.reference = [_output(block(*args, **kwargs)) for args, kwargs in calls]

    @torch.no_grad()
    def __call__(self, weights: list[torch.Tensor | None]) -> float:
        originals = [m.weight.data for m in self.consumers]
        try:
            for m, w in zip(self.consumers, weights, strict=True):
                if w is not None:
                    m.weight.data = w.to(m.weight.dtype)
            total = torch.zeros((), dtype=torch.float64, device=self.reference[0].device)
            count = 0
            for (args, kwargs), ref in zip(self.calls, self.reference, strict=True):
                total += (_output(self.block(*args, **kwargs)).float() - ref.float()).pow(2).sum().double()
                count += ref.numel()
        finally:
            for m, w in zip(self.consumers, originals, strict=True):
                m.weight.data = w
        return total.item() / max(count, 1)


class LinearObjective:
    """The same error for a block that is a single linear y = x W^T + b, from the Gram matrix G = sum_t x_t^T x_t:
    mean_(t,n) ((x (W - W')^T)_(t,n))^2 = tr(D G D^T) / (T N) with D = W - W'. Exact; cheaper than running the
    linear when K is below the number of calibration tokens T (no token is touched per candidate)."""

    def __init__(self, weight: torch.Tensor, gram: torch.Tensor, n_tokens: int) -> None:
        self.weight, self.gram, self.n_tokens = weight.float(), gram.float(), n_tokens

    @torch.no_grad()
    def __call__(self, weights: list[torch.Tensor | None]) -> float:
        (w,) = weights
        if w is None:
            return 0.0
        d = self.weight - w.float()  # [N, K]
        return (torch.matmul(d, self.gram) * d).sum().double().item() / max(self.n_tokens * d.shape[0], 1)


def rtn_candidate(w: torch.Tensor, scheme: QuantScheme, s: torch.Tensor) -> torch.Tensor:
    """What the folded model computes with RTN: Q(W diag(s)) diag(s)^-1, fp32 [N, K]."""
    return fake_quantize(w.float() * s, scheme) / s


class GPTQCandidate:
    """The same with GPTQ as the quantizer: GPTQ of W diag(s) against the Hessian of its scaled input x / s,
    H_s = diag(s)^-1 H diag(s)^-1 (``hessian`` H = sum x^T x of the unscaled input, [K, K])."""

    def __init__(self, hessian: torch.Tensor, **options) -> None:
        self.hessian, self.options = hessian.float(), options

    def __call__(self, w: torch.Tensor, scheme: QuantScheme, s: torch.Tensor) -> torch.Tensor:
        h = self.hessian / (s[:, None] * s[None, :])
        qw, _ = gptq(w.float() * s, h, scheme, **self.options)
        return qw.dequantize(torch.float32) / s


def candidate_loss(weights, schemes, objective, s: torch.Tensor, quantize=rtn_candidate) -> float:
    """The objective with every quantized consumer replaced by its candidate for scales ``s``."""
    return objective(
        [None if scheme is None else quantize(w, scheme, s) for w, scheme in zip(weights, schemes, strict=True)]
    )


@torch.no_grad()
def search_scales(
    weights: list[torch.Tensor],
    schemes: list[QuantScheme | None],
    x_mean: torch.Tensor,
    objective,
    grid: int = 20,
    duo_scaling: bool = True,
    group_size: int = 128,
    channel_map: torch.Tensor | None = None,
) -> ScaleSearch:
    """Grid search of AWQ scales for the consumers of one producer (paper, Sec. 3.2).

    ``weights`` are the consumers' weights [N_i, K]; ``schemes`` the scheme each will be quantized to (None: it
    stays float, e.g. ignored by the recipe); ``x_mean`` [K] is mean |x| of their input; ``objective`` maps
    candidate weights to the block-output error (:class:`BlockObjective`, :class:`LinearObjective`). For scales s
    a consumer's candidate is Q(W diag(s)) diag(s)^-1: what the folded model computes on the unscaled input.
    The identity (s = 1, plain quantization) is always a candidate, so the result is never worse than RTN.

    ``channel_map`` (grouped-query v_proj -> o_proj): consumer column j reads producer channel map[j]. Statistics
    come per column and are averaged over each channel's columns; one scale per channel is searched and returned
    (the fold can only divide a producer channel once), and every column takes its channel's scale.
    """
    w_mean = weight_magnitude(torch.cat([w.float() for w in weights]), group_size) if duo_scaling else None
    n_channels = x_mean.numel() if channel_map is None else int(channel_map.max()) + 1
    x_ch = to_channels(x_mean.float(), channel_map, n_channels, "mean")
    w_ch = None if w_mean is None else to_channels(w_mean, channel_map, n_channels, "mean")
    ones = torch.ones(x_ch.shape, dtype=torch.float32, device=x_mean.device)
    loss_rtn = candidate_loss(weights, schemes, objective, column_scales(ones, channel_map))
    best = ScaleSearch(ones, None, loss_rtn, loss_rtn)
    for i in range(grid):
        a = i / grid
        s = candidate_scales(x_ch, w_ch, a)
        loss = candidate_loss(weights, schemes, objective, column_scales(s, channel_map))
        if math.isfinite(loss) and loss < best.loss:
            best = ScaleSearch(s, a, loss, loss_rtn)
    return best


@torch.no_grad()
def temper_scales(
    weights: list[torch.Tensor],
    schemes: list[QuantScheme | None],
    objective,
    scales: torch.Tensor,
    quantize,
    powers: tuple[float, ...],
    channel_map: torch.Tensor | None = None,
    margin: float = 0.0,
) -> tuple[torch.Tensor, float, dict[float, float]]:
    """Re-judge scales found for RTN under the quantizer that will really run (GPTQ): try s^p for each power p
    (0: no scaling, 1: the scales as found) and keep the one with the lowest objective.

    GPTQ already spends the Hessian on the salient channels that AWQ's scales protect, so full AWQ scales can
    make GPTQ worse (its act-order sees diag(H) / s^2, its grids a different weight). ``scales`` are per producer
    channel (see :func:`search_scales` for ``channel_map``). ``margin``: the smallest power is kept unless another
    lowers the loss by more than this fraction of its loss. Returns the chosen scales, the power, and the loss of
    every power tried.
    """
    losses: dict[float, float] = {}
    best_p, best_loss = None, float("inf")
    for p in powers:
        loss = candidate_loss(weights, schemes, objective, column_scales(scales.float().pow(p), channel_map), quantize)
        losses[p] = loss
        if math.isfinite(loss) and loss < best_loss:
            best_p, best_loss = p, loss
    if best_p is None:
        raise QuantkitError("awq: every tempered scale candidate gave a non-finite loss")
    low = min(powers)
    if margin and math.isfinite(losses[low]) and best_loss > (1 - margin) * losses[low]:
        best_p = low
    return scales.float().pow(best_p), best_p, losses


def group_range(w: torch.Tensor, group_size: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The min-max quantizer's range of each group, always holding 0: w [N, K] -> (lo, hi) fp32 [N, n_g]."""
    wg = _grouped(w.float(), group_size)  # [N, n_g, G]
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
    xg = _grouped(x.float(), gsize).permute(1, 2, 0)  # x [T, K] -> [n_g, G, T]
    n_g, _, t = xg.shape
    ratios = [1 - i / grid for i in range(int(grid * (1 - min_ratio) + 1e-6) + 1)]
    rows = max(1, (1 << 24) // max(n_g * t, 1))  # keeps each [n_g, rows, T] product near 64 MB
    lo_out, hi_out = [], []
    for start in range(0, n, rows):
        wb = _grouped(w[start : start + rows].float(), gsize)  # [r, n_g, G]
        lo0, hi0 = group_range(w[start : start + rows], gsize, scheme.sym)  # [r, n_g]
        lo, hi = _clip_rows(wb, xg, lo0, hi0, scheme, ratios, separate_ends and not scheme.sym)
        lo_out.append(lo)
        hi_out.append(hi)
    return torch.cat(lo_out), torch.cat(hi_out)


def _clip_rows(wb, xg, lo0, hi0, scheme: QuantScheme, ratios: list[float], separate_ends: bool):
    """search_clip on a chunk of rows: wb [r, n_g, G], xg [n_g, G, T], full ranges lo0 / hi0 [r, n_g]."""
    ref = torch.matmul(wb.transpose(0, 1), xg)  # [n_g, r, G] @ [n_g, G, T] -> [n_g, r, T]
    best_err = torch.full_like(hi0, float("inf"))
    best_lo, best_hi = lo0.clone(), hi0.clone()

    def consider(lo: torch.Tensor, hi: torch.Tensor) -> None:
        wc = torch.maximum(torch.minimum(wb, hi[..., None]), lo[..., None])
        scale, zero = compute_qparams(wc, scheme.bits, scheme.sym)  # [r, n_g]
        wq = (quantize_with_qparams(wc, scale[..., None], zero[..., None], scheme.maxq) - zero[..., None]) * scale[
            ..., None
        ]
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


@dataclass
class GroupScales:
    """Scales found for one smoothing group of one decoder layer (names relative to the layer)."""

    producer: str
    consumers: list[str]
    readers: list[str]  # float modules that read the producer's output too (MoE routers): scaled, not quantized
    producer_rows: str
    scales: torch.Tensor  # fp32 [K]
    ratio: float | None = None
    loss: float | None = None
    loss_rtn: float | None = None


@dataclass
class LayerSearch:
    """One decoder layer's AWQ search: smoothing-group scales in application order, and clip ranges per linear."""

    groups: list[GroupScales] = field(default_factory=list)
    clips: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # name -> lo, hi [N, n_g]

    def to_tensors(self, scheme: QuantScheme) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """A flat tensor dict and string metadata (the safetensors layout)."""
        tensors = {f"scales.{i}": g.scales.float().cpu().contiguous() for i, g in enumerate(self.groups)}
        for name, (lo, hi) in self.clips.items():
            tensors[f"clip_lo.{name}"] = lo.float().cpu().contiguous()
            tensors[f"clip_hi.{name}"] = hi.float().cpu().contiguous()
        groups = [{k: v for k, v in g.__dict__.items() if k != "scales"} for g in self.groups]
        meta = {
            "format": SEARCH_FORMAT,
            "version": str(SEARCH_VERSION),
            "scheme": json.dumps(scheme.to_dict()),
            "groups": json.dumps(groups),
        }
        return tensors, meta

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, str], where: str) -> LayerSearch:
        if meta.get("format") != SEARCH_FORMAT or meta.get("version") != str(SEARCH_VERSION):
            raise QuantkitError(
                f"{where} is not a {SEARCH_FORMAT} file of version {SEARCH_VERSION} "
                f"(found {meta.get('format')!r} version {meta.get('version')!r})"
            )
        groups = [GroupScales(**g, scales=tensors[f"scales.{i}"]) for i, g in enumerate(json.loads(meta["groups"]))]
        clips = {
            name.removeprefix("clip_lo."): (t, tensors["clip_hi." + name.removeprefix("clip_lo.")])
            for name, t in tensors.items()
            if name.startswith("clip_lo.")
        }
        return cls(groups, clips)

    @staticmethod
    def scheme_of(meta: dict[str, str]) -> QuantScheme:
        return QuantScheme.from_dict(json.loads(meta["scheme"]))
