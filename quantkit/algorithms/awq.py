"""AWQ: activation-aware weight quantization (Lin et al., MLSys 2024, arXiv 2306.00978).

A producer P (a norm or a linear) computes the activations x that enter the consumer linears W. For any positive
per-channel s, ``W x = (W diag(s)) (diag(s)^-1 x)``: dividing P's output channel j by s_j and multiplying column j
of every consumer by s_j leaves the float model unchanged, while channels with large mean |x| get finer relative
quantization steps. The paper searches s = mean|x|^a on a grid of a in [0, 1) for the value that minimises the
error of the block output computed with fake-quantized consumers (Sec. 3.2); its released code also
offers s = mean|x|^a / mean|w|^(1-a) ("duo scaling", the default here). :func:`refine_scales` then lets each
channel's scale leave that one-parameter curve: Adam on log s against the same block error, rounding passed straight
through (:func:`ste_fake_quantize`), kept only when the exact error is lower. A second search from the released
code shrinks each group's clipping range to minimise that group's share of the output error.

Search and apply are separate, as in the reference implementation: :func:`search_scales` and :func:`search_clip`
(in :mod:`quantkit.algorithms.awq_clip`) return plain tensors; :func:`quantkit.models.fold.fold_scales` and
:func:`clip_weight` replay them;
:class:`LayerSearch` holds one decoder layer's results and converts them to and from a flat tensor dict (for
saving and re-applying later).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from quantkit.algorithms.awq_clip import clip_ratios, clip_weight, clipped_fake_quantize, group_range, search_clip
from quantkit.algorithms.gptq import gptq
from quantkit.algorithms.rtn import rtn
from quantkit.errors import QuantkitError
from quantkit.models.fold import column_scales, to_channels
from quantkit.quant.scheme import QuantScheme
from quantkit.quant.tensor import grouped

__all__ = [  # the clip search moved to awq_clip.py; its names stay importable from here
    "BlockObjective",
    "ClippedRTNCandidate",
    "GPTQCandidate",
    "GroupScales",
    "LayerSearch",
    "LinearObjective",
    "ScaleSearch",
    "candidate_loss",
    "candidate_scales",
    "clip_ratios",
    "clip_weight",
    "clipped_fake_quantize",
    "fake_quantize",
    "group_range",
    "refine_scales",
    "rtn_candidate",
    "search_clip",
    "search_scales",
    "ste_fake_quantize",
    "temper_scales",
    "weight_magnitude",
]

SEARCH_FORMAT = "quantkit-awq-search"
SEARCH_VERSION = 1


def fake_quantize(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """RTN on ``scheme``'s grid, dequantized: w [N, K] -> [N, K] (fp32)."""
    return rtn(w, scheme).dequantize(torch.float32)


