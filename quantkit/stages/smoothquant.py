"""The smoothquant recipe stage (registers method "smoothquant"): smooth every smoothing group of a layer.

A "transform" stage: it rewrites float weights (the division folded into the producer, the multiplication into
the consumers) and leaves quantization to the weight stage after it (``rtn`` = SmoothQuant W8A8, ``gptq`` = W8A8
GPTQ on the smoothed weights). One forward pass of the layer collects, for every consumer, the per-column input
abs-max over all calibration tokens and (for the alpha search) a random sample of input rows. Smoothing keeps the
float function, so the statistics of all groups come from that one pass.

Per group the report (``quant_report.json``, under the producer's name) holds ``smoothquant``: the consumers,
the alpha used, and the activation outlier ratio (largest / median channel abs-max) before and after; with the
search, the W8A8 error of every grid point and of no smoothing. ``quantkit.checkpoint.smoothing`` reads it back
as a table.
Groups with a consumer that the stage's targets / ignore do not select are left alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from quantkit.algorithms.smoothquant import (
    outlier_ratio,
    search_alpha,
    smoothing_scales,
    weight_absmax,
)
from quantkit.calib.runner import LayerContext
from quantkit.calib.stats import StatsCollector
from quantkit.errors import QuantkitError
from quantkit.models.fold import BoundGroup, bind_smooth_groups, column_scales, fold_group, to_channels
from quantkit.nn.factory import quantized_module_types
from quantkit.quant.scheme import QuantScheme
from quantkit.stages import register
from quantkit.stages.spec import Stage

DEFAULT_GRID = tuple(round(0.3 + 0.05 * i, 2) for i in range(13))  # 0.30, 0.35, ..., 0.90
PRODUCERS = ("all", "norms")


@dataclass(frozen=True)
class SmoothQuantParams:
    """- ``alpha``: migration strength used for every group when not searching (None: the paper's 0.5).
    - ``alpha_search``: per group, the grid point with the smallest W8A8 output error on calibration samples.
      None (default): search unless ``alpha`` is given. Searching gave 30% less KL than alpha 0.5 on SmolLM2-135M
      (two held-out texts) for twice SmoothQuant's time, which is small beside any weight stage's.
    - ``alpha_grid``: the candidates, each in [0, 1].
    - ``search_tokens``: input rows sampled per consumer for the search (the abs-max always uses every token).
    - ``producers``: ``"all"`` smoothing groups of the architecture table, or ``"norms"``: only groups fed by a
      norm (q/k/v and gate/up or fc1), the paper's choice.
    """

    alpha: float | None = None
    alpha_search: bool | None = None
    alpha_grid: tuple[float, ...] = DEFAULT_GRID
    search_tokens: int = 2048
    producers: str = "all"

    def __post_init__(self) -> None:
        alpha = self.alpha
        if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 <= alpha <= 1):
            raise QuantkitError(f"smoothquant alpha must be a number in [0, 1], got {alpha!r}")
        if self.alpha_search is not None and not isinstance(self.alpha_search, bool):
            raise QuantkitError(f"smoothquant alpha_search must be true or false, got {self.alpha_search!r}")
        grid = self.alpha_grid
        if not isinstance(grid, list | tuple) or not grid:
            raise QuantkitError(f"smoothquant alpha_grid must be a non-empty list of numbers, got {grid!r}")
        if any(isinstance(a, bool) or not isinstance(a, int | float) or not 0 <= a <= 1 for a in grid):
            raise QuantkitError(f"smoothquant alpha_grid values must be numbers in [0, 1], got {list(grid)}")
        if alpha is not None:
            object.__setattr__(self, "alpha", float(alpha))
        object.__setattr__(self, "alpha_grid", tuple(float(a) for a in grid))
        if isinstance(self.search_tokens, bool) or not isinstance(self.search_tokens, int) or self.search_tokens < 1:
            raise QuantkitError(f"smoothquant search_tokens must be a positive integer, got {self.search_tokens!r}")
        if self.producers not in PRODUCERS:
            raise QuantkitError(f"smoothquant producers must be one of {PRODUCERS}, got {self.producers!r}")

    @property
    def search(self) -> bool:
        """Whether alpha is searched per group: as asked, else when no alpha was given."""
        return self.alpha is None if self.alpha_search is None else self.alpha_search

    @property
    def fixed_alpha(self) -> float:
        return 0.5 if self.alpha is None else self.alpha


class _InputSampler:
    """Forward pre-hooks keeping a random ``fraction`` of the input rows of each call of each module."""

    def __init__(self, modules: dict[str, nn.Module], fraction: float, seed: int) -> None:
        self.modules = modules
        self.fraction = fraction
        self.gen = torch.Generator().manual_seed(seed)
        self.rows: dict[str, list[torch.Tensor]] = {n: [] for n in modules}
        self._handles = []

    def _hook(self, name: str):
        def hook(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1])
            n = x.shape[0]
            k = max(1, round(n * self.fraction)) if self.fraction < 1 else n
            idx = torch.randperm(n, generator=self.gen)[:k].to(x.device)
            self.rows[name].append(x[idx].float())

        return hook

    def __enter__(self) -> _InputSampler:
        self._handles = [m.register_forward_pre_hook(self._hook(n)) for n, m in self.modules.items()]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()

    def samples(self, name: str, limit: int, k: int, device) -> torch.Tensor:
        rows = self.rows[name]
        return torch.cat(rows)[:limit] if rows else torch.zeros(0, k, device=device)


@register("smoothquant")
class SmoothQuantStage:
    kind = "transform"
    Params = SmoothQuantParams

    def __init__(self, stage: Stage) -> None:
        self.stage = stage
        self.params: SmoothQuantParams = stage.params if stage.params is not None else SmoothQuantParams()
        scheme = stage.scheme
        # what the search fakes: the stage's W8A8 scheme, or int8 with per-token activations when it has none
        if scheme is not None and not scheme.weight_only:
            self.search_scheme = scheme
        else:
            self.search_scheme = QuantScheme(bits=8, group_size=-1, sym=True, act_bits=8, act_dynamic=True)

    @classmethod
    def needs_calibration(cls, stage: Stage) -> bool:
        return True

    def _groups(self, ctx: LayerContext) -> list[BoundGroup]:
        quantized = [n for n, m in ctx.layer.named_modules() if isinstance(m, quantized_module_types())]
        if quantized:
            raise QuantkitError(
                f"{ctx.full_name(quantized[0])} is already quantized: put smoothquant before the weight stage"
            )
        out = []
        for g in bind_smooth_groups(ctx.layer, ctx.arch):
            if self.params.producers == "norms" and isinstance(ctx.layer.get_submodule(g.producer), nn.Linear):
                continue
            if all(self.stage.selects(ctx.full_name(c), ctx.layer.get_submodule(c)) for c in g.consumers):
                out.append(g)
        return out

    def apply(self, ctx: LayerContext) -> None:
        if not ctx.has_data:
            raise QuantkitError("smoothquant needs calibration data")
        groups = self._groups(ctx)
        consumers = {c: ctx.layer.get_submodule(c) for g in groups for c in g.consumers}
        if not consumers:
            return
        total = sum(h.shape[0] * h.shape[1] for h in ctx.hidden)
        p = self.params
        fraction = min(1.0, p.search_tokens / max(total, 1)) if p.search else 0.0
        with (
            StatsCollector(consumers, hessian=False) as stats,
            _InputSampler(consumers if p.search else {}, fraction, seed=ctx.index) as sampler,
        ):
            ctx.forward()
        for g in groups:
            self._smooth(ctx, g, consumers, stats.stats, sampler)

    def _smooth(self, ctx, g: BoundGroup, consumers, stats, sampler) -> None:
        layer_consumers = [consumers[c] for c in g.consumers]
        k = layer_consumers[0].in_features
        zeros = torch.zeros(k, device=ctx.device)
        col_absmax = [stats[c].absmax if c in stats else zeros for c in g.consumers]  # [K] each
        n_channels = int(g.channel_map.max()) + 1 if g.channel_map is not None else k
        col_act = torch.stack(col_absmax).amax(dim=0)  # [K]
        act = to_channels(col_act, g.channel_map, n_channels)  # [C]
        p = self.params
        info: dict = {"consumers": [ctx.full_name(c) for c in g.consumers]}
        if p.search:
            inputs = [sampler.samples(c, p.search_tokens, k, ctx.device) for c in g.consumers]
            found = search_alpha(
                inputs,
                [m.weight for m in layer_consumers],
                act,
                p.alpha_grid,
                self.search_scheme,
                g.channel_map,
                col_absmax,
            )
            alpha, s = found.alpha, found.scales
            info["search"] = {
                "scheme": self.search_scheme.name,
                "tokens": [int(x.shape[0]) for x in inputs],
                "grid": list(found.grid),
                "errors": [float(f"{e:.4g}") for e in found.errors],
                "error_unsmoothed": float(f"{found.error_unsmoothed:.4g}"),
            }
        else:
            w_absmax = to_channels(weight_absmax([m.weight for m in layer_consumers]), g.channel_map, n_channels)
            alpha, s = p.fixed_alpha, smoothing_scales(act, w_absmax, p.fixed_alpha)
        fold_group(ctx.layer, g, s, ctx.arch.norm)
        # of the consumers' input columns (under GQA several columns read one channel, each with its own abs-max)
        before, after = outlier_ratio(col_act), outlier_ratio(col_act / column_scales(s, g.channel_map))
        info.update(
            alpha=alpha,
            outlier_before=None if before is None else round(before, 2),
            outlier_after=None if after is None else round(after, 2),
        )
        ctx.record(g.producer, smoothquant=info)