def ste_fake_quantize(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """:func:`fake_quantize` that gradients pass through: the same values, with every rounding (codes, zero
    points, the fp16 scales) treated as the identity in the backward pass. w [N, K] -> [N, K] (fp32)."""
    k = w.shape[1]
    wg = grouped(w.float(), scheme.group_of(k))  # [N, n_g, G]
    lo = wg.amin(dim=-1, keepdim=True).clamp(max=0)
    hi = wg.amax(dim=-1, keepdim=True).clamp(min=0)
    maxq = scheme.maxq
    scale = 2 * torch.maximum(-lo, hi) / maxq if scheme.sym else (hi - lo) / maxq
    scale = _ste(scale, scale.to(torch.float16).float())
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    if scheme.sym:
        zero = torch.full_like(scale, 2 ** (scheme.bits - 1))
    else:
        zero = _ste(-lo / scale, torch.round(-lo / scale)).clamp(0, maxq)
    q = torch.clamp(_ste(wg / scale, torch.round(wg / scale)) + zero, 0, maxq)
    return ((q - zero) * scale).flatten(1)[:, :k]


def _ste(x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` forward, the gradient of ``x`` backward."""
    return x + (value - x).detach()


def weight_magnitude(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """mean|w| of each input channel, each weight measured relative to its group's max |w|: w [N, K] -> [K]."""
    k = w.shape[1]
    a = grouped(w.float().abs(), group_size)  # [N, n_g, G]
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
    """The best scales of one smoothing group. ``ratio`` is None when no grid candidate beat plain quantization
    (s = 1); ``refined`` when :func:`refine_scales` then moved them. Losses are mean squared block-output errors
    against the float block."""

    scales: torch.Tensor  # fp32 [K]
    ratio: float | None
    loss: float
    loss_rtn: float
    refined: bool = False


class BlockObjective:
    """Mean squared error of a block's output against the float block, with candidate consumer weights in place.

    ``calls`` are the (args, kwargs) of every call of ``block`` on the calibration data. Calling the objective
    with one weight per consumer (None: leave that consumer as it is) runs the block on every call and restores
    the consumers' weights afterwards.
    """

    def __init__(self, block: nn.Module, calls: list[tuple[tuple, dict]], consumers: list[nn.Linear]) -> None:
        self.block, self.calls, self.consumers = block, calls, consumers
        with torch.no_grad():
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

    @property
    def batches(self) -> int:
        return len(self.calls)

    def loss_tensor(self, weights: list[torch.Tensor | None], i: int) -> torch.Tensor:
        """The error on call ``i`` alone as a tensor that gradients flow through to ``weights``."""
        names = {id(m): n for n, m in self.block.named_modules()}
        overrides = {n: p.detach() for n, p in self.block.named_parameters()}  # no gradient for the block's own
        overrides |= {
            (names[id(m)] + ".weight").lstrip("."): w.to(m.weight.dtype)
            for m, w in zip(self.consumers, weights, strict=True)
            if w is not None
        }
        args, kwargs = self.calls[i]
        out = _output(torch.func.functional_call(self.block, overrides, args, kwargs))
        return (out.float() - self.reference[i].float()).pow(2).mean()


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

    batches = 1

    def loss_tensor(self, weights: list[torch.Tensor | None], i: int = 0) -> torch.Tensor:
        (w,) = weights
        d = self.weight - w.float()
        return (torch.matmul(d, self.gram) * d).sum() / max(self.n_tokens * d.shape[0], 1)


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


class ClippedRTNCandidate:
    """RTN after shrinking each group's range to the ratio that minimises the group's output error in the diagonal
    approximation, sum_k E[x_k^2] (w_k - Q(w)_k)^2: scale candidates judged as the clip search will quantize
    them (the clip search itself runs later, on sampled tokens, and sees the exact error).

    ``x_sq`` [K]: mean x^2 of the consumers' unscaled input; ``ratios``: the shrink factors tried (1 included)."""

    def __init__(self, x_sq: torch.Tensor, ratios: list[float]) -> None:
        self.x_sq, self.ratios = x_sq.float(), ratios

    def __call__(self, w: torch.Tensor, scheme: QuantScheme, s: torch.Tensor) -> torch.Tensor:
        k = w.shape[1]
        g = scheme.group_of(k)
        ws = w.float() * s
        wg = grouped(ws, g)  # [N, n_g, G]
        h = grouped((self.x_sq / (s * s))[None], g)[0]  # the scaled input's mean square, [n_g, G]
        lo0, hi0 = group_range(ws, g, scheme.sym)
        best, best_err = None, None
        for r in self.ratios:
            wq = clipped_fake_quantize(wg, lo0 * r, hi0 * r, scheme)
            err = ((wq - wg).pow(2) * h).sum(dim=-1)  # [N, n_g]
            if best is None:
                best, best_err = wq, err
            else:
                better = err < best_err
                best = torch.where(better[..., None], wq, best)
                best_err = torch.minimum(err, best_err)
        return best.flatten(1)[:, :k] / s


def candidate_loss(weights, schemes, objective, s: torch.Tensor, quantize=rtn_candidate) -> float:
    """The objective with every quantized consumer replaced by its candidate for scales ``s``; ``quantize`` is
    one candidate maker for all consumers or a list of one per consumer."""
    makers = quantize if isinstance(quantize, (list, tuple)) else [quantize] * len(weights)
    return objective(
        [
            None if scheme is None else make(w, scheme, s)
            for w, scheme, make in zip(weights, schemes, makers, strict=True)
        ]
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
    quantize=rtn_candidate,
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

    ``quantize`` makes a consumer's candidate (:func:`rtn_candidate`, :class:`ClippedRTNCandidate`; a list: one
    per consumer); ``loss_rtn`` is the identity's loss under that same candidate maker.
    """
    w_mean = weight_magnitude(torch.cat([w.float() for w in weights]), group_size) if duo_scaling else None
    n_channels = x_mean.numel() if channel_map is None else int(channel_map.max()) + 1
    x_ch = to_channels(x_mean.float(), channel_map, n_channels, "mean")
    w_ch = None if w_mean is None else to_channels(w_mean, channel_map, n_channels, "mean")
    ones = torch.ones(x_ch.shape, dtype=torch.float32, device=x_mean.device)
    loss_rtn = candidate_loss(weights, schemes, objective, column_scales(ones, channel_map), quantize)
    best = ScaleSearch(ones, None, loss_rtn, loss_rtn)
    for i in range(grid):
        a = i / grid
        s = candidate_scales(x_ch, w_ch, a)
        loss = candidate_loss(weights, schemes, objective, column_scales(s, channel_map), quantize)
        if math.isfinite(loss) and loss < best.loss:
            best = ScaleSearch(s, a, loss, loss_rtn)
    return best


def refine_scales(
    weights: list[torch.Tensor],
    schemes: list[QuantScheme | None],
    objective,
    found: ScaleSearch,
    steps: int,
    lr: float = 0.01,
    channel_map: torch.Tensor | None = None,
    quantize=rtn_candidate,
    checks: int = 10,
) -> ScaleSearch:
    """Refine the grid's best scales channel by channel: Adam on log s against the same block-output error, the
    rounding passed straight through (:func:`ste_fake_quantize`), one calibration call per step.

    The grid searches one exponent for all channels; this lets each channel move off the curve
    s = mean|x|^a / mean|w|^(1-a). The iterates are judged ``checks`` times (evenly spaced, the last included)
    with the exact objective (every call, real rounding); the best is kept, and the grid's scales unless an
    iterate is lower, so the result is never worse than the grid search.
    """
    best = found
    weights = [w.float() for w in weights]
    log_s = found.scales.float().log().clone().requires_grad_(True)
    opt = torch.optim.Adam([log_s], lr=lr)
    check_every = max(1, steps // checks)
    for step in range(1, steps + 1):
        with torch.enable_grad():
            s = column_scales(log_s.exp(), channel_map)
            candidates = [
                None if scheme is None else ste_fake_quantize(w * s, scheme) / s
                for w, scheme in zip(weights, schemes, strict=True)
            ]
            loss = objective.loss_tensor(candidates, (step - 1) % objective.batches)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        if step % check_every == 0 or step == steps:  # the steps are noisy: judge the iterates exactly now and then
            scales = log_s.detach().exp()
            if not bool(torch.isfinite(scales).all()):
                break
            with torch.no_grad():
                exact = candidate_loss(weights, schemes, objective, column_scales(scales, channel_map), quantize)
            if math.isfinite(exact) and exact < best.loss:
                best = ScaleSearch(scales.clone(), found.ratio, exact, found.loss_rtn, refined=True)
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
